"""What zerotrain knows about a mixture-of-experts model before launch (ModelFacts, `zerotrain estimate`): experts per
block, top-k, the experts' parameters and the parameters active per token, the router loss's weight and the
expert-parallel plan, for Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss and Phi-MoE; a dense model has none. The MoE blocks,
routers and experts of every family are found from the model's declarations (router.moe_blocks), and a model that
declares a mixture of experts whose blocks cannot be found is refused, not trained as dense."""
from __future__ import annotations

import pytest

import tests.support.families as families
from zerotrain.errors import UserError
from zerotrain.model import router
from zerotrain.model.facts import facts_of, meta_model


@pytest.mark.parametrize("family,experts,top_k,aux", [("mixtral", 4, 2, 0.001), ("qwen3-moe", 8, 2, 0.001),
                                                      ("qwen3-moe-top1", 16, 1, 0.001), ("deepseek-v3", 8, 2, None),
                                                      ("gpt-oss", 4, 2, 0.001), ("phimoe", 4, 2, 0.001),
                                                      ("llama", 0, 0, None)])
def test_expert_facts(family, experts, top_k, aux):
    cfg = {**families.FAMILIES, **families.SPARSE_MOE, **families.ROUTER_MOE}[family].config()
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


_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def _config(model_type: str):
    """A tiny config of each MoE family transformers ships that this project trains (FAMILIES / ROUTER_MOE, and
    GLM-4-MoE and Qwen3-Next, built here only)."""
    import transformers

    by_family = {**families.FAMILIES, **families.ROUTER_MOE}
    if model_type in by_family:
        return by_family[model_type].config()
    if model_type == "glm4-moe":
        return transformers.Glm4MoeConfig(**_SMALL, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                          num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                                          first_k_dense_replace=1, head_dim=16)
    return transformers.Qwen3NextConfig(**_SMALL, intermediate_size=128, head_dim=16, moe_intermediate_size=32,
                                        num_experts=8, num_experts_per_tok=2, linear_num_value_heads=2,
                                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                        layer_types=["linear_attention", "full_attention"])


@pytest.mark.parametrize("family,router_cls,experts_cls,blocks", [
    ("mixtral", "MixtralTopKRouter", "MixtralExperts", 2), ("qwen3-moe", "Qwen3MoeTopKRouter", "Qwen3MoeExperts", 2),
    ("deepseek-v3", "DeepseekV3TopkRouter", "DeepseekV3Experts", 1), ("glm4-moe", "Glm4MoeTopkRouter", "Glm4MoeExperts", 1),
    ("qwen3-next", "Qwen3NextTopKRouter", "Qwen3NextExperts", 2), ("gpt-oss", "GptOssTopKRouter", "GptOssExperts", 2),
    ("phimoe", "PhimoeTopKRouter", "PhimoeExperts", 2)])
def test_moe_blocks_are_found_from_the_declarations(family, router_cls, experts_cls, blocks):
    """Each router is a module of the class the model records router_logits from, each block the module holding it
    and the experts module the expert-parallel plan dispatches to (DeepSeek-V3 / GLM-4-MoE: block 0 is dense);
    the router is `gate` in some families and `router` in others, which no longer matters."""
    cfg = _config(family)
    model = meta_model(cfg)
    found = router.moe_blocks(model)
    assert len(found) == blocks and {type(b.router).__name__ for b in found} == {router_cls}
    assert {type(b.experts).__name__ for b in found} == {experts_cls}
    assert all(b.module is dict(model.named_modules())[b.name] and b.name.endswith(".mlp") for b in found)
    assert all(any(m is b.router for m in b.module.children()) and any(m is b.experts for m in b.module.children())
               for b in found)
    f = facts_of(model, cfg)
    assert f.moe_blocks == blocks and f.expert_params == sum(p.numel() for b in found for p in b.experts.parameters())
    if family == "gpt-oss":  # the experts' biases are expert tensors too (split by --ep along the experts)
        assert len(f.expert_shapes) == 4 * blocks and all(s[0] == 4 for s in f.expert_shapes)


def test_the_mixture_of_experts_features_see_gpt_oss_and_phimoe():
    """The fused loss is off (the forward adds the router loss) and --tiled-mlp refused, as for Mixtral."""
    from zerotrain.model.memory_reducers import check, fused_loss_problem

    for family in ("gpt-oss", "phimoe", "mixtral"):
        model = meta_model(_config(family))
        assert "is a mixture of experts" in fused_loss_problem(model)
        with pytest.raises(UserError, match="MLPs are mixture-of-experts blocks"):
            check(model, 16, 0)
    check(meta_model(_config("llama")), 16, 0)


def _gpt_oss_without(what: str):
    """A tiny gpt-oss subclass that still declares its router outputs and expert plan but lost what they name:
    its routers replaced by another class ("router"), or its experts moved off the plan's path ("experts")."""
    from torch import nn
    from transformers import GptOssForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    class OtherRouter(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.weight, self.bias = inner.weight, inner.bias

    class Modified(GptOssForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                if what == "router":
                    layer.mlp.router = OtherRouter(layer.mlp.router)
                else:
                    layer.mlp.ffn = layer.mlp.experts
                    del layer.mlp.experts

    assert Modified._can_record_outputs["router_logits"].target_class is GptOssTopKRouter
    return Modified


@pytest.mark.parametrize("what,missing", [
    ("router", "the router class its _can_record_outputs['router_logits'] declares"),
    ("experts", "the expert modules its expert-parallel plan (ep_plan) names")])
def test_a_declared_mixture_of_experts_not_found_is_refused(what, missing):
    import torch

    cfg = families.ROUTER_MOE["gpt-oss"].config()
    with torch.device("meta"):
        model = _gpt_oss_without(what)(cfg)
    message = f"Modified declares a mixture of experts, but zerotrain found no module for {missing}"
    for find in (router.moe_blocks, lambda m: facts_of(m, cfg), router.ExpertLoad.attach):
        with pytest.raises(UserError) as e:
            find(model)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_moe_class_configured_dense_trains_as_dense_and_a_plan_less_one_counts_its_experts():
    """A Qwen3-MoE whose every block is dense (mlp_only_layers) builds none of its declared MoE modules: it is a dense
    model, not refused. A family that declares router_logits but no expert-parallel plan (JetMoE) still counts its
    routed experts: every parameter of the block but the router's."""
    import transformers

    dense = transformers.Qwen3MoeConfig(**_SMALL, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, mlp_only_layers=[0, 1], head_dim=16)
    model = meta_model(dense)
    assert router.moe_blocks(model) == [] and facts_of(model, dense).moe_blocks == 0
    half = transformers.Qwen3MoeConfig(**{**dense.to_dict(), "mlp_only_layers": [0]})
    assert [b.name for b in router.moe_blocks(meta_model(half))] == ["model.layers.1.mlp"]

    jetmoe = transformers.JetMoeConfig(hidden_size=64, num_hidden_layers=2, num_key_value_heads=4, kv_channels=16,
                                       intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=256)
    model = meta_model(jetmoe)
    found = router.moe_blocks(model)  # its MLPs and its mixture-of-attention-heads, two per layer
    assert len(found) == 4 and all(b.experts is None for b in found)
    routed = sum(p.numel() for b in found for p in b.module.parameters()) - sum(
        p.numel() for b in found for p in b.router.parameters())
    assert facts_of(model, jetmoe).expert_params == routed > 0
