"""Stale torch-extension build locks: found before DeepSpeed would wait on them forever.

DeepSpeed builds its CPU ops (cpu_adam, fused_adam, shm comm) with torch's JIT extension loader
on first use. The loader guards each build directory with a `lock` file (torch FileBaton): the
builder creates it and keeps it open, every other process polls until it is gone. A build that
was killed (Ctrl-C, OOM, a job scheduler's time limit) leaves the file behind, and every later
run then polls forever with no message. We look before `deepspeed.initialize`: a lock that no
process on this machine holds open and that is older than a build ever takes is reported with
the file to delete.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..errors import UserError

STALE_AFTER_S = 600.0
"""A lock older than this with no local holder is stale (a CPU op builds in 1-2 minutes here)."""


def extensions_root() -> Path:
    """Where torch builds JIT extensions (torch.utils.cpp_extension._get_build_directory's root)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
             else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}"


def _held_open(path: Path) -> bool:
    """True if a process on this machine has `path` open (the builder keeps its lock fd open)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True  # cannot tell (not Linux): assume a live builder rather than raise wrongly
    target = os.path.realpath(path)
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:  # process gone, or not ours to read
            continue
    return False


def stale_locks(root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> list[tuple[Path, float]]:
    """(lock file, age in seconds) for every build lock under `root` that looks abandoned."""
    root = extensions_root() if root is None else root
    if not root.is_dir():
        return []
    now, found = time.time(), []
    for lock in sorted(root.glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # released while we looked
            continue
        if age >= stale_after_s and not _held_open(lock):
            found.append((lock, age))
    return found


def check_build_locks(root: Path | None = None) -> None:
    """Raise ValueError naming the file to delete if DeepSpeed's op build would wait forever."""
    found = stale_locks(root)
    if found:
        lock, age = found[0]
        more = f" (and {len(found) - 1} more under {lock.parent.parent})" if len(found) > 1 else ""
        raise UserError(
            f"stale torch extension build lock {lock}{more}: left {age / 60:.0f} min ago by a build that was "
            f"killed, and DeepSpeed would wait on it forever; delete it (rm {lock}) if no build is running "
            f"on a machine that shares this directory, then rerun")
