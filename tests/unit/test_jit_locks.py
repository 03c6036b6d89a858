"""A torch-extension build lock left by a killed build is refused with the file to delete, not waited on.

The lock protocol is torch's FileBaton (create with O_EXCL, keep the fd open, delete when done);
these tests create lock files the same way in a private TORCH_EXTENSIONS_DIR.
"""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from tests.support.build_locks import make_lock
from zerotrain.distributed.jit_locks import STALE_AFTER_S, check_build_locks, extensions_root, stale_locks


def test_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions_root().name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")


def test_fresh_lock_is_a_build_in_progress(tmp_path):
    make_lock(tmp_path, "cpu_adam", age_s=30)
    assert stale_locks(tmp_path) == []
    check_build_locks(tmp_path)  # no error: another rank may be building right now


def test_old_lock_without_holder_is_stale(tmp_path):
    lock = make_lock(tmp_path, "fused_adam", age_s=STALE_AFTER_S + 60)
    make_lock(tmp_path, "cpu_adam", age_s=5)
    found = stale_locks(tmp_path)
    assert [p for p, _ in found] == [lock]
    with pytest.raises(ValueError, match=rf"stale torch extension build lock {lock}: left 11 min ago.*rm {lock}"):
        check_build_locks(tmp_path)


def test_old_lock_held_open_by_a_live_builder_is_not_stale(tmp_path):
    lock = make_lock(tmp_path, "cpu_adam", age_s=STALE_AFTER_S * 3)
    holder = subprocess.Popen([sys.executable, "-c", f"import os, sys, time; fd = os.open({str(lock)!r}, os.O_RDWR); "
                               "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert stale_locks(tmp_path) == []
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert [p for p, _ in stale_locks(tmp_path)] == [lock]  # the holder died: now it is abandoned


def test_train_refuses_with_one_line_instead_of_hanging(tmp_path, monkeypatch):
    """The real CLI on the DeepSpeed backend: exit 2 with the lock named, before any process group."""
    pytest.importorskip("deepspeed")
    from zerotrain.assets.demo import build_tiny
    from zerotrain.cli import main

    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))
    model = build_tiny(tmp_path / "tiny", preset="tiny-gpt2")
    ext = tmp_path / "ext"
    lock = make_lock(ext, "fused_adam", age_s=STALE_AFTER_S * 2)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["train", "--model", str(model), "--backend", "deepspeed", "--max-steps", "1",
                   "--output", str(tmp_path / "out")])
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("zerotrain")]
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith(f"zerotrain train: error: stale torch extension build lock {lock}")
    assert lock.exists()  # never deleted for the user: another machine may share the directory
