"""DeepSpeed's CPU ops built in the background while the unit tests run (issue 66: CI time).

A clean clone makes a new environment, whose include paths change the build commands of DeepSpeed's JIT ops, so every
clean-clone CI builds the shm comm op, fused_adam and cpu_adam once (39 + 56 + 54 s of the 2-core machine in
177e117's log, paid inside the first DeepSpeed cells). The unit tests run first (tests/conftest.py orders them) and
mostly keep one core busy: this process, started at session start at idle CPU priority, builds the ops on the
other one. It loads each op as a rank does (the accelerator's op builder, after zerotrain's ninja pin and cpuinfo
cache: zerotrain/backends/deepspeed/op_builds.py) with the ranks' environment, so the build commands are the ranks'
and their loads find the ops built. A rank that needs an op before it is built waits on torch's build lock, as it
would on another rank's build; a failed build here is reported at the end of the run and the ranks build as before.

    python -m tests.support.op_prebuild     # builds (or just loads) the three ops, one line per op
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")
"""The builders a CPU DeepSpeed run loads: the shm comm op (deepspeed.comm on CPU), fused_adam (DeepSpeed's Adam),
cpu_adam (optimizer offload), in the order the CI cells first need them."""


def start() -> Optional[subprocess.Popen]:
    """The background build, at idle priority, with the ranks' environment; None where DeepSpeed is not installed or the
    accelerator is not the CPU (a GPU machine builds its CUDA ops on first use, as before)."""
    from tests.support.launch import rank_env

    import importlib.util

    import torch

    if importlib.util.find_spec("deepspeed") is None:  # asked without importing it (seconds in a one-file run)
        return None
    if torch.cuda.is_available():
        return None
    log = tempfile.NamedTemporaryFile("w+", prefix="zerotrain-op-prebuild-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.op_prebuild"], env=rank_env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_lowest_priority, start_new_session=True)
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    log.close()
    return proc


def _lowest_priority() -> None:
    """Idle priority for this process and the compilers it starts. A new session is a new scheduler autogroup where
    the kernel has them on (a task's nice then only weighs inside its group, and each group gets an equal share: the
    build slowed the unit tests' 2-thread torch ops 70x in a first try), so the group's own nice is set too."""
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroups (or not allowed): the task's own priority below is what counts
        pass
    os.nice(19)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def outcome(proc: Optional[subprocess.Popen]) -> Optional[str]:
    """One line on how the background build went; a run that ends first (a short one) leaves it building and says so."""
    if proc is None:
        return None
    if proc.poll() is None:  # a short run: left to finish (killed mid-build, it would leave torch's build lock)
        return f"DeepSpeed op prebuild: still building in the background (pid {proc.pid}, log {proc.log_path})"
    out = proc.log_path.read_text().strip().splitlines()
    proc.log_path.unlink(missing_ok=True)
    lines = [ln for ln in out if ln.startswith("op ")]
    if proc.returncode != 0:
        return f"DeepSpeed op prebuild failed (exit {proc.returncode}; the ranks built the ops): " + " | ".join(out[-3:])
    return "DeepSpeed op prebuild (background, idle priority): " + "; ".join(ln.removeprefix("op ") for ln in lines)


def main() -> None:
    from zerotrain.backends.deepspeed import op_builds

    op_builds.install()
    from deepspeed.accelerator import get_accelerator

    for name in OPS:
        t0 = time.perf_counter()
        builder = get_accelerator().create_op_builder(name)
        builder.load(verbose=False)
        print(f"op {builder.name} {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
