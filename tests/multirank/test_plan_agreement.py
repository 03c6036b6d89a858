"""The run plan, DeepSpeed's own config parser, the live engines, the estimate and the start banner agree.

For a grid of run configs (both backends, stages 0-3, offload, bf16, grad-accum given or derived from
a global batch, GPT-2 and Llama), tests/support/plan_worker.py builds the engine on 2 real ranks and reports
each view; the expected values are worked out here from the config alone, not from the plan.
"""
from __future__ import annotations

import json
import re

import pytest

import tests.support.families as families
from tests.support.launch import REPO, torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

WORLD = 2

GRID = {
    "ds-z0-fp32-accum2-gpt2": ("gpt2", {"backend": "deepspeed", "zero.stage": 0, "batch.micro_batch": 2,
                                         "batch.grad_accum": 2}),
    "ds-z2-bf16-offload-global8-llama": ("llama", {"backend": "deepspeed", "zero.stage": 2, "precision.dtype": "bf16",
                                                   "zero.offload_optimizer": "cpu", "batch.micro_batch": 2,
                                                   "batch.global_batch": 8}),
    "ds-z3-bf16-offload-both-gpt2": ("gpt2", {"backend": "deepspeed", "zero.stage": 3, "precision.dtype": "bf16",
                                              "zero.offload_optimizer": "cpu", "zero.offload_param": "cpu",
                                              "batch.micro_batch": 2}),
    "fsdp-z1-fp32-accum2-llama": ("llama", {"backend": "fsdp", "zero.stage": 1, "batch.micro_batch": 2,
                                            "batch.grad_accum": 2}),
    "fsdp-z3-bf16-global8-gpt2": ("gpt2", {"backend": "fsdp", "zero.stage": 3, "precision.dtype": "bf16",
                                           "batch.micro_batch": 2, "batch.global_batch": 8}),
    "fsdp-z0-fp32-llama": ("llama", {"backend": "fsdp", "zero.stage": 0, "batch.micro_batch": 2}),
}
SLOW = {"ds-z0-fp32-accum2-gpt2", "ds-z2-bf16-offload-global8-llama", "fsdp-z3-bf16-global8-gpt2", "fsdp-z0-fp32-llama"}
"""CI: one cell per backend (DeepSpeed ZeRO-3 bf16 with both offloads on GPT-2, FSDP2 stage 1 on Llama)."""


def expected(cfg: dict) -> dict:
    """What the run must be, from the config alone (FSDP has no optimizer-only stage: 1 runs as 2)."""
    stage = cfg["zero.stage"]
    micro = cfg["batch.micro_batch"]
    accum = cfg["batch.global_batch"] // (micro * WORLD) if "batch.global_batch" in cfg else cfg.get("batch.grad_accum", 1)
    return {"stage": 2 if cfg["backend"] == "fsdp" and stage == 1 else stage, "grad_accum": accum,
            "micro_batch": micro, "global_batch": micro * accum * WORLD, "dp": WORLD,
            "dtype": cfg.get("precision.dtype", "fp32"), "offload_optimizer": cfg.get("zero.offload_optimizer", "none"),
            "offload_param": cfg.get("zero.offload_param", "none")}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("plan_models")
    return {fam: families.make_model_dir(fam, root / fam) for fam in ("gpt2", "llama")}


@pytest.mark.parametrize("name", cells(GRID, SLOW))
def test_libraries_agree_with_the_plan(name, models, tmp_path):
    fam, cfg = GRID[name]
    out = tmp_path / "report.json"
    torchrun([REPO / "tests" / "support" / "plan_worker.py", out, models[fam], "causal-lm", json.dumps(cfg)], nproc=WORLD,
             timeout=300)
    r = json.loads(out.read_text())
    want = expected(cfg)
    assert r["backend"] == cfg["backend"]
    plan = {k: r["plan"][k] for k in want}
    assert plan == want, (name, plan, want)
    keys = want.keys() if cfg["backend"] == "deepspeed" else ("stage", "dp", "dtype")
    views = {"live": r["live"], **({"parsed": r["parsed"]} if "parsed" in r else {})}
    for view, got in views.items():
        for key in keys:
            if key in got:
                assert got[key] == want[key], (name, view, key, got[key], want[key])
    if cfg["backend"] == "deepspeed":
        assert set(keys) <= set(r["parsed"]) and set(keys) <= set(r["live"]), "DeepSpeed views incomplete"
    # accumulation as run: step() takes the optimizer step exactly on every grad_accum-th backward
    k = want["grad_accum"]
    assert r["live"]["steps_at_backward"] == [i for i in range(1, k + 2) if i % k == 0], (name, r["live"])
    # the estimate `zerotrain estimate` shows for this config on this world
    est = r["estimate"]
    assert (est["backend"], est["stage"], est["precision"], est["world_size"]) == \
        (cfg["backend"], want["stage"], want["dtype"], WORLD), (name, est)
    assert (est["offload_optimizer"], est["offload_param"]) == (want["offload_optimizer"], want["offload_param"])
    # the start banner states the same layout, batch arithmetic, stage and dtype
    line = r["banner"][0]
    m = re.search(r"(\d+) ranks = data-parallel (\d+); global batch (\d+) = micro (\d+) x accum (\d+) x (\d+) "
                  r"data-parallel; (\w+) ZeRO stage (\d)(?: \(runs as (\d)\))?", line)
    assert m, line
    world, dp, glob, micro, accum, dp2, backend, asked, runs = m.groups()
    assert (int(world), int(dp), int(glob), int(micro), int(accum), int(dp2)) == \
        (WORLD, WORLD, want["global_batch"], want["micro_batch"], k, WORLD), line
    assert backend == cfg["backend"] and int(asked) == cfg["zero.stage"] and int(runs or asked) == want["stage"], line
    assert line.endswith(want["dtype"]), line
    for what in ("optimizer", "param"):
        assert (f"{what} offload cpu" in line) == (want[f"offload_{what}"] == "cpu"), line
    if cfg["backend"] == "fsdp":  # checkpoints record the stage that ran; older ones (the asked stage) load
        assert r["checkpoint"] == {"recorded_stage": want["stage"], "old_meta_loads": True}, r["checkpoint"]
    if want["stage"] != cfg["zero.stage"]:
        assert any("under FSDP runs as stage 2" in n for n in r["banner"][1:]), r["banner"]
