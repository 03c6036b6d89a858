"""Torch-extension build locks made as torch's FileBaton makes them, for the lock and doctor tests."""
from __future__ import annotations

import os
import time
from pathlib import Path


def make_lock(root: Path, op: str, age_s: float) -> Path:
    """A build lock as torch's FileBaton creates it, `age_s` old, held by no process."""
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR))  # what FileBaton.try_acquire does
    old = time.time() - age_s
    os.utime(lock, (old, old))
    return lock
