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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: str | Path | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run a command in its own process group; kill the whole group on timeout and raise."""
    res = run_with_timeout(cmd, timeout, env=env or rank_env(), cwd=cwd or REPO)
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
             check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N <args>` on 127.0.0.1 with a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *map(str, args)]
    return run(cmd, timeout=timeout, env=env, check=check)


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
