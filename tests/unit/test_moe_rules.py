"""The mixture-of-experts settings before launch: what --ep, --router-aux-coef and --freeze-router need of the model,
the backend and the layout, each refusal one line naming the setting and the fix, the router loss left out by
name where a layout cuts the forward; and what the prepared model trains with (router.configure)."""
from __future__ import annotations

import pytest

import tests.support.families as families
from zerotrain.config.load import build_config
from zerotrain.errors import ConfigError
from zerotrain.model.facts import facts_of, meta_model
from zerotrain.plan.run_plan import build_plan


def _facts(family: str):
    cfg = families.FAMILIES[family].config()
    return facts_of(meta_model(cfg), cfg)


def _plan(family: str, world: int = 2, backend: str = "fsdp", **overrides):
    return build_plan(build_config(None, overrides), world, backend=backend, device="cpu", facts=_facts(family))


@pytest.mark.parametrize("family,overrides,backend,message", [
    ("llama", {"parallel.ep": 2}, "fsdp", "--ep 2: model type 'llama' is dense"),
    ("mixtral", {"parallel.ep": 8}, "fsdp", "--ep 8 does not divide the model's 4 experts per block"),
    ("qwen3-moe", {"parallel.ep": 4}, "fsdp", "--ep 4 does not divide the 2 data-parallel ranks"),
    ("mixtral", {"parallel.ep": 2, "parallel.tp": 2}, "fsdp", "ep and tp together are not supported yet"),
    ("deepseek-v3", {"parallel.ep": 2}, "deepspeed", "--ep 2 on the deepspeed backend: DeepSpeed AutoEP runs model "
                                                     "types ['mixtral', 'qwen3_moe'] here, not 'deepseek_v3'"),
    ("mixtral", {"parallel.ep": 2, "zero.stage": 3}, "deepspeed", "--ep 2 with --stage 3 on the deepspeed backend: "
                                                                  "AutoEP under ZeRO-3"),
    ("mixtral", {"parallel.ep": 2, "zero.stage": 2, "model.freeze_router": True}, "deepspeed",
     "--ep 2 on the deepspeed backend with model.freeze_router: not supported yet (AutoEP "),
    ("mixtral", {"parallel.ep": 2, "zero.stage": 2, "zero.reduce_scatter": False}, "deepspeed",
     "--ep 2 on the deepspeed backend with zero.reduce_scatter: false"),
    ("mixtral", {"parallel.ep": 2, "parallel.sp": 2}, "deepspeed", "ep and sp together are not supported yet"),
    ("mixtral", {"parallel.ep": 2, "zero.stage": 2, "lora.r": 4, "lora.targets": "q_proj,v_proj"}, "deepspeed",
     "lora.r=4 with --ep 2 on the deepspeed backend: not supported yet (AutoEP swaps the MoE blocks"),
    ("mixtral", {"parallel.ep": 2, "zero.stage": 0}, "fsdp", "--ep 2 with --stage 0 on the fsdp backend"),
    ("deepseek-v3", {"model.router_aux_coef": 0.01}, "fsdp", "model type 'deepseek_v3' defines no router"),
    ("llama", {"model.freeze_router": True}, "fsdp", "model.freeze_router: model type 'llama' is dense"),
    ("llama", {"model.router_aux_coef": 0.01}, "fsdp", "model.router_aux_coef: model type 'llama' is dense"),
    ("mixtral", {"model.router_aux_coef": 0.01, "parallel.sp": 2}, "fsdp", "model.router_aux_coef=0.01 with --sp 2"),
    ("mixtral", {"model.router_aux_coef": 0.01, "model.chunked_loss": 16}, "fsdp", "with --chunked-loss 16"),
])
def test_refused_in_one_line(family, overrides, backend, message):
    world = 4 if overrides.get("parallel.sp") or overrides.get("parallel.tp") else 2
    with pytest.raises(ConfigError) as e:
        _plan(family, world, backend, **overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("family,preset", [("mixtral", "mixtral"), ("qwen3-moe", "qwen3_moe")])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ep_on_deepspeed_renders_autoep(family, preset, stage):
    """--ep on DeepSpeed is AutoEP: the DeepSpeed config's expert_parallel section (the family's preset, whose
    recorder retargeting keeps the router loss) and, at stages 1-2, reduce-scatter (DeepSpeed asserts it for MoE
    parameter groups; on CPU it is off otherwise)."""
    from zerotrain.plan.ds_config import render

    ds = render(_plan(family, 2, "deepspeed", **{"parallel.ep": 2, "zero.stage": stage}))
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": preset,
                                     "use_grouped_mm": False}
    assert ds["zero_optimization"].get("reduce_scatter", stage == 0) is True
    assert "expert_parallel" not in render(_plan(family, 2, "deepspeed", **{"zero.stage": stage}))
    gpu = build_plan(build_config(None, {"parallel.ep": 2, "zero.stage": stage}), 2, backend="deepspeed",
                     device="cuda", facts=_facts(family))
    assert render(gpu)["expert_parallel"]["use_grouped_mm"] is True  # DeepSpeed's default where it runs


def test_config_command_refuses_ep_without_a_model(capsys):
    """`zerotrain config --ep 2` cannot name AutoEP's preset without the model: one line, not a JSON silently
    without expert parallelism."""
    from zerotrain.cli import main

    assert main(["config", "--ep", "2", "--stage", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["zerotrain config: error: --ep 2: DeepSpeed's expert_parallel section needs the model's type; "
                   "pass --model or --model-config"]


def test_autoep_experts_back_in_hf_layout():
    """AutoEP's fused w1 (gate), w3 (up), w2 (down) and its router Linear -> the HF names and layout final/ and
    export write (gate_up_proj = gate rows then up rows), the router's `gate` alias dropped."""
    import torch

    from zerotrain.backends.deepspeed.expert_parallel import hf_state_dict

    w1, w3, w2, g = torch.randn(4, 6, 3), torch.randn(4, 6, 3), torch.randn(4, 3, 6), torch.randn(4, 3)
    b = "model.layers.0.mlp"
    out = hf_state_dict({f"{b}.experts.w1": w1, f"{b}.experts.w2": w2, f"{b}.experts.w3": w3,
                         f"{b}.router.gate.weight": g, f"{b}.gate.gate.weight": g, "lm_head.weight": g})
    assert set(out) == {f"{b}.experts.gate_up_proj", f"{b}.experts.down_proj", f"{b}.gate.weight", "lm_head.weight"}
    assert torch.equal(out[f"{b}.experts.gate_up_proj"], torch.cat([w1, w3], 1))
    assert out[f"{b}.experts.down_proj"] is w2 and out[f"{b}.gate.weight"] is g


def test_recorder_registry_answers_deepspeed_inside_the_block_only():
    """transformers 5's recorder registry takes a model in get(); DeepSpeed 0.19.8's AutoEP calls get(key, default)
    and sets string keys: inside registry_as_dict both work, outside the registry is its own class again."""
    from transformers.models.mixtral.modeling_mixtral import MixtralModel
    from transformers.utils import output_capturing

    from zerotrain.backends.deepspeed.expert_parallel import registry_as_dict

    registry, own = output_capturing._CAN_RECORD_REGISTRY, type(output_capturing._CAN_RECORD_REGISTRY)
    model = meta_model(families.FAMILIES["mixtral"].config())
    with registry_as_dict():
        assert registry.get("no such key", "default") == "default"
        registry["zerotrain test key"] = {"x": 1}
        assert dict.get(registry, "zerotrain test key") == {"x": 1}
        assert registry.get(model.model) == registry.get(model.model)  # the model-keyed call as before
        dict.pop(registry, "zerotrain test key")
    assert type(registry) is own and isinstance(model.model, MixtralModel)
    with pytest.raises(TypeError):
        registry.get("no such key", "default")  # the bug it works around is still transformers' own


def test_ep_refuses_adapters_on_the_experts():
    """peft's all-linear wraps Mixtral's fused 3-D expert weights (one adapter spanning every expert): under --ep the
    experts are split, so that is refused before launch; adapters on attention run (tests/multirank/test_lora.py)."""
    from zerotrain.model.preparation import ModelPreparation

    def facts(targets: str):
        cfg = build_config(None, {"lora.r": 4, "lora.targets": targets})
        hf = families.FAMILIES["mixtral"].config()
        return facts_of(ModelPreparation.from_config(cfg).for_sizing(meta_model(hf)), hf)

    assert facts("all-linear").adapted_experts and not facts("q_proj,v_proj").adapted_experts
    cfg = build_config(None, {"lora.r": 4, "parallel.ep": 2})
    with pytest.raises(ConfigError, match="^--ep 2 with LoRA adapters on the experts' fused weights"):
        build_plan(cfg, 2, backend="fsdp", device="cpu", facts=facts("all-linear"))
    build_plan(build_config(None, {"lora.r": 4, "lora.targets": "q_proj,v_proj", "parallel.ep": 2}), 2,
               backend="fsdp", device="cpu", facts=facts("q_proj,v_proj"))


def test_ep_groups_across_hosts_are_warned(monkeypatch):
    from zerotrain.backends.fsdp.expert_parallel import host_warning
    from zerotrain.distributed.process_group import env

    assert host_warning(8, 8) is None and host_warning(4, 8) is None and host_warning(2, 0) is None
    assert host_warning(8, 4).startswith("--ep 8 with 4 ranks per host: expert-parallel groups span hosts")
    for name, value in (("LOCAL_WORLD_SIZE", "4"), ("LOCAL_SIZE", "4")):  # torchrun's, the deepspeed launcher's
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        monkeypatch.setenv(name, value)
        assert env().local_world_size == 4


def test_ep_layout_and_the_default_backend():
    from zerotrain.plan.resolve import select_backend

    plan = _plan("qwen3-moe", 4, **{"parallel.ep": 2})
    assert (plan.world.dp, plan.world.ep, plan.world.expert_dp) == (4, 2, 2)
    assert "expert-parallel 2" in plan.describe() and plan.batch.global_batch == 4 * plan.batch.micro_batch * \
        plan.batch.grad_accum  # every rank reads its own batch
    backend, why = select_backend(build_config(None, {"parallel.ep": 2}))
    assert backend == "fsdp" and "expert parallelism runs on FSDP2" in why


def test_the_default_router_loss_is_left_out_by_name_where_a_layout_cuts_the_forward():
    plan = _plan("mixtral", 4, **{"parallel.sp": 2})
    assert any("router load-balancing loss (router_aux_loss_coef 0.001) is left out with --sp 2" in w
               for w in plan.warnings), plan.warnings
    assert plan.preparation.router_aux_coef == 0.0
    assert not any("router" in w for w in _plan("mixtral").warnings)
    assert _plan("mixtral").preparation.router_aux_coef is None  # the model's own


@pytest.mark.parametrize("family,coef,freeze,trains", [("mixtral", None, False, 0.001), ("qwen3-moe", 0.02, True, 0.02),
                                                       ("mixtral", 0.0, False, None), ("deepseek-v3", None, True, None),
                                                       ("gpt-oss", 0.5, True, 0.5), ("phimoe", None, True, 0.001),
                                                       ("gpt-oss", 0.0, False, None)])
def test_the_prepared_model_trains_with_its_router_settings(tmp_path, family, coef, freeze, trains):
    import torch

    from zerotrain.model import router

    torch.manual_seed(0)
    model = families.builder(families.make_model_dir(family, tmp_path / family), "causal-lm")()
    saved = model.config.to_dict()
    assert router.configure(model, coef, freeze) == trains and router.trained_coef(model) == trains
    assert model.config.to_dict() == saved  # final/ saves the config as it came
    assert router.forward_kwargs(model) == ({"output_router_logits": trains is not None} if family != "deepseek-v3"
                                            else {})
    gates = [b.router for b in router.moe_blocks(model)]
    assert gates and all(p.requires_grad != freeze for g in gates for p in g.parameters())
    assert len(list(gates[0].parameters())) == (2 if family == "gpt-oss" else 1)  # gpt-oss's router bias too
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    load = router.ExpertLoad.attach(model)
    with load.counting():
        out = model(input_ids=x, labels=x, **router.forward_kwargs(model))
    out.loss.backward()  # a checkpointed recompute would run the gates again: not counted outside counting()
    counts = load.take()
    top_k = model.config.num_experts_per_tok
    assert counts.shape == (len(gates), router.num_experts_of(model.config))
    assert counts.sum(dim=1).tolist() == [2 * 16 * top_k] * len(gates)  # every token's top-k, once
    if trains is None:
        assert out.get("aux_loss") is None
    else:  # the LM loss + coef x the model's own load-balancing loss
        lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, lm + trains * out.aux_loss)
    figures = router.load_figures(counts)
    assert sum(figures["expert_tokens"]) == counts.sum() and figures["expert_imbalance"] >= 1.0


def test_ep_with_sp_runs_on_fsdp():
    """ep x sp is a row of the capability table on FSDP2: ep groups are data-parallel ranks of one sp coordinate, an
    expert's copies its expert_dp ranks x their sp peers (the expert mesh's grid), the dense parameters sharded over
    dp x sp; the sp rules still apply (a head count sp does not divide is refused)."""
    from dataclasses import replace

    from zerotrain.distributed.layout import WorldLayout

    plan = _plan("qwen3-moe", 4, **{"parallel.ep": 2, "parallel.sp": 2})
    assert (plan.world.dp, plan.world.sp, plan.world.ep, plan.world.expert_dp) == (2, 2, 2, 1)
    assert "4 ranks = data-parallel 2 x sequence-parallel 2 x expert-parallel 2" in plan.describe()
    assert WorldLayout(4, sp=2, ep=2).expert_grid() == [[0, 2], [1, 3]]  # rows: ep groups; columns: the copies
    assert WorldLayout(8, sp=2, ep=2).expert_grid() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert WorldLayout(4, ep=2).expert_grid() == [[0, 1], [2, 3]]  # without sp: init_device_mesh's (expert_dp, ep)
    with pytest.raises(ConfigError, match="--sp 2 does not divide the model's 3 attention heads"):
        build_plan(build_config(None, {"parallel.ep": 2, "parallel.sp": 2}), 4, backend="fsdp", device="cpu",
                   facts=replace(_facts("qwen3-moe"), num_heads=3, num_kv_heads=3))
