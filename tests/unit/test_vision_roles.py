"""Image-text roles (zerotrain/model/vision_roles.py): --freeze and --lora-scope on the three tiny families of
tests/support/vision.py, built from their configs on the meta device (no weights, no processor needed), counted
against the modules transformers builds (model.vision_tower / model.visual ...) read directly, not through the
role map; the refusals; the estimate's image-text rows."""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.vision import VL_FAMILIES, _ids
from zerotrain.config.load import build_config
from zerotrain.errors import ConfigError, UserError
from zerotrain.model.facts import facts_of
from zerotrain.model.preparation import ModelPreparation
from zerotrain.model.vision_roles import role_map

FAMILIES = tuple(VL_FAMILIES)


def _model(family: str, device: str = "meta"):
    from transformers import AutoModelForImageTextToText

    spec = VL_FAMILIES[family]
    with torch.device(device):
        return AutoModelForImageTextToText.from_config(spec.config(_ids(spec.image_tokens)))


def _text_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=64))


def _numel(params) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def _direct_parts(family: str, model) -> dict[str, int]:
    """Each part's parameter elements from the modules transformers builds, read by their attribute names."""
    base = model.model
    if family == "qwen2-vl":
        merger = _numel(base.visual.merger.parameters())
        return {"vision": _numel(base.visual.parameters()) - merger, "projector": merger}
    return {"vision": _numel(base.vision_tower.parameters()), "projector": _numel(base.multi_modal_projector.parameters())}


def _prep(model, **flags):
    overrides = {"model.name": "tiny-vl", **flags}
    return ModelPreparation.from_config(build_config(None, overrides))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_maps_its_own_modules_and_every_parameter_once(family):
    model = _model(family)
    roles = role_map(model)
    expected = {"llava": ("model.vision_tower", "model.multi_modal_projector"),
                "qwen2-vl": ("model.visual", "model.visual.merger"),
                "gemma3": ("model.vision_tower", "model.multi_modal_projector")}[family]
    assert roles.names("vision") == (expected[0],) and roles.names("projector") == (expected[1],)
    assert roles.names("language")[0] == "model.language_model"
    counts = roles.counts(model)
    direct = _direct_parts(family, model)
    assert counts["vision"] == direct["vision"] > 0 and counts["projector"] == direct["projector"] > 0
    total = _numel(model.parameters())
    assert sum(counts.values()) == total  # no parameter outside a role, none in two
    assert counts["language"] == total - direct["vision"] - direct["projector"]
    assert all(roles.role_of(n) is not None for n, _ in model.named_parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_freeze_vision_projector_leaves_exactly_the_tower_and_projector_frozen(family):
    model = _model(family)
    direct = _direct_parts(family, model)
    prepared = _prep(model, **{"model.freeze": "vision,projector"}).apply(model)
    frozen = _numel(p for p in prepared.parameters() if not p.requires_grad)
    assert frozen == direct["vision"] + direct["projector"]
    facts = facts_of(prepared, prepared.config)  # what the estimate and the engines' optimizers are sized from
    assert facts.frozen_params == frozen
    assert sum(math.prod(s) for s in facts.param_shapes) == _numel(model.parameters()) - frozen
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    banner = _prep(model, **{"model.freeze": "vision,projector"}).banner(prepared)
    assert any(line.startswith("frozen (--freeze): vision") and f"{direct['vision']:,} parameters" in line
               for line in banner), banner


def test_freeze_language_trains_the_projector_only_on_llava():
    model = _model("llava")
    prepared = _prep(model, **{"model.freeze": "vision,language"}).apply(model)
    trained = {n for n, p in prepared.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("model.multi_modal_projector.") for n in trained)


def _adapted(model) -> set[str]:
    return {n.split(".lora_A")[0].removeprefix("base_model.model.") for n, _ in model.named_parameters()
            if ".lora_A." in n}


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_scope_language_adapts_only_the_language_model(family):
    model = _model(family, "cpu")
    roles = role_map(model)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    language = {n for n in linear if roles.role_of(n) == "language"} - {"lm_head"}
    peft_model = _prep(model, **{"lora.r": 4}).apply(model)
    adapted = _adapted(peft_model)
    assert adapted == language  # all-linear inside the scope: every language Linear but the head
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_scope_all_adapts_tower_and_projector_less_the_frozen_roles(family):
    model = _model(family, "cpu")
    roles = role_map(model)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    adapted = _adapted(_prep(model, **{"lora.r": 4, "lora.scope": "all"}).apply(model))
    assert adapted == linear
    assert any(roles.role_of(n) == "vision" for n in adapted)
    model = _model(family, "cpu")
    adapted = _adapted(_prep(model, **{"lora.r": 4, "lora.scope": "all", "model.freeze": "vision"}).apply(model))
    assert adapted == {n for n in linear if roles.role_of(n) != "vision"}
    # Qwen2-VL's merger sits inside its tower: still adapted with the tower's blocks excluded
    assert (family == "gemma3") or any(roles.role_of(n) == "projector" for n in adapted)


def test_lora_scope_targets_pick_names_inside_the_scope():
    model = _model("llava", "cpu")
    adapted = _adapted(_prep(model, **{"lora.r": 4, "lora.targets": "q_proj,v_proj"}).apply(model))
    # CLIP's attention has q_proj/v_proj too: excluded by the scope
    assert adapted and all(n.startswith("model.language_model.") and n.endswith(("q_proj", "v_proj")) for n in adapted)
    with pytest.raises(UserError, match=r"^--lora-targets fc1: no module of that name inside --lora-scope language "):
        _prep(None, **{"lora.r": 4, "lora.targets": "fc1"}).for_sizing(_model("llava"))  # CLIP's MLP only


@pytest.mark.parametrize("flags, words", [
    ({"model.freeze": "vision,tower"}, "model.freeze: unknown part 'tower'"),
    ({"model.freeze": "vision,projector,language"}, "nothing would train"),
    ({"model.freeze": "language", "lora.r": 4}, "--lora-scope language"),
    ({"model.freeze": "vision,projector,language", "lora.r": 4, "lora.scope": "all"}, "drop a part from --freeze"),
    ({"lora.scope": "all"}, "lora.scope"),
])
def test_config_refusals_are_one_line_naming_the_setting(flags, words):
    from zerotrain.config.rules import unused_settings

    with pytest.raises(ConfigError) as e:
        cfg = build_config(None, {"model.name": "tiny-vl", **flags})
        unused_settings(cfg, "deepspeed", 3, "cpu")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_text_only_models_refuse_freeze_and_an_explicit_lora_scope():
    with pytest.raises(UserError, match=r"^model.freeze=vision: LlamaForCausalLM is a text-only model .*drop --freeze$"):
        _prep(None, **{"model.freeze": "vision"}).for_sizing(_text_model())
    with pytest.raises(UserError, match=r"^lora.scope=language: LlamaForCausalLM is a text-only model .*drop --lora-scope$"):
        _prep(None, **{"lora.r": 4, "lora.scope": "language"}).for_sizing(_text_model())
    model = _prep(None, **{"lora.r": 4}).for_sizing(_text_model())  # the default scope says nothing
    assert any(".lora_A." in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("family", ["llava", "gemma3"])  # Qwen2-VL's processor needs torchvision (tests/support/vision.py)
def test_estimate_counts_the_tower_the_image_tokens_and_the_pixel_tensors(tmp_path, family):
    """The estimate's image-text rows on a saved tiny model with its real processor (28x28 images, patch 14: 4 image
    tokens, a [1, 3, 28, 28] fp32 pixel tensor); --freeze vision,projector removes exactly their gradients and
    optimizer state (ZeRO-3 partitions over 2 ranks) and the tower's activations."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.support.vision import make_vl_model_dir
    from zerotrain.memory.activations import image_text_line
    from zerotrain.memory.estimate import Setup, estimate, setup_plan

    path = make_vl_model_dir(family, tmp_path / family)
    with torch.device("meta"):
        plain = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(path)))
    direct = _direct_parts(family, plain)
    facts = facts_of(plain, plain.config)  # the same facts for both plans: the rows differ only by --freeze
    ests = {}
    for freeze in ("", "vision,projector"):
        cfg = build_config(None, {"model.name": str(path), "model.freeze": freeze, "batch.micro_batch": 2})
        ests[freeze] = estimate(setup_plan(cfg, Setup("deepspeed", 3), 2, facts=facts, device="cpu"))
    trained, frozen = ests[""].image_text, ests["vision,projector"].image_text
    assert trained.vision_params == frozen.vision_params == direct["vision"]
    assert trained.projector_params == direct["projector"]
    assert trained.image_tokens == 4 and trained.image_size == (28, 28) and trained.pixel_bytes == 3 * 28 * 28 * 4
    assert trained.vision_trains and not frozen.vision_trains
    tower = 2 * 4 * trained.tower_elements * 4  # micro-batch x patches x elements x fp32
    assert tower > 0 and ests[""].activations - ests["vision,projector"].activations == tower
    assert ests["vision,projector"].activations >= 2 * trained.pixel_bytes
    assert "4 image tokens per sample" in image_text_line(trained, 2, "fp32")
    assert "frozen: no gradients" in image_text_line(frozen, 2, "fp32")
    # with the facts of the frozen model, optimizer state shrinks by Adam's 8 bytes x each frozen tensor's partition
    with torch.device("meta"):  # (.to("meta") would untie Gemma 3's head from its embedding)
        fresh = AutoModelForImageTextToText.from_config(plain.config)
    prepared = _prep(None, **{"model.freeze": "vision,projector"}).for_sizing(fresh)
    cfg = build_config(None, {"model.name": str(path), "model.freeze": "vision,projector"})
    est = estimate(setup_plan(cfg, Setup("deepspeed", 3), 2, facts=facts_of(prepared, prepared.config), device="cpu"))
    parts = {n: p for n, p in plain.named_parameters() if not n.startswith("model.language_model") and n != "lm_head.weight"}
    partitions = sum(-(-p.numel() // 2) for p in parts.values())
    assert sum(p.numel() for p in parts.values()) == direct["vision"] + direct["projector"]
    assert ests[""].by_category()["optimizer_states"] - est.by_category()["optimizer_states"] == 8 * partitions
