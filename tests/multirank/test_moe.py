"""Mixture-of-experts models on real CPU ranks (the family matrix, tests/multirank/test_families.py, trains Mixtral
and Qwen3-MoE at every engine configuration against one process; this file holds what only MoE models have):
- routing that leaves experts without a token on a rank must finish, not hang, at ZeRO-3 (DeepSpeed, with its
  defaults) and FSDP2 stage 3, and still equal one process: 16 experts, top-1, a micro-batch of 8 tokens, so at
  least 8 experts receive nothing on every rank in every micro-batch (checked on the reference's own router).
"""
from __future__ import annotations

import json

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

FP32_RTOL = 1e-5
SEQ, MICRO = 8, 1
"""Fewer tokens per micro-batch than experts (16): some expert gets none on every rank (pigeonhole)."""


@pytest.fixture(scope="module")
def sparse_moe(tmp_path_factory):
    return families.make_model_dir("qwen3-moe-top1", tmp_path_factory.mktemp("moe") / "qwen3-moe-top1")


def _idle_experts(model_dir, batches) -> list[int]:
    """Experts that get no token in each micro-batch of the reference, by the model's own router (block 0)."""
    model = families.builder(model_dir, "causal-lm")().eval()
    seen: list[int] = []
    block = model.model.layers[0].mlp
    hook = block.gate.register_forward_hook(lambda m, i, o: seen.append(
        int(model.config.num_experts - torch.unique(o[-1] if isinstance(o, tuple) else o.topk(1).indices).numel())))
    with torch.no_grad():
        for x in batches:
            model(input_ids=x)
    hook.remove()
    return seen


@pytest.mark.parametrize("backend", cells(["deepspeed", "fsdp"], set()))
def test_experts_without_tokens_finish_at_stage3_and_equal_one_process(sparse_moe, tmp_path, backend):
    data = ref.global_batches(ref.STEPS, ref.WORLD * ref.ACCUM * MICRO, SEQ)
    micro_batches = [x[r:r + MICRO] for x in data for r in range(0, x.shape[0], MICRO)]
    idle = _idle_experts(sparse_moe, micro_batches)
    assert idle and min(idle) >= 16 - SEQ * MICRO, idle  # the condition the test is about really occurs
    out = tmp_path / "run.json"
    torchrun(ref.engine_worker_args(sparse_moe, out, "--backend", backend, "--stage", "3", "--micro", MICRO,
                                    "--seq", SEQ, "--timeout", 60), timeout=300)  # a hang fails in 60 s, not never
    reference = ref.reference_run(sparse_moe, steps=ref.STEPS, world=ref.WORLD, grad_accum=ref.ACCUM, micro=MICRO,
                                  lr=ref.LR, weight_decay=ref.WD, clip=ref.CLIP, warmup=ref.WARMUP, seq_len=SEQ)
    ref.assert_parity(json.loads(out.read_text()), reference, FP32_RTOL, FP32_RTOL, f"qwen3-moe top-1 {backend} z3",
                      clip=ref.CLIP)
