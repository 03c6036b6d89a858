"""The whole-run peak estimator's calibration (benchmarks/PEAK_CALIBRATION.md), read from the committed results.

- The fingerprint PEAK_CALIBRATION.md quotes is the fitted constants' one: a constant changed after the held-out
  validation fails here, and the held-out runs must be redone (not refitted to).
- Every held-out result was predicted with those constants, finished, and is reported in the markdown.
- zerotrain.memory.runtime.CALIBRATED claims only what measured runs cover, and each held-out run inside it is
  within the 15% the estimator is held to.
- A plan outside the region says why, in `zerotrain estimate` and in tune's rows and pruning reasons.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotrain.config.load import build_config
from zerotrain.memory.estimate import Setup, estimate, setup_plan
from zerotrain.memory.runtime import CALIBRATED, constants_fingerprint, outside_calibration
from zerotrain.model.facts import model_facts

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "benchmarks" / "PEAK_CALIBRATION.md"
IN_SAMPLE = REPO / "benchmarks" / "results" / "peak_in_sample.json"
HELD_OUT = REPO / "benchmarks" / "results" / "peak_heldout.json"
TOLERANCE_PCT = 15.0


def _results(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if v.get("measured")}


def test_the_quoted_fingerprint_is_the_constants_one() -> None:
    assert f"`{constants_fingerprint()}`" in DOC.read_text(), (
        "a fitted constant in zerotrain/memory/runtime.py changed after the held-out validation: rerun "
        "`python benchmarks/peak_calibration.py run --set held-out` and quote the new fingerprint")


def test_held_out_runs_used_these_constants_and_are_reported() -> None:
    held = json.loads(HELD_OUT.read_text())
    assert len(held) >= 25
    doc = DOC.read_text()
    for name, r in held.items():
        assert r["rc"] == 0 and r["measured"], name
        assert r["constants_fingerprint"] == constants_fingerprint(), name
        assert f"| {name} |" in doc, f"{name} is not in PEAK_CALIBRATION.md's held-out table"


def test_the_region_claims_only_what_was_measured() -> None:
    runs = list(_results(IN_SAMPLE).values()) + list(_results(HELD_OUT).values())
    covers = [r["covers"] for r in runs]
    assert {c["device"] for c in covers} == {CALIBRATED.device}
    assert set(CALIBRATED.world_sizes) <= {c["world_size"] for c in covers}
    assert CALIBRATED.max_params <= max(c["num_params"] for c in covers)
    assert set(CALIBRATED.model_types) <= {c["model_type"] for c in covers}
    assert set(CALIBRATED.dtypes) <= {c["dtype"] for c in covers}
    assert CALIBRATED.max_tokens_per_micro_batch <= max(c["tokens_per_micro_batch"] for c in covers)
    assert CALIBRATED.max_tp <= max(c["tp"] for c in covers) and CALIBRATED.max_pp <= max(c["pp"] for c in covers)
    assert CALIBRATED.max_sp <= max(c.get("sp", 1) for c in covers)
    for flag in ("lora", "offload_param", "gradient_checkpointing"):
        assert not getattr(CALIBRATED, flag) or any(c[flag] for c in covers), flag


def test_every_held_out_run_inside_the_region_is_within_tolerance() -> None:
    held = _results(HELD_OUT)
    for name, r in held.items():
        c = r["covers"]
        inside = (c["num_params"] <= CALIBRATED.max_params and c["model_type"] in CALIBRATED.model_types
                  and c["dtype"] in CALIBRATED.dtypes and c["tp"] <= CALIBRATED.max_tp
                  and c["pp"] <= CALIBRATED.max_pp and c.get("sp", 1) <= CALIBRATED.max_sp
                  and (CALIBRATED.lora or not c["lora"])
                  and c["tokens_per_micro_batch"] <= CALIBRATED.max_tokens_per_micro_batch)
        if inside:
            assert abs(r["error_pct"]) <= TOLERANCE_PCT, f"{name}: {r['error_pct']:+.1f}% inside the claimed region"


def _plan(world: int = 2, device: str = "cpu", **settings):
    cfg = build_config(overrides={k.replace("__", "."): v for k, v in settings.items()})
    return setup_plan(cfg, Setup("deepspeed", 2), world, facts=model_facts("tiny-gpt2"), device=device)


def test_a_plan_outside_the_region_says_why() -> None:
    spec = model_facts("tiny-gpt2")
    assert outside_calibration(_plan(), spec) == []
    assert estimate(_plan()).outside_calibration == []
    why = outside_calibration(_plan(4, "cuda", batch__micro_batch=64, data__seq_len=256), spec)
    assert any(w.startswith("device cuda") for w in why) and any(w.startswith("4 ranks") for w in why)
    assert any(w.startswith("16,384 tokens per micro-batch") for w in why)
    pp = build_config(overrides={"parallel.pp": 2, "batch.grad_accum": 2})
    assert "pp 2 (largest measured: 1)" in outside_calibration(
        setup_plan(pp, Setup("deepspeed", 1), 2, facts=spec, device="cpu"), spec)


def test_estimate_cli_names_the_uncalibrated_rows(capsys) -> None:
    from zerotrain.cli import main

    assert main(["estimate", "--model", "tiny-gpt2", "--nproc", "2", "--micro-batch", "8"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("outside the calibrated region"))
    assert "1,024 tokens per micro-batch (largest measured: 512)" in line and "PEAK_CALIBRATION.md" in line
    assert main(["estimate", "--model", "tiny-gpt2", "--nproc", "2"]) == 0
    assert "outside the calibrated region" not in capsys.readouterr().out


@pytest.mark.parametrize("outside,said", [("", False), ("pp 2 (largest measured: 1)", True)])
def test_a_pruned_candidate_outside_the_region_says_so(outside: str, said: bool) -> None:
    from zerotrain.search.tune_decisions import prune

    rows = [{"name": "a", "status": "", "reason": "", "predicted_peak_bytes": 700 * 2**20,
             "outside_calibration": outside}]
    prune(rows, 650 * 2**20, 0.1)
    assert rows[0]["status"] == "pruned"
    assert ("outside the calibrated region (pp 2 (largest measured: 1))" in rows[0]["reason"]) == said
