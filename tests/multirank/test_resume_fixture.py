"""Checkpoints written by older zerotrain still resume: the current code picks up the old step-2 checkpoint (2 CPU
ranks), continues at step 3 and gives the losses of the old code's straight 4-step run.

- ckpt_d5a6207 (before the "one owner per fact" refactor; DeepSpeed ZeRO-2 and FSDP2): on the data as the old code
  packed it (each 1000-text batch on its own).
- ckpt_5cbb2f1 (before issue 48's one-owner-per-capability move; DeepSpeed ZeRO-3 and FSDP2).

How each fixture was written: its README.md.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.launch import rank_env, torchrun
from zerotrain.checkpoint.store import data_record

pytestmark = pytest.mark.multirank

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OLD_PACKING = {"ckpt_d5a6207": 1, "ckpt_5cbb2f1": 2}
"""The text packing each fixture's code recorded (zerotrain/data/datasets.py TEXT_PACKING)."""
CELLS = [(fixture, name) for fixture in OLD_PACKING
         for name in sorted(json.loads((FIXTURES / fixture / "reference_losses.json").read_text())["runs"])]


def train_rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("fixture, name", CELLS, ids=[f"{f}-{n}" for f, n in CELLS])
def test_old_checkpoint_resumes_and_continues_exactly(tmp_path, fixture, name):
    source = FIXTURES / fixture
    ref = json.loads((source / "reference_losses.json").read_text())
    run = ref["runs"][name]
    out = tmp_path / name
    shutil.copytree(source / name, out)
    saved = train_rows(out / "metrics.jsonl")
    assert [r["step"] for r in saved] == [1, 2]
    flags = [str(source / a) if a == "model_config.json" else a for a in ref["common_flags"]]
    res = torchrun(["-m", "zerotrain", "train", *run["flags"], *flags, "--output", str(out), "--resume",
                    "--max-steps", "4"], env=rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache")), timeout=420)
    # the old run packed its text per 1000-text batch: the resume prepares the same blocks, says so, and its new
    # checkpoints record it so later resumes keep it (zerotrain/data/datasets.py TEXT_PACKING)
    packing = OLD_PACKING[fixture]
    if packing == 1:
        assert "packed per 1000-text batch as when this run started" in res.stdout, res.stdout[-3000:]
    # (and the global batch a later resume keeps: micro-batch 2 x 2 ranks)
    assert data_record(out / "checkpoints" / "global_step4") == {"text_packing": packing, "global_batch": 4}
    rows = train_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # resumed at step 3, the old lines kept
    assert rows[:2] == saved
    assert [r["loss"] for r in rows[2:]] == pytest.approx(run["loss"][2:], rel=1e-5)
    assert [r["lr"] for r in rows[2:]] == pytest.approx(run["lr"][2:], rel=1e-12)
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step4"  # finished: the end checkpoint
