"""LoRA and chat-data settings refused in one line (zerotrain/config/rules.py, zerotrain/model/lora.py), without ranks."""
from __future__ import annotations

import pytest

from zerotrain.checkpoint import store as ck
from zerotrain.config.load import build_config
from zerotrain.errors import ConfigError, UserError
from zerotrain.model import lora
from zerotrain.tasks import task_spec


@pytest.mark.parametrize("overrides,line", [
    ({"lora.merge": True}, "--merge-lora needs LoRA; pass --lora-r 8"),
    ({"lora.r": 8, "model.from_config": "tiny-llama"}, "LoRA adapts pretrained weights, but --model-config tiny-llama"),
    ({"lora.r": 8, "lora.targets": " , "}, "--lora-targets is empty"),
    ({"model.task": "seq-cls", "data.format": "chat"}, "--data-format chat is for causal-lm"),
    ({"model.task": "seq-cls", "data.packing": "separate"}, "--packing is for causal-lm"),
    ({"data.packing": "separate", "parallel.pp": 2}, "--packing separate with --pp 2"),
    ({"run.report_to": "mlflow,neptune"}, "unknown tracker 'neptune'"),
])
def test_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        build_config(overrides=overrides)
    assert line in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("dim,backend,stage,line", [
    ("tp", "deepspeed", 2, "lora.r=8 with --tp 2 on the deepspeed backend: not supported yet (DeepSpeed "),
    ("tp", "deepspeed", 2, "AutoTP training fails on peft's wrapped layers: ZeRO 1-2 in deepspeed.initialize"),
    ("pp", "deepspeed", 1, "lora.r=8 with --pp 2 on the deepspeed backend: not supported yet (the DeepSpeed pipeline "
                           "builds its PipelineModule from the model's own layers, without peft's adapters); drop "
                           "--lora-r or pass --pp 1, or --backend fsdp"),
])
def test_lora_with_model_parallelism_refused_on_deepspeed(dim, backend, stage, line):
    """LoRA under tp / pp runs on FSDP2 (tests/multirank/test_lora_tensor_parallel.py); on DeepSpeed it is refused
    in one line naming the backend, what fails and --backend fsdp."""
    from zerotrain.model.facts import model_facts
    from zerotrain.plan.run_plan import build_plan

    over = {"lora.r": 8, f"parallel.{dim}": 2, "zero.stage": stage, "data.pack": True}
    with pytest.raises(ConfigError) as e:
        build_plan(build_config(overrides={**over, "backend": backend}), 2, backend=backend, device="cpu",
                   facts=model_facts("tiny-llama"))
    assert line in str(e.value) and "--backend fsdp" in str(e.value) and "\n" not in str(e.value), str(e.value)
    plan = build_plan(build_config(overrides={**over, "backend": "fsdp", "zero.stage": 3}), 2, backend="fsdp",
                      device="cpu", facts=model_facts("tiny-llama"))
    assert plan.preparation.uses_lora and getattr(plan.world, dim) == 2


def test_lora_targets_name_the_modules_that_exist():
    import transformers

    from zerotrain.model.facts import load_hf_config

    model = transformers.AutoModelForCausalLM.from_config(load_hf_config("tiny-gpt2"))
    lora.check_targets(model, "c_attn,c_proj")  # GPT-2's Conv1D names
    lora.check_targets(model, "all-linear")
    with pytest.raises(UserError, match="no module named q_proj in GPT2LMHeadModel; its linear modules are "
                                        "c_attn, c_fc, c_proj, lm_head"):
        lora.check_targets(model, "q_proj,c_attn")


WAS = {"base": "/models/a", "base_hash": "sha256:aaa", "r": 8, "alpha": 16.0, "targets": "all-linear"}


@pytest.mark.parametrize("now,line", [
    (None, "the checkpoint was trained with LoRA r=8; resume with --lora-r 8 --lora-targets all-linear"),
    (dict(WAS, base="/models/b", base_hash="sha256:bbb"),
     "the adapter was trained on base /models/a (sha256:aaa), this run loads /models/b (sha256:bbb); resume with "
     "--model /models/a"),
    (dict(WAS, r=4), "the adapter has --lora-r 8, this run 4; resume with --lora-r 8"),
    (dict(WAS, scope="all"), "the adapter has --lora-scope language, this run all; resume with --lora-scope language"),
])
def test_resume_refuses_another_base_or_adapter(now, line):
    with pytest.raises(UserError, match=line.replace("(", r"\(").replace(")", r"\)")):
        ck.check_lora_resume({"lora": WAS}, now, "ck/global_step3")
    ck.check_lora_resume({"lora": WAS}, dict(WAS), "ck")  # the same: fine
    ck.check_lora_resume({"lora": WAS}, dict(WAS, scope="language"), "ck")  # not set is the default scope
    with pytest.raises(UserError, match="trained without LoRA; resume with --lora-r 0"):
        ck.check_lora_resume({}, WAS, "ck")


def test_base_fingerprint_follows_the_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    first = lora.base_fingerprint.__wrapped__(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"weights-2")
    assert first != lora.base_fingerprint.__wrapped__(str(tmp_path)) and first.startswith("sha256:")


def test_packing_is_refused_for_a_model_without_a_block_mask():
    """A state-space model (Mamba) has no attention mask to keep packed samples apart."""
    import transformers

    from zerotrain.data.sft import supports_packing
    from zerotrain.train.preflight import _check_model_options

    assert supports_packing(transformers.LlamaForCausalLM) and supports_packing(transformers.GPT2LMHeadModel)
    assert not supports_packing(transformers.MambaForCausalLM)
    with torch_meta():
        mamba = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=16, num_hidden_layers=1,
                                                                       vocab_size=64))
    cfg = build_config(overrides={"data.packing": "separate"})
    with pytest.raises(UserError, match="--packing separate: MambaForCausalLM does not build its attention mask"):
        _check_model_options(cfg, mamba)
    _check_model_options(build_config(), mamba)  # without packing it trains


def torch_meta():
    import torch

    return torch.device("meta")



def test_estimate_splits_the_adapters_as_the_fsdp_tensor_parallel_split():
    """The memory estimate of LoRA under tp counts the adapters (not the frozen base) at their tp-local shapes:
    a colwise layer's lora_B and a rowwise layer's lora_A halved at tp 2, the other factor whole
    (backends/fsdp/tensor_parallel.py lora_plan)."""
    import dataclasses

    from zerotrain.memory.parallel import param_layout, rank_shapes
    from zerotrain.model.facts import load_hf_config, meta_model, model_facts
    from zerotrain.config.preparation import LoraPlan

    plan = LoraPlan(r=4, alpha=8.0, dropout=0.0, targets="all-linear", merge=False, peft_task_type="CAUSAL_LM", seed=0,
                    gradient_checkpointing=False)
    layout = param_layout("tiny-llama", task_spec("causal-lm"), plan)
    adapted = lora.apply_lora(meta_model(load_hf_config("tiny-llama")), plan)
    full = [tuple(p.shape) for _, p in adapted.named_parameters() if p.requires_grad]
    assert len(layout.names) == len(full) > 0 and all("lora_" in n for n in layout.names), layout.names
    facts = dataclasses.replace(model_facts("tiny-llama"), param_shapes=tuple(full))
    local = dict(zip(layout.names, rank_shapes(layout, facts, tp=2, pp=1, stage=0)))
    whole = dict(zip(layout.names, full))
    checked = 0
    for name, (rows, cols) in whole.items():
        if ".q_proj.lora_B." in name or ".gate_proj.lora_B." in name:
            assert local[name] == (rows // 2, cols), name
        elif ".o_proj.lora_A." in name or ".down_proj.lora_A." in name:
            assert local[name] == (rows, cols // 2), name
        elif ".q_proj.lora_A." in name or ".down_proj.lora_B." in name:
            assert local[name] == (rows, cols), name
        else:
            continue
        checked += 1
    assert checked >= 6, checked


def test_resume_refuses_another_freeze():
    """--freeze (image-text roles) is part of the run's identity: other roles would start or drop optimizer state."""
    meta = ck.CheckpointMeta(backend="fsdp", format="dcp", zero_stage=3, world_size=2, dtype="fp32", model_class="M",
                             model_config_hash="h", global_step=2, extra={"freeze": ["projector", "vision"]})
    now = ck.RunIdentity(backend="fsdp", format="dcp", world_size=2, zero_stage=3, dtype="fp32", tp=1, pp=1,
                         nvme_optimizer=False, model_id=("M", "h"), freeze=("vision",))
    with pytest.raises(UserError, match=r"trained with --freeze projector,vision, this run vision; resume with "
                                        r"--freeze projector,vision"):
        ck.check_resume(meta, "ck/global_step2", now)
    ck.check_resume(meta, "ck", ck.RunIdentity(**{**now.__dict__, "freeze": ("projector", "vision")}))
