"""The model preparation (zerotrain/model/preparation.py): the one owner of "is LoRA / QAT on, and how", held by the
run plan; applied as the engines apply it; recorded as checkpoints record it; and no module but it (and
the rules layer) reads the config's lora section or its QAT scheme."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain.config.load import build_config
from zerotrain.model.preparation import LoraPlan, ModelPreparation, QatPlan
from zerotrain.plan.run_plan import build_plan

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"



def test_from_config():
    # a causal LM's default: nothing prepared but the fused loss, on where the model carries it
    assert ModelPreparation.from_config(build_config()) == ModelPreparation(fused_loss=None)
    assert ModelPreparation.from_config(build_config(overrides={"model.task": "seq-cls"})) == ModelPreparation()
    none = ModelPreparation()
    assert (none.uses_lora, none.uses_qat, none.lora_rank, none.merge_lora) == (False, False, 0, False)
    assert none.qat_record() is None and none.lora_record("/models/a") is None

    cfg = build_config(overrides={"lora.r": 8, "lora.alpha": 32.0, "lora.targets": "c_attn", "lora.merge": True,
                                  "run.seed": 3, "model.gradient_checkpointing": True})
    prep = ModelPreparation.from_config(cfg)
    assert prep.lora == LoraPlan(r=8, alpha=32.0, dropout=0.0, targets="c_attn", merge=True, peft_task_type="CAUSAL_LM", seed=3,
                                 gradient_checkpointing=True)
    assert (prep.uses_lora, prep.uses_qat, prep.lora_rank, prep.merge_lora) == (True, False, 8, True)

    prep = ModelPreparation.from_config(build_config(overrides={"quant.qat": "int4-weight", "quant.group_size": 64}))
    assert prep.qat == QatPlan("int4-weight", 64) and prep.lora is None
    assert prep.qat_record() == {"scheme": "int4-weight", "group_size": 64}


def test_the_plan_holds_the_preparation():
    cfg = build_config(overrides={"lora.r": 4})
    plan = build_plan(cfg, 2, backend="fsdp", device="cpu")
    assert plan.preparation == ModelPreparation.from_config(cfg) and plan.preparation.uses_lora
    assert build_plan(build_config(), 2, backend="deepspeed", device="cpu").preparation == \
        ModelPreparation(fused_loss=None)


def test_checkpoint_identity_records_the_preparation(tmp_path):
    from zerotrain.checkpoint import store as ck

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    cfg = build_config(overrides={"lora.r": 4, "lora.alpha": 8.0})
    ident = ck.identity_of(build_plan(cfg, 2, backend="fsdp", device="cpu"), ("M", "h"), lora_base=str(tmp_path))
    assert ident.quant is None
    assert ident.lora == {"base": str(tmp_path), "base_hash": ident.lora["base_hash"], "r": 4, "alpha": 8.0,
                          "targets": "all-linear"} and ident.lora["base_hash"].startswith("sha256:")
    plain = ck.identity_of(build_plan(build_config(overrides={"quant.qat": "int4-weight"}), 2, backend="fsdp",
                                      device="cpu"), ("M", "h"), lora_base=str(tmp_path))
    assert plain.lora is None and plain.extra() == {"quant": {"scheme": "int4-weight", "group_size": 32},
                                                    "optimizer": "adamw"}


def test_apply_check_and_banner_under_lora():
    """LoRA through the preparation: the peft model (seeded: the same adapters twice), adapters alone
    trainable, the sizing model the same; bad target names refused before anything is built."""
    import torch
    import transformers

    from zerotrain.errors import UserError
    from zerotrain.model.facts import load_hf_config

    def base():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(load_hf_config("tiny-gpt2"))

    prep = ModelPreparation.from_config(build_config(overrides={"lora.r": 4, "lora.targets": "c_attn"}))
    prep.check(base())
    one, two = prep.apply(base()), prep.apply(base())
    trainable = [n for n, p in one.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(torch.equal(a, b) for a, b in zip(one.parameters(), two.parameters()))
    assert [n for n, p in prep.for_sizing(base()).named_parameters() if p.requires_grad] == trainable
    line, loss_line = prep.banner(one)
    assert loss_line.startswith("fused loss: head + cross-entropy over chunks of ")
    assert line.startswith("LoRA r=4: ") and "trainable of" in line
    bad = ModelPreparation.from_config(build_config(overrides={"lora.r": 4, "lora.targets": "q_proj"}))
    with pytest.raises(UserError, match="--lora-targets q_proj: no module named q_proj in GPT2LMHeadModel"):
        bad.check(base())
    model = base()
    assert ModelPreparation().apply(model) is model and ModelPreparation().banner(model) == []


def test_qat_check_refuses_what_torchao_would_leave():
    import transformers

    from zerotrain.errors import UserError
    from zerotrain.model.facts import load_hf_config

    prep = ModelPreparation.from_config(build_config(overrides={"quant.qat": "int4-weight"}))
    gpt2 = transformers.AutoModelForCausalLM.from_config(load_hf_config("tiny-gpt2"))
    with pytest.raises(UserError, match="--qat int4-weight: gpt2 keeps its projections in transformers' Conv1D"):
        prep.check(gpt2)
    with pytest.raises(UserError, match="--qat int4-weight: gpt2 keeps its projections"):
        prep.for_sizing(gpt2)


def test_importing_the_preparation_imports_no_torch():
    """The plan holds a preparation and `zerotrain config` builds plans: neither may pull in torch."""
    code = "import sys, zerotrain.plan.run_plan, zerotrain.model.preparation; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"
