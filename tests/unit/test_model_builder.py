"""zerotrain.model.source.ModelBuilder in one process: fp32 master weights whatever the checkpoint's dtype,
and `empty()` = the same architecture on the meta device (what FSDP ranks > 0 build)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tests.support.reference as ref
from zerotrain.model.source import ModelBuilder, ModelSource
from zerotrain.tasks import task_spec


def _builder(model_dir, gradient_checkpointing: bool = False) -> ModelBuilder:
    source = ModelSource(task_spec("causal-lm"), str(model_dir), AutoConfig.from_pretrained(model_dir), tokenizer=None,
                         gradient_checkpointing=gradient_checkpointing)
    return ModelBuilder(source, {}, seed=0)


def test_bf16_checkpoint_loads_as_fp32_master_weights(tmp_path):
    src = ref.make_model_dir(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    # transformers 5 keeps a checkpoint's dtype by default: a bf16 hub model would train in bf16.
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    model = _builder(tmp_path / "bf16")()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert torch.equal(model.transformer.wte.weight, saved.transformer.wte.weight.float())


def test_empty_is_the_same_architecture_on_meta(tmp_path):
    b = _builder(ref.make_model_dir(tmp_path / "m"), gradient_checkpointing=True)
    full, empty = b(), b.empty()
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    assert {k: (v.shape, v.dtype) for k, v in empty.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in full.state_dict().items()}
    assert empty.lm_head.weight is empty.transformer.wte.weight  # tied as in the loaded model
    flag = "is_activation_checkpointing" if hasattr(full, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert getattr(empty, flag) and getattr(full, flag)
