"""Warm interpreters for the tests' launches: the ranks start from a process that has imported torch already.

Every rank of every launch used to import torch, torch._dynamo, datasets and transformers from scratch: about 4 s
of CPU per rank here, most of a short test's wall time (docs/testing.md, "CI time: warm rank start-up"). A warm
interpreter imports them once and forks a child per rank: the child is a fresh process (its own pid, session,
environment, argv, cwd and stdio files) that runs `python -m MODULE ARGS` or `python SCRIPT ARGS` with runpy and
ends as the interpreter would (non-daemon threads joined, then atexit, then exit with the code).

What a child does not share with a cold start, and why the tests still mean what they did:
- Nothing of zerotrain, deepspeed or transformers' model code is preloaded: zerotrain's own import decisions
  (torchao hidden when nothing is quantized, deepspeed hidden under FSDP) run in the child as in a user's rank.
- Each rank index has its own warm interpreter, so the ranks of a launch still hash strings differently (a set's
  order differs between ranks, as between real processes). Unlike real processes, rank r keeps its hash seed from
  one launch to the next (a run and its resume): set ZEROTRAIN_TEST_COLD_START=1 to test against that.
- A warm child ends with os._exit after its threads and atexit: objects still open are not finalised (a destructor's
  warning at interpreter exit is not printed); tests of shutdown output start cold.
- A launch whose environment changes what the preloaded libraries read at import (HF_*, TRANSFORMERS_*,
  PYTHONPATH, ...; see `_IMPORT_TIME`) or whose command is not `python -m`/`python SCRIPT` starts cold, as before.
- The preload runs no tensor op, so no thread pool exists yet when a child forks (checked at start; OMP_NUM_THREADS
  is 1 in the ranks' environment, tests/support/launch.py rank_env).

Protocol: one Unix socket per warm interpreter; a client sends one JSON request per connection, the server forks,
replies {"pid": N}, and later {"status": waitpid status} when the child ends. The server runs single-threaded.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "datasets", "transformers", "tokenizers",
           "safetensors.torch", "yaml", "pydantic", "torch._inductor.compile_fx", "transformers.loss.loss_utils")
"""What every rank imports anyway, none of it code under test (about 5.5 s of CPU per rank here). torch's inductor:
DeepSpeed imports its Muon optimizer in every ZeRO run (runtime/zero/utils.py), whose `torch.compile` decorators
import inductor (1.1 s); transformers' loss functions (scipy, 0.4 s) come with `transformers.modeling_utils`,
which itself is not preloaded (zerotrain imports it with torchao hidden: model/quant.py)."""

_IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "OMP_",
                "MKL_", "KMP_", "PYTHON", "LD_", "CUDA", "XDG_", "HOME", "TMPDIR", "NUMPY", "OPENBLAS", "ARROW")
"""Prefixes of variables the preloaded libraries may read at import: a launch that changes one starts cold."""
_RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_FR_", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK",
             "KMP_DUPLICATE_LIB_OK")
"""...except these, read at run time: torchrun's worker variables and the flight recorder's (TORCH_FR_BUFFER_SIZE),
when the first process group starts; inductor's cache folder, on each use (torch/_inductor/runtime/cache_dir_utils.py
cache_dir(); the preload compiles nothing), so that tests/multirank/test_compile.py's launches, one cache folder for
the module, start warm (about 7 s each here); the variable `import deepspeed` sets in the test process
(torch/cuda/__init__.py reads it per call): an environment made before that import differed from one made after it,
and the launch started cold; KMP_DUPLICATE_LIB_OK, which threadpoolctl and inductor's C++ builder set in the test
process, read only by Intel's OpenMP runtime as a copy of it starts (the preload loads none: torch's is GNU libgomp;
92 of a CI's rank starts were cold for it alone)."""


# --- the server --------------------------------------------------------------------------------------------


def _child(request: dict, listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: become the requested process and never return."""
    code = 1
    try:
        listener.close()
        for c in conns:
            c.close()
        os.setsid()  # its own session: the client's timeout kills its whole group
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fd_err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        import io

        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))  # -u: every write reaches the file at once
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False) if unbuffered else open(1, "wb", closefd=False),
                                      write_through=unbuffered)  # to a file: block-buffered unless -u, as CPython
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import numpy as np

        np.random.seed()  # numpy's global generator is seeded at import: give each child its own, as a cold start
        import runpy

        args = request["args"]
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)
            run = lambda: runpy.run_path(args[0], run_name="__main__")  # noqa: E731
        try:
            run()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:  # CPython ends by SIGINT then (exit status -2), not with 1
            import traceback

            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # as the interpreter does for an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        # the interpreter's own ending: join non-daemon threads, then atexit, then flush
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def serve(path: str) -> None:
    """Preload, then fork one child per request on the socket at `path` until stdin closes (the client's end)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    threads = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    others = [t for t in threads[1:] if t != "jemalloc_bg_thd"]
    if others or threading.active_count() != 1:  # a thread would not survive fork: its locks could deadlock a child
        raise SystemExit(f"warm_start: threads {threads} after the preload; cannot fork safely")
    # pyarrow's jemalloc keeps a background thread; jemalloc's own fork handlers make it fork-safe (every
    # DataLoader worker of a real run forks beside it too)
    import gc

    gc.collect()
    gc.freeze()  # the preloaded modules' objects: a child's gc passes (two per teardown) skip them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting: dict[int, socket.socket] = {}
    conns: list[socket.socket] = []
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.02):
            if key.data == "stdin":
                if not sys.stdin.readline():  # the client is gone
                    for pid in waiting:
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                conn.settimeout(10)  # a stalled client must not stop the others' launches or the reaping
                data = b""
                try:
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    request = json.loads(data)
                except (OSError, ValueError):  # a bad request ends its connection, not the server
                    conn.close()
                    continue
                conn.settimeout(None)
                pid = os.fork()
                if pid == 0:
                    _child(request, listener, [*conns, conn])
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
                conns.append(conn)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
                conns.remove(conn)


# --- the client --------------------------------------------------------------------------------------------


class WarmInterpreter:
    """One warm server process (started on first use, ended with the test session)."""

    def __init__(self, base_env: Mapping[str, str], index: int):
        self.base_env = dict(base_env)
        self.dir = tempfile.mkdtemp(prefix=f"zt-warm{index}-")
        self.path = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.base_env, text=True)
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            line = self.proc.stdout.readline()
            self.ready = line.strip() == "ready"
        return self.ready

    def differs(self, env: Mapping[str, str]) -> list[str]:
        """The import-time variables whose value in `env` is not the server's (sorted): none, and a child with `env`
        sees what a cold start would."""
        keys = set(env) | set(self.base_env)
        return sorted(k for k in keys if k.startswith(_IMPORT_TIME) and not k.startswith(_RUN_TIME)
                      and env.get(k) != self.base_env.get(k))

    def start(self, args: Sequence[str], env: Mapping[str, str], cwd: str, stdout: str, stderr: str) -> "WarmChild":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        request = {"args": list(map(str, args)), "env": dict(env), "cwd": str(cwd), "stdout": stdout,
                   "stderr": stderr}
        sock.sendall(json.dumps(request).encode() + b"\n")
        child = WarmChild(sock)
        child.pid = json.loads(child.line(time.monotonic() + 60))["pid"]
        return child

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


class WarmChild:
    """A started child: wait for it (with a deadline), or kill its whole group."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""
        self.pid = 0
        self.returncode: Optional[int] = None

    def line(self, deadline: float) -> Optional[str]:
        """The server's next line; None at the deadline; '' when the server closed the connection."""
        while b"\n" not in self.buf:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))  # at least one look: a poll
            try:
                chunk = self.sock.recv(4096)
            except (socket.timeout, TimeoutError):
                return None
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def _ended(self, line: str) -> None:
        self.returncode = os.waitstatus_to_exitcode(json.loads(line)["status"]) if line else -9
        self.sock.close()

    def wait(self, deadline: float) -> bool:
        """True when it ended before the monotonic `deadline`."""
        line = self.line(deadline)
        if line is None:
            return False
        self._ended(line)
        return True

    def kill(self) -> None:
        """SIGKILL its whole group (its session) and collect its status."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._ended(self.line(time.monotonic() + 30) or "")


if __name__ == "__main__":
    serve(sys.argv[1])
