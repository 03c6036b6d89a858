"""A full disk while writing final/ or an export, injected from outside zerotrain (tests/support/disk_full/
sitecustomize.py on the ranks' PYTHONPATH: every open-for-write of a matching path raises OSError(ENOSPC)), and the
test hooks refused or announced at start. Real ranks through `python -m zerotrain train/export` as users run them.

The failed run must exit non-zero with ONE line naming rank 0, the path, "No space left on device" and the kept
checkpoint, no traceback, no final/ and no partial directory, every checkpoint complete; exporting its latest
checkpoint gives the weights of the same run done straight through (whose $ZEROTRAIN_FAULT, armed at a step the run
never reaches, is named in the banner), and so does rerunning the failed run with --resume auto (slow cell).
DeepSpeed ZeRO-2 trains a GPT-2, FSDP2 a Llama (tests/support/families.py's shapes, the tiny presets); CI runs the
DeepSpeed cell, the FSDP cell is `slow`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import disk_full_env, rank_env, run, torchrun
from tests.multirank.test_elastic import BACKENDS
from tests.multirank.test_elastic import train_args as elastic_train_args
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

def train_args(backend: str, out: Path, *extra: str) -> list[str]:
    """test_elastic's short run (its BACKENDS: DeepSpeed ZeRO-2 GPT-2, FSDP2 Llama), 4 steps, a checkpoint every 2."""
    return ["-m", "zerotrain", *elastic_train_args(backend, out, "--max-steps", "4", *extra)]


def weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    assert files, f"no safetensors in {d}: {sorted(p.name for p in d.iterdir())}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7, msg=k)


def assert_no_traceback(stderr: str) -> None:
    """No Python traceback from any rank: the only one allowed is torchrun's own ChildFailedError summary (the
    launcher's, after its ranks exited non-zero), and no frame of zerotrain's code is printed."""
    tracebacks = stderr.count("Traceback (most recent call last)")
    launcher = sum(ln.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
                   for ln in stderr.splitlines())
    assert tracebacks <= launcher, stderr[-6000:]
    assert not [ln for ln in stderr.splitlines() if ln.strip().startswith("File ") and "/zerotrain/" in ln], stderr


def assert_one_line(stderr: str, *needles: str) -> str:
    """The error line holding every needle; no traceback from the ranks."""
    assert_no_traceback(stderr)
    hits = [ln for ln in stderr.splitlines() if all(n in ln for n in needles)]
    assert hits, f"no line with {needles} in:\n{stderr[-6000:]}"
    return hits[0]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return rank_env(ZEROTRAIN_CACHE=str(tmp_path_factory.mktemp("oserr_cache")))


@pytest.mark.parametrize("backend", cells(BACKENDS, {"fsdp"}))
def test_final_on_a_full_disk_is_one_line_and_the_checkpoint_exports_the_same_weights(tmp_path, env, backend):
    # the straight run, with a test fault armed at a step it never reaches: named in the banner, never fires
    straight = tmp_path / "straight"
    res = torchrun(train_args(backend, straight), env={**env, "ZEROTRAIN_FAULT": "hang:rank=1:step=99"}, timeout=300)
    banner = assert_one_line(res.stdout, "$ZEROTRAIN_FAULT=hang:rank=1:step=99 is set", "hang rank 1 after step 99")
    assert "unset ZEROTRAIN_FAULT" in banner
    assert (straight / "final" / "config.json").is_file() and not leftovers(straight)

    # the same run with rank 0's disk full under final/ (safetensors writes from Rust: config.json comes first)
    out = tmp_path / "failed"
    res = torchrun(train_args(backend, out), env=disk_full_env("rank=0:path=/final/", ZEROTRAIN_CACHE=env["ZEROTRAIN_CACHE"]), timeout=300, check=False)
    assert res.returncode != 0, res.stdout[-3000:]
    ckpts = out / "checkpoints"
    line = assert_one_line(res.stderr, "rank 0:", "No space left on device (ENOSPC)", "/final/config.json")
    print(line)  # shown with -s: the line a user reads
    assert f"{ckpts / 'global_step4'}" in line and "zerotrain export" in line, line  # kept, and the fix
    assert_one_line(res.stderr, "another rank failed")  # rank 1 stopped with it, in one line, instead of waiting
    assert not (out / "final").exists() and not leftovers(out)
    assert (ckpts / "latest").read_text().strip() == "global_step4"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("global_step")) == ["global_step2",
                                                                                           "global_step4"]

    # exporting it on a full disk: one line, nothing left, the checkpoint untouched
    before = sorted((p.relative_to(ckpts), p.stat().st_size) for p in ckpts.rglob("*") if p.is_file())
    exported = tmp_path / "exported"
    res = run([sys.executable, "-m", "zerotrain", "export", str(ckpts), str(exported)],
              env=disk_full_env("rank=any:path=/exported/", ZEROTRAIN_CACHE=env["ZEROTRAIN_CACHE"]), timeout=240)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-4000:]
    line = assert_one_line(res.stderr, "zerotrain export: error:", "No space left on device (ENOSPC)", "/exported/")
    print(line)
    assert f"{ckpts / 'global_step4'} untouched" in line and f"no {exported} written" in line, line
    assert not exported.exists() and not leftovers(tmp_path)
    assert sorted((p.relative_to(ckpts), p.stat().st_size) for p in ckpts.rglob("*") if p.is_file()) == before

    # with room: the checkpoint the line names exports the straight run's final/ weights
    run([sys.executable, "-m", "zerotrain", "export", str(ckpts), str(exported)], env=env, timeout=240, check=True)
    assert_same_weights(exported, straight / "final")
    assert not leftovers(tmp_path)
    if backend == "fsdp":  # the slow cell also reruns the failed run with --resume auto (CI time: one run less)
        res = torchrun(train_args(backend, out, "--resume", "auto"), env=env, timeout=300)
        assert f"resuming from {ckpts / 'global_step4'}" in res.stdout, res.stdout[-3000:]
        assert_same_weights(out / "final", straight / "final")
        assert not leftovers(out)


def test_a_malformed_fault_hook_is_refused_before_step_1(tmp_path, env):
    out = tmp_path / "run"
    res = torchrun(train_args("deepspeed", out), env={**env, "ZEROTRAIN_FAULT": "kill:rank=1:stpe=3"}, timeout=240,
                   check=False)
    assert res.returncode != 0
    line = assert_one_line(res.stderr, "zerotrain train: error: $ZEROTRAIN_FAULT='kill:rank=1:stpe=3'",
                           "must name rank= and step=")
    # every rank refuses, each once; torchrun may end rank 1 before it prints when rank 0 exits first (CI of a036fab)
    assert sum("$ZEROTRAIN_FAULT=" in ln for ln in res.stderr.splitlines()) in (1, 2), res.stderr
    assert "unset ZEROTRAIN_FAULT" in line
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or not [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
