"""Launch real ranks for tests: torchrun (or any command) on 127.0.0.1 with a free port and a hard timeout.

`torchrun` is what users run (the CLI tests use it); `ranks` starts the same ranks directly, without torch's
elastic agent, for the parity workers (tests/support/engine_worker.py): the same env:// rendezvous over gloo with
the workers' own collective timeouts, one process less to start per launch.

A run that exceeds its timeout is killed as a whole process group and the test fails (no hang).
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.warm_start import WarmInterpreter
from zerotrain.launch.subprocess_run import run_with_timeout
from zerotrain.util import free_port  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parents[2]


def rank_env(**extra: str) -> dict:
    """Environment for launched ranks: offline hub, quiet, repo importable."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


DISK_FULL = REPO / "tests" / "support" / "disk_full"
"""The folder of the disk-full sitecustomize (tests/support/disk_full/sitecustomize.py)."""


def disk_full_env(spec: str, **extra: str) -> dict:
    """rank_env with a full disk injected from outside zerotrain: the disk-full sitecustomize first on the ranks'
    PYTHONPATH and ZT_TEST_DISK_FULL=spec ("rank=1:path=global_step4": rank 1's writes of matching paths raise
    OSError(ENOSPC))."""
    env = rank_env(ZT_TEST_DISK_FULL=spec, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(DISK_FULL), env["PYTHONPATH"]])
    return env


_WARM: dict[int, WarmInterpreter] = {}
"""The warm interpreters (tests/support/warm_start.py), one per rank index, started on first use."""


MEASURES_MEMORY = ("ZEROTRAIN_MODEL_STATE_DIR", "ZEROTRAIN_TEST_COLD_START")
"""A launch whose environment sets one of these starts cold: a forked child's resident set is not a cold
process's (the preload's library pages are not in its page tables until touched), and peak RSS is measured."""


STARTS: Counter = Counter()
"""How the tests' Python processes started this session: "warm", or "cold: <why>" (printed at the end of the run by
tests/conftest.py: a cold start costs about 7 s of imports here, the number to watch when CI time grows)."""


def _started(warm: WarmInterpreter | None, env: dict) -> bool:
    """Whether a process with `env` can fork from `warm`; counted in STARTS either way."""
    if warm is None:
        STARTS["cold: asked for (ZEROTRAIN_TEST_COLD_START, memory measured) or no warm server ready"] += 1
        return False
    differ = warm.differs(env)
    STARTS["cold: " + ", ".join(differ) if differ else "warm"] += 1
    return not differ


def _warm(index: int, env: dict | None = None) -> WarmInterpreter | None:
    if os.environ.get("ZEROTRAIN_TEST_COLD_START") == "1" or any(env and env.get(k) for k in MEASURES_MEMORY):
        return None
    if index not in _WARM:
        import atexit

        _WARM[index] = WarmInterpreter(rank_env(), index)
        atexit.register(_WARM[index].close)
    warm = _WARM[index]
    return warm if warm.wait_ready() else None


def _run_warm(cmd: list[str], timeout: float, env: dict, cwd: str | Path):
    """`python -m X ...` / `python SCRIPT ...` forked from a warm interpreter (same process, env, argv, cwd and
    timeout as a cold start); None where it must start cold."""
    if str(cmd[0]) != sys.executable or len(cmd) < 2:  # ZEROTRAIN_TEST_COLD_START: _warm says None
        return None
    args = [str(c) for c in cmd[1:]]
    if args[0].startswith("-") and not (args[0] == "-m" and len(args) > 1):
        return None
    if not _started(warm := _warm(int(env.get("RANK", "0") or 0), env), env):
        return None
    import tempfile
    import time

    from zerotrain.launch.subprocess_run import Finished

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zt-run-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        child = warm.start(args, env, str(cwd), out, err)
        timed_out = not child.wait(t0 + timeout)
        if timed_out:
            child.kill()
        read = lambda p: Path(p).read_text(errors="replace") if os.path.exists(p) else ""  # noqa: E731
        return Finished(child.returncode if child.returncode is not None else -9, read(out), read(err), timed_out,
                        time.monotonic() - t0)


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: str | Path | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run a command in its own process group; kill the whole group on timeout and raise. A Python command
    starts from a warm interpreter where it can (tests/support/warm_start.py)."""
    env, cwd = env or rank_env(), cwd or REPO
    res = _run_warm(cmd, timeout, env, cwd) or run_with_timeout(cmd, timeout, env=env, cwd=cwd)
    if res.timed_out or (check and res.returncode != 0):
        what = f"timed out after {timeout}s" if res.timed_out else f"exit {res.returncode}"
        raise AssertionError(f"{what}: {' '.join(map(str, cmd))}\n"
                             f"--- stdout ---\n{res.stdout[-4000:]}\n--- stderr ---\n{res.stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, res.returncode, res.stdout, res.stderr)


def run_parallel(cmds: list[list[str]], timeout: float = 300, envs: list[dict] | None = None,
                 cwd: str | Path | None = None) -> list[subprocess.CompletedProcess]:
    """Run the commands at once (one per node or rank), each as `run` does; results in order."""
    with ThreadPoolExecutor(len(cmds)) as pool:
        return list(pool.map(lambda c, e: run(c, timeout, e, cwd), cmds, envs or [None] * len(cmds)))


def torchrun(args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None,
             check: bool = True, agent: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N <args>` on 127.0.0.1 with a free port.

    The ranks see what torchrun gives its workers (its variables, rank 0's store, OMP_NUM_THREADS) and get its
    policy on a failure (the other ranks are sent SIGTERM, then SIGKILL after 30 s; the launch exits 1), but start
    directly from warm interpreters (tests/support/warm_start.py) without the elastic agent. `agent=True` runs
    torch's elastic agent itself: for tests of what the agent does (its report, its restarts), and for every
    $ZEROTRAIN_FAULT run (a killed or hung rank is the agent's to end)."""
    env = env or rank_env()
    if not agent and "ZEROTRAIN_FAULT" not in env and os.environ.get("ZEROTRAIN_TEST_COLD_START") != "1":
        return _workers(list(map(str, args)), nproc, timeout, env, check)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *map(str, args)]
    return run(cmd, timeout=timeout, env=env, check=check)


def _workers(args: list[str], nproc: int, timeout: float, env: dict, check: bool) -> subprocess.CompletedProcess:
    """torchrun's worker group without its agent: each rank `python <args>` with the worker variables of
    torch/distributed/elastic/agent/server/local_elastic_agent.py, watched as the agent watches them."""
    import signal
    import tempfile
    import time
    import uuid

    port, run_id = str(free_port()), uuid.uuid4().hex[:8]
    cmd = [sys.executable, *args]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zt-ranks-") as tmp:
        procs = []
        for r in range(nproc):
            rank_vars = {"RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                         "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
                         "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                         "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                         "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
            procs.append(_Rank(cmd, {**env, **rank_vars}, REPO, os.path.join(tmp, str(r))))
        failed_at, timed_out = None, False
        while any(p.code is None for p in procs):
            for p in procs:
                p.poll()
            if failed_at is None and any(p.code not in (None, 0) for p in procs):
                failed_at = time.monotonic()  # as the agent: stop the group, SIGKILL what is left after 30 s
                for p in procs:
                    p.signal(signal.SIGTERM)
            if failed_at is not None and time.monotonic() - failed_at > 30:
                for p in procs:
                    p.signal(signal.SIGKILL)
            if time.monotonic() - t0 > timeout:
                timed_out = True
                for p in procs:
                    p.signal(signal.SIGKILL)
                for p in procs:
                    p.poll(block=True)
            time.sleep(0.02)
        out = "".join(p.read("out") for p in procs)
        err = "".join(p.read("err") for p in procs)
    code = 0 if all(p.code == 0 for p in procs) else 1
    if timed_out or (check and code != 0):
        what = f"timed out after {timeout}s" if timed_out else f"exit {[p.code for p in procs]}"
        raise AssertionError(f"{what}: {' '.join(cmd)} ({nproc} ranks, torchrun's worker variables)\n"
                             f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-8000:]}")
    return subprocess.CompletedProcess(cmd, code, out, err)


class _Rank:
    """One rank of `_workers`: forked from a warm interpreter where it can be, else a cold process; stdout and
    stderr to files under `stem`, in a session of its own."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path, stem: str):
        self.stem, self.code = stem, None
        warm = _warm(int(env["RANK"]), env)
        self.child = self.popen = None
        if _started(warm, env):
            self.child = warm.start(cmd[1:], env, str(cwd), stem + ".out", stem + ".err")
            self.pid = self.child.pid
        else:
            with open(stem + ".out", "w") as out, open(stem + ".err", "w") as err:
                self.popen = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True)
            self.pid = self.popen.pid

    def poll(self, block: bool = False) -> None:
        import time

        if self.code is not None:
            return
        if self.child is not None:
            if self.child.wait(time.monotonic() + (60 if block else 0)):
                self.code = self.child.returncode
        else:
            self.code = self.popen.wait() if block else self.popen.poll()

    def signal(self, sig: int) -> None:
        # a warm child is reaped by its server, which reports it within ~20 ms: a pid reused inside that window
        # is the (accepted) race; a cold one is not reaped before poll() sees it, so its pid is not reused
        if self.code is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def read(self, kind: str) -> str:
        path = Path(f"{self.stem}.{kind}")
        return path.read_text(errors="replace") if path.exists() else ""


def ranks(args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None,
          check: bool = True) -> subprocess.CompletedProcess:
    """`python <args>` as nproc ranks on 127.0.0.1 with a free port, started directly (no elastic agent): the
    variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each rank
    in its own process group under `run`'s timeout. The result holds every rank's stdout and stderr (rank order)
    and the first non-zero exit code. A rank that fails leaves its peers to their collective timeout (the
    workers set one), then the hard timeout: never a hang."""
    port = str(free_port())
    base = env or rank_env()
    envs = [{**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "LOCAL_RANK": str(r),
             "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)} for r in range(nproc)]
    cmd = [sys.executable, *map(str, args)]
    procs = run_parallel([cmd] * nproc, timeout=timeout, envs=envs)
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    out = "".join(p.stdout for p in procs)
    err = "".join(p.stderr for p in procs)
    if check and code != 0:
        raise AssertionError(f"exit {code}: {' '.join(cmd)} ({nproc} ranks)\n"
                             f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-8000:]}")
    return subprocess.CompletedProcess(cmd, code, out, err)
