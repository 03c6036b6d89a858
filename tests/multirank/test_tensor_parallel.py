"""Tensor parallelism (FSDP backend, DTensor with the model's HF tp_plan) on real CPU ranks, against one
plain process with the same global batch: tp=2 on 2 ranks (Llama: save_hf, eval logits, checkpoint, resume,
export) and tp=2 x dp=2 on 4 ranks (Qwen2), plus the one-line refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import ranks

FP32_RTOL = export_check.FP32_RTOL
CLIP = 0.5  # as tests/multirank/test_families.py: the family models' norms must exceed it for clipping to be tested
GLOBAL_MICRO_BATCHES = 4  # micro-batches per step over the replicas: the same global batch at dp 1 and 2


def tp_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int) -> dict:
    micro = ref.MICRO * GLOBAL_MICRO_BATCHES // (ref.ACCUM * dp)
    ranks(ref.engine_worker_args(model_dir, out, "--backend", "fsdp", "--stage", "3", "--tp", "2", "--clip", CLIP,
                                 "--micro", micro, *args), nproc=nproc, timeout=400)
    return json.loads(out.read_text())


def reference_for(model_dir: Path, dp: int) -> dict:
    micro = ref.MICRO * GLOBAL_MICRO_BATCHES // (ref.ACCUM * dp)
    return ref.reference_run(model_dir, steps=ref.STEPS, world=dp, grad_accum=ref.ACCUM, micro=micro, lr=ref.LR,
                             weight_decay=ref.WD, clip=CLIP, warmup=ref.WARMUP)


def assert_split(result: dict, tp: int, dp: int) -> None:
    """Every split linear layer holds 1/tp of its weight on this rank, and FSDP2 shards that over the
    dp replicas (not only equal losses: every tensor-parallel rank reads the same batch, so an unsplit
    model would match too)."""
    shares = result["param_local"]
    assert shares, "no parameter was split over the tensor-parallel mesh"
    assert any(".self_attn.q_proj." in n for n in shares) and any(".mlp.down_proj." in n for n in shares), sorted(shares)
    for name, (local, full) in shares.items():
        assert local * tp * dp == full, (name, local, full)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return families.make_model_dir("llama", tmp_path_factory.mktemp("tp") / "llama")


@pytest.mark.slow  # CI time (issue 52): FSDP2 tp in CI: test_lora_tensor_parallel.py, test_composed_layouts.py
@pytest.mark.multirank
def test_tp2_parity_split_export_and_resume(llama, tmp_path):
    import torch
    import transformers

    straight, reference = export_check.checkpointed_run(tp_worker, llama, tmp_path, "tp2.json", "fsdp tp=2",
                                                        "--probe-out", tmp_path / "probe.pt")
    assert_split(straight, tp=2, dp=1)
    # final/ is one ordinary HF model: the split layers gathered, equal to the 1-process weights
    hf = export_check.final_weights(tmp_path, reference)
    # the engine's eval_step (tensor-parallel forward) gives final/'s logits, and the 1-process model's
    probe = torch.load(tmp_path / "probe.pt")
    assert probe.shape == (*ref.probe_input().shape, families.VOCAB), probe.shape
    plain = ref.load_model(llama).eval()
    plain.load_state_dict(reference["state_dict"])
    with torch.no_grad():
        final = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        torch.testing.assert_close(probe, final(ref.probe_input()).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(probe, plain(ref.probe_input()).logits, rtol=1e-4, atol=1e-4)
    meta = export_check.step3_meta(tmp_path)
    assert meta["extra"] == {"tp": 2, "optimizer": "adamw"} and meta["zero_stage"] == 3
    # a resume from step 3 repeats the straight run; `zerotrain export` of the last checkpoint (DCP shards keyed
    # by HF names, tensor-parallel slices gathered in one process) equals final/ and the 1-process weights
    exported = export_check.assert_resume_and_export(tp_worker, llama, tmp_path, straight, hf)
    ref.assert_same_weights(exported, reference["state_dict"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # CI time (issue 52): CI's 4-rank FSDP2 cell is tp2 x pp2 (test_composed_layouts.py)
@pytest.mark.multirank
def test_tp2_dp2_on_four_ranks(tmp_path):
    qwen2 = families.make_model_dir("qwen2", tmp_path / "qwen2")
    result = tp_worker(qwen2, tmp_path / "tp2dp2.json", nproc=4, dp=2)
    ref.assert_parity(result, reference_for(qwen2, dp=2), FP32_RTOL, FP32_RTOL, "fsdp tp=2 x dp=2", clip=CLIP)
    assert_split(result, tp=2, dp=2)


@pytest.mark.parametrize("overrides,needle", [
    ({"backend": "deepspeed", "zero.stage": 3}, "AutoTP training supports ZeRO 0-2; pass --stage 1 or --stage 2 or --backend fsdp"),
    ({"backend": "deepspeed", "model.from_config": "tiny-gpt2"}, "AutoTP cannot split model type 'gpt2'"),
    ({"backend": "fsdp", "zero.stage": 0}, "--stage 2 or --stage 3"),
    ({"backend": "fsdp", "zero.stage": 3, "model.from_config": "tiny-gpt2"}, "model type 'gpt2' has no tensor-parallel plan"),
])
def test_refusals_are_one_line(overrides, needle):
    from zerotrain.config.load import build_config
    from zerotrain.model.facts import model_facts
    from zerotrain.plan.run_plan import build_plan

    cfg = build_config(overrides={"parallel.tp": 2, **overrides})
    facts = model_facts(cfg.model.from_config or "tiny-llama")
    with pytest.raises(ValueError) as e:
        build_plan(cfg, 2, backend=cfg.backend, device="cpu", facts=facts)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_layout_divisibility_and_dp_rank():
    from zerotrain.config.load import build_config
    from zerotrain.model.facts import model_facts
    from zerotrain.distributed.layout import WorldLayout
    from zerotrain.plan.run_plan import build_plan

    cfg = build_config(overrides={"parallel.tp": 2, "backend": "fsdp", "zero.stage": 3})
    with pytest.raises(ValueError, match="does not divide the world of 3 ranks"):
        build_plan(cfg, 3, backend="fsdp", device="cpu", facts=model_facts("tiny-llama"))
    bad = build_config(overrides={"parallel.tp": 8, "backend": "fsdp", "zero.stage": 3})
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        build_plan(bad, 8, backend="fsdp", device="cpu", facts=model_facts("tiny-llama"))
    layout = WorldLayout(8, tp=2)
    assert layout.dp == 4 and [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.counts_for_data(r) for r in range(4)] == [True, False, True, False]
    plan = build_plan(cfg, 4, backend="fsdp", device="cpu", facts=model_facts("tiny-llama"))
    assert plan.batch.global_batch == cfg.batch.micro_batch * 2  # dp = 2 replicas, not 4 ranks

