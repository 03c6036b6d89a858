"""What zerotrain knows about a mixture-of-experts model before launch (ModelFacts, `zerotrain estimate`): experts per
block, top-k, the experts' parameters and the parameters active per token, the router loss's weight and the
expert-parallel plan, for Mixtral, Qwen3-MoE and DeepSeek-V3; a dense model has none."""
from __future__ import annotations

import pytest

import tests.support.families as families
from zerotrain.model.facts import facts_of, meta_model


@pytest.mark.parametrize("family,experts,top_k,aux", [("mixtral", 4, 2, 0.001), ("qwen3-moe", 8, 2, 0.001),
                                                      ("qwen3-moe-top1", 16, 1, 0.001), ("deepseek-v3", 8, 2, None),
                                                      ("llama", 0, 0, None)])
def test_expert_facts(family, experts, top_k, aux):
    cfg = {**families.FAMILIES, **families.SPARSE_MOE}[family].config()
    model = meta_model(cfg)
    f = facts_of(model, cfg)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert (f.num_experts, f.experts_per_token, f.expert_params) == (experts, top_k, expert)
    assert f.active_params == (f.num_params if not experts else f.num_params - expert + expert * top_k // experts)
    assert (expert > 0) == bool(experts)
    # the router loss where transformers defines one (not DeepSeek-V3), and the plan --ep dispatches with
    assert f.router_aux_coef == aux and f.expert_parallel_plan == bool(experts)


def test_estimate_prints_active_parameters(tmp_path, capsys):
    from zerotrain.cli import main

    families.FAMILIES["mixtral"].config().save_pretrained(tmp_path)
    assert main(["estimate", "--model", str(tmp_path / "config.json"), "--nproc", "2", "--seq-len", "32",
                 "--backends", "fsdp"]) == 0
    assert ("mixture of experts: 4 experts per block, top-2: 254,784 of the 353,088 parameters active per token"
            in capsys.readouterr().out)
