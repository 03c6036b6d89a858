"""`zerotrain doctor`: the real command on this machine prints one true line per check and exits 0; a stale
build lock, an unreachable host or an op build that fails is one FAIL line naming it, and exit 1; nothing is
built unless --build-ops asks, and a failed build leaves no lock behind."""
from __future__ import annotations

import importlib.metadata
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.build_locks import make_lock
from tests.support.launch import rank_env, run
from zerotrain.cli import main
from zerotrain.distributed.jit_locks import STALE_AFTER_S

LINE = re.compile(r"^(ok    |warn  |FAIL  )\S")
NET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR")
"""Unset for these runs: the network line then depends on this machine only, not on the CI's variables."""


def _lines(out: str) -> tuple[list[str], str]:
    """(check lines, summary line); every line but the summary is one check."""
    *checks, summary = out.strip().splitlines()
    assert all(LINE.match(ln) for ln in checks), out
    assert summary.startswith("doctor: "), out
    return checks, summary


def _doctor(argv: list[str], capsys) -> tuple[int, list[str], str]:
    rc = main(["doctor", *argv])
    checks, summary = _lines(capsys.readouterr().out)
    return rc, checks, summary


@pytest.fixture
def ext(tmp_path, monkeypatch) -> Path:
    """A private, empty torch extension directory, and no network variables."""
    root = tmp_path / "ext"
    root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    for var in NET_VARS:
        monkeypatch.delenv(var, raising=False)
    return root



@pytest.mark.multirank
def test_real_doctor_on_this_machine(tmp_path):
    """`python -m zerotrain doctor`: the versions are importlib.metadata's, the bf16 line is oneDNN's answer,
    nothing fails, and nothing is built (the extension directory stays empty)."""
    root = tmp_path / "ext"
    root.mkdir()
    env = rank_env(TORCH_EXTENSIONS_DIR=str(root))
    for var in NET_VARS:
        env.pop(var, None)
    res = run([sys.executable, "-m", "zerotrain", "doctor"], timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    checks, summary = _lines(res.stdout)
    assert f"ok    torch {importlib.metadata.version('torch')} (CUDA {torch.version.cuda or 'none'})" in checks
    assert f"ok    transformers {importlib.metadata.version('transformers')}" in checks
    for dist in ("deepspeed", "peft", "torchao"):  # installed by the test extra; optional for a run
        assert f"ok    {dist} {importlib.metadata.version(dist)}" in checks, res.stdout
    bf16 = [ln for ln in checks if ln[6:].startswith("bf16 ")]
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert len(bf16) == 1 and bf16[0].startswith("ok    bf16 native" if native else "warn  bf16 slow"), bf16
    assert f"ok    no torch extension build lock under {root}" in checks
    for op in ("cpu_adam", "fused_adam"):  # reported, not built
        assert f"warn  op {op}: compatible, not built yet" in "\n".join(checks), res.stdout
    assert list(root.iterdir()) == [], "doctor built something without --build-ops"
    assert sum(ln.startswith("FAIL") for ln in checks) == 0
    assert [ln for ln in checks if ln[6:].startswith("network: ")], res.stdout
    n_ok, n_warn = sum(ln.startswith("ok ") for ln in checks), sum(ln.startswith("warn") for ln in checks)
    assert summary == f"doctor: {n_ok} ok, {n_warn} warn, 0 FAIL: ready to run"


def test_stale_build_lock_is_one_fail_line_and_exit_1(ext, capsys):
    lock = make_lock(ext, "fused_adam", age_s=STALE_AFTER_S + 120)
    running = make_lock(ext, "cpu_adam", age_s=10)  # a build in progress: a warning, not a failure
    rc, checks, summary = _doctor([], capsys)
    assert rc == 1
    fails = [ln for ln in checks if ln.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL  stale build lock {lock} (12 min old"), fails
    assert f"rm {lock}" in fails[0]
    assert any(ln.startswith(f"warn  build lock {running}: a build is running") for ln in checks), checks
    assert summary.endswith("1 FAIL: a run would fail: fix the FAIL lines")
    assert lock.exists() and sorted(p.name for p in ext.iterdir()) == ["cpu_adam", "fused_adam"]  # nothing built


def test_unreachable_host_is_one_fail_line_and_exit_1(ext, tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n203.0.113.1 slots=2  # TEST-NET-3: never answers\n")
    start = time.monotonic()
    rc, checks, _ = _doctor(["--hostfile", str(hostfile), "--ssh-timeout", "2"], capsys)
    assert rc == 1
    assert f"ok    hostfile {hostfile}: 2 host(s), 3 rank(s)" in checks
    assert "ok    host localhost: this machine (no ssh)" in checks
    fails = [ln for ln in checks if ln.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith("FAIL  host 203.0.113.1: not reachable over passwordless ssh ("), fails
    assert "ssh -o BatchMode=yes 203.0.113.1 true" in fails[0]
    net = [ln for ln in checks if ln[6:].startswith("network: ")]
    assert len(net) == 1 and not net[0].startswith("FAIL"), net
    assert time.monotonic() - start < 60


def test_missing_socket_interface_is_one_fail_line(ext, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no .deepspeed_env here
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    rc, checks, _ = _doctor([], capsys)
    assert rc == 1
    fails = [ln for ln in checks if ln.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith("FAIL  network: GLOO_SOCKET_IFNAME=nosuch0: no interface nosuch0 "
                                                   "here (have "), fails
    assert "lo" in fails[0] and "set it to one of those, or unset it" in fails[0]


def test_bad_hostfile_is_a_user_error(tmp_path, capsys):
    (tmp_path / "hf").write_text("node1 slots=0\n")
    assert main(["doctor", "--hostfile", str(tmp_path / "hf")]) == 2
    assert "slots must be a positive integer" in capsys.readouterr().err


@pytest.mark.multirank
def test_failed_op_build_is_a_fail_and_leaves_no_lock(tmp_path):
    """--build-ops cpu_adam with a compiler that refuses every compile: a FAIL line with the compiler's error
    (fused_adam, not named, is only reported), exit 1, and torch's build lock is gone (a lock left here would hang every later DeepSpeed run).
    In its own process: torch numbers an extension rebuilt in another directory (cpu_adam_v1), so an
    in-process build here would make this session's later DeepSpeed runs rebuild their ops."""
    root = tmp_path / "ext"
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\ncase " $* " in *" -c "*) echo "cxx: error: no compiling today" >&2; exit 1;; esac\n'
                   'exec g++ "$@"\n')
    cxx.chmod(0o755)
    env = rank_env(TORCH_EXTENSIONS_DIR=str(root), CXX=str(cxx))
    for var in NET_VARS:
        env.pop(var, None)
    res = run([sys.executable, "-m", "zerotrain", "doctor", "--build-ops", "cpu_adam"], timeout=120, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    checks, _ = _lines(res.stdout)
    fails = [ln for ln in checks if ln.startswith("FAIL")]
    assert fails == ["FAIL  op cpu_adam: build failed (Error building extension 'cpu_adam': cxx: error: no compiling "
                     "today); check g++/ninja and the deepspeed/torch versions, then rerun with --build-ops"], res.stdout
    assert "warn  op fused_adam: compatible, not built yet" in res.stdout
    assert "building op cpu_adam (compiling" in res.stderr
    assert (root / "cpu_adam" / "build.ninja").is_file() and not (root / "fused_adam").exists()  # built cpu_adam only
    assert list(root.glob("*/lock")) == []
