"""The --hf-auto flavour works unchanged with HF Trainer (`TrainingArguments(deepspeed=file)`), 2 CPU ranks: "auto"
filled from TrainingArguments, HF Trainer's step-1 loss equal to zerotrain's on the same micro-batches, and it learns."""
import json

import pytest

from tests.support.launch import REPO, torchrun

pytest.importorskip("deepspeed")


@pytest.mark.multirank
def test_hf_auto_zero3_with_hf_trainer(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotrain.assets.demo import TINY_PRESETS

    kw = {k: v for k, v in TINY_PRESETS["tiny-gpt2"].items() if k != "model_type"}
    GPT2LMHeadModel(GPT2Config(**kw)).save_pretrained(tmp_path / "model")
    out = tmp_path / "result.json"
    torchrun([REPO / "tests" / "support" / "hf_trainer_worker.py", tmp_path / "model", REPO / "ds_configs/hf/zero3.json", out],
             timeout=600)
    r = json.loads(out.read_text())
    assert (r["stage"], r["world"], r["micro"], r["accum"]) == (3, 2, 2, 2)  # "auto" filled from TrainingArguments
    hf, zt = r["losses"], r["zerotrain_step1"]
    assert len(hf) == 4, hf
    # The same weights and the same micro-batches on each rank: the first step's loss (before any update) agrees.
    # transformers 5.24's Trainer divides the token sum by the labels counted unshifted (a row of 32 gives 31 loss
    # terms) when the model's loss_type is unset, as for this GPT-2: its figure is zerotrain's per-token mean x 31/32.
    assert r["loss_tokens"] / r["hf_divisor_tokens"] == 31 / 32, r
    assert abs(hf[0] - zt * r["loss_tokens"] / r["hf_divisor_tokens"]) <= 1e-5 * abs(zt), (hf[0], zt)
    assert hf[-1] < hf[0] - 0.05, hf  # it learns: 4 AdamW steps at lr 1e-3 on 16 rows, each seen twice
