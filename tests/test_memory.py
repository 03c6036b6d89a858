"""Memory estimator and measurement.

Fast tests check the formulas (against the ZeRO paper's own figures) and the storage-deduplicated
measurement in one process. Slow tests launch 2 real ranks per configuration (tests/memory_worker.py)
and hold the prediction to 5% of the measured model-state bytes and 20% of the measured peak RSS.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch import torchrun
from zerotrain.config import build_config
from zerotrain.measure import measure_model_state_bytes
from zerotrain.memory import Estimate, Setup, estimate, setup_plan, setups
from zerotrain.model_info import ModelFacts, model_facts
from zerotrain.util import peak_rss_bytes

GB = 1e9


def _estimate(spec: ModelFacts, setup: Setup = Setup("deepspeed", 2), world_size: int = 1, device: str = "cuda",
              **settings) -> Estimate:
    """estimate() of the run plan for one sweep row; settings: run-config keys with '__' for '.'."""
    cfg = build_config(overrides={k.replace("__", "."): v for k, v in settings.items()})
    return estimate(setup_plan(cfg, setup, world_size, facts=spec, device=device))


# --- formulas ------------------------------------------------------------------------------------

def _paper_spec(num_params: int) -> ModelFacts:
    # One flat tensor: the paper's arithmetic has no per-tensor padding.
    return ModelFacts(num_params=num_params, param_shapes=((num_params,),), hidden_size=4096, num_layers=32,
                      num_heads=32, intermediate_size=16384, vocab_size=50000)


@pytest.mark.parametrize("stage,paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, paper_gb: float) -> None:
    """ZeRO paper, Figure 1: 7.5B params, 64 GPUs, mixed-precision Adam (K=12)."""
    # grad-accum 2 (estimate()'s old default): mid-accumulation, stage 1 holds the full gradients as the paper counts
    e = _estimate(_paper_spec(7_500_000_000), Setup("deepspeed", stage), 64, precision__dtype="bf16",
                  batch__grad_accum=2)
    states = sum(v for k, v in e.by_category().items() if k != "buffers")  # the paper has no comm buckets
    assert states / GB == pytest.approx(paper_gb, rel=0.02)


def test_fp32_adam_is_16_bytes_per_param_at_stage_0() -> None:
    e = _estimate(_paper_spec(1000), Setup("deepspeed", 0), 4, precision__dtype="fp32")
    assert e.model_states == 16 * 1000


def test_stages_fall_and_offload_moves_states_to_host() -> None:
    spec = model_facts("tiny-gpt2")
    ests = {(s.stage, s.offload_optimizer, s.offload_param):  # grad-accum 2: estimate()'s old default
            _estimate(spec, s, 2, zero__reduce_bucket_size=16384, batch__grad_accum=2) for s in setups(["deepspeed"])}
    totals = [ests[(s, "none", "none")].model_states for s in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    assert ests[(3, "cpu", "cpu")].device_bytes < ests[(3, "cpu", "none")].device_bytes \
        < ests[(3, "none", "none")].device_bytes
    assert ests[(2, "cpu", "none")].host_bytes > 0 and ests[(2, "none", "none")].host_bytes == 0


def test_activation_estimate_checkpointing_and_scaling() -> None:
    spec = model_facts("small-gpt2")
    base = _estimate(spec, world_size=2, batch__micro_batch=4, data__seq_len=128).activations
    assert _estimate(spec, world_size=2, batch__micro_batch=8, data__seq_len=128).activations == 2 * base
    ckpt = _estimate(spec, world_size=2, batch__micro_batch=4, data__seq_len=128,
                     model__gradient_checkpointing=True).activations
    assert ckpt < base


def test_grad_accum_1_measures_at_the_boundary() -> None:
    """Mid-accumulation ZeRO-1 keeps the full gradients; at the boundary (grad_accum 1) it holds what ZeRO-2
    holds, and a CPU-offloaded ZeRO-1/2 has no fp32 host accumulator yet."""
    spec = model_facts("tiny-gpt2")

    def states(stage: int, accum: int, offload: str = "none") -> int:
        return _estimate(spec, Setup("deepspeed", stage, offload), 2, batch__grad_accum=accum).model_states

    assert states(1, 1) == states(2, 1) < states(1, 2)
    assert states(1, 1, "cpu") == states(2, 1, "cpu") < states(2, 2, "cpu") < states(1, 2, "cpu")


def test_padding_to_world_size() -> None:
    spec = ModelFacts(num_params=16, param_shapes=((7,), (3, 3)), hidden_size=3, num_layers=1, num_heads=1,
                      intermediate_size=12, vocab_size=3)
    e = _estimate(spec, Setup("deepspeed", 2), 4, zero__reduce_bucket_size=8)
    # ZeRO-1/2: 16 elements padded to a multiple of 2 x 4 = 16 -> 4 per rank.
    assert e.by_category()["master"] == 4 * 4
    e3 = _estimate(spec, Setup("deepspeed", 3), 4, zero__reduce_bucket_size=8)
    # ZeRO-3: ceil(7/4) + ceil(9/4) = 2 + 3 elements per rank.
    assert e3.by_category()["master"] == 4 * 5


def test_user_errors_are_value_errors() -> None:
    spec = model_facts("tiny-gpt2")
    with pytest.raises(ValueError, match="stage 3"):
        _estimate(spec, Setup("deepspeed", 2, offload_param="cpu"), 2)
    with pytest.raises(ValueError, match="backend"):
        _estimate(spec, Setup("megatron", 2), 2)


def test_estimate_cli_json_and_table(capsys) -> None:
    from zerotrain.cli import main

    assert main(["estimate", "--model", "tiny-gpt2", "--nproc", "2", "--nodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["num_params"] == model_facts("tiny-gpt2").num_params
    labels = {(e["backend"], e["stage"], e["offload_optimizer"], e["offload_param"]) for e in out["estimates"]}
    assert ("deepspeed", 3, "cpu", "cpu") in labels and ("fsdp", 3, "none", "none") in labels
    assert main(["estimate", "--model", "tiny-gpt2", "--nproc", "2", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "deepspeed z3 offload opt+param" in text and "Symbols" in text
    assert main(["estimate", "--model", "tiny-gpt2", "--backends", "megatron"]) == 2
    assert "--backends" in capsys.readouterr().err


def test_estimate_from_local_config(tmp_path: Path) -> None:
    from zerotrain.model_info import load_hf_config

    load_hf_config("tiny-gpt2").save_pretrained(tmp_path)
    assert model_facts(str(tmp_path)).num_params == model_facts("tiny-gpt2").num_params
    assert model_facts(str(tmp_path / "config.json")).num_params == model_facts("tiny-gpt2").num_params


# --- measurement in one process --------------------------------------------------------------------

def test_measure_counts_each_storage_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
    engine = type("E", (), {"module": model, "optimizer": opt})()
    m = measure_model_state_bytes(engine)
    n = 50 * 8
    assert m["params"] == 4 * n and m["grads"] == 4 * n
    assert 8 * n <= m["optimizer_states"] <= 8 * n + 16  # + Adam's scalar step tensor
    assert m["total"] == sum(m[c] for c in ("params", "grads", "optimizer_states", "master", "buffers"))
    assert peak_rss_bytes() > 0


# --- 2 real ranks ----------------------------------------------------------------------------------

WORKER = Path(__file__).with_name("memory_worker.py")
BUCKET = 16384
"""Reduce bucket (elements) for the launched runs: at zerotrain's default (>= 1M elements) the bucket
alone is 5x tiny-gpt2 and hides the ZeRO ordering that real models show (a 5e8 bucket is small next
to billions of parameters). The bucket is still predicted: see test_default_bucket_is_predicted."""

CASES = {
    "ds-z0": ["--stage", "0"],
    "ds-z1": ["--stage", "1"],
    "ds-z2": ["--stage", "2"],
    "ds-z3": ["--stage", "3"],
    "ds-z3-bf16": ["--stage", "3", "--precision", "bf16"],
    "ds-z2-offload": ["--stage", "2", "--offload-optimizer", "cpu"],
    "fsdp-z3": ["--backend", "fsdp", "--stage", "3"],
    # grad-accum 1 (train's default): the snapshot is at the boundary, the gradients just reduced
    "ds-z1-accum1": ["--stage", "1", "--grad-accum", "1"],
    "ds-z2-offload-accum1": ["--stage", "2", "--offload-optimizer", "cpu", "--grad-accum", "1"],
    "fsdp-z3-accum1": ["--backend", "fsdp", "--stage", "3", "--grad-accum", "1"],
}
_cache: dict[str, list[dict]] = {}


def _launch(name: str, tmp_root: Path, extra: list[str] | None = None) -> list[dict]:
    if name not in _cache:
        out = tmp_root / name
        args = CASES.get(name, []) + (extra if extra is not None else ["--reduce-bucket-size", str(BUCKET)])
        torchrun([str(WORKER), "--out", str(out), "--micro-batch", "2", "--seq-len", "64", *args], timeout=420)
        accum = int(args[args.index("--grad-accum") + 1]) if "--grad-accum" in args else 2  # the worker's default
        _cache[name] = [dict(json.loads((out / f"rank{r}.json").read_text()), grad_accum=accum) for r in range(2)]
    return _cache[name]


def _predict(rec: dict, bucket: int | None = BUCKET):
    s = Setup(rec["backend"], rec["stage"], rec["offload_optimizer"], rec["offload_param"])
    return _estimate(model_facts("tiny-gpt2"), s, rec["world_size"], "cpu", precision__dtype=rec["precision"],
                     batch__micro_batch=2, data__seq_len=64, zero__reduce_bucket_size=bucket,
                     batch__grad_accum=rec["grad_accum"])


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memory")


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_measured_matches_prediction(name: str, tmp_root: Path) -> None:
    for rec in _launch(name, tmp_root):
        est = _predict(rec)
        measured, predicted = rec["measured"]["total"], est.model_states
        assert abs(measured - predicted) <= 0.05 * predicted, (name, rec["rank"], rec["measured"], est.by_category())
        assert abs(rec["peak_rss_bytes"] - est.peak_rss) <= 0.20 * rec["peak_rss_bytes"], \
            (name, rec["rank"], rec["peak_rss_bytes"], est.peak_rss)


@pytest.mark.multirank
def test_measured_model_states_fall_with_stage(tmp_root: Path) -> None:
    per_stage = [max(r["measured"]["total"] for r in _launch(f"ds-z{s}", tmp_root)) for s in range(4)]
    assert per_stage[0] > per_stage[1] > per_stage[2] > per_stage[3], per_stage


@pytest.mark.multirank
def test_default_bucket_is_predicted(tmp_root: Path) -> None:
    """zerotrain's default bucket for tiny-gpt2 (1M elements) is in the prediction too."""
    CASES["ds-z1-default-bucket"] = ["--stage", "1"]
    for rec in _launch("ds-z1-default-bucket", tmp_root, extra=[]):
        est = _predict(rec, bucket=None)
        assert abs(rec["measured"]["total"] - est.model_states) <= 0.05 * est.model_states
