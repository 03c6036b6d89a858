"""The --hf-auto flavour works unchanged with HF Trainer (`TrainingArguments(deepspeed=file)`), 2 CPU ranks."""
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
    assert len(r["losses"]) == 3 and all(l > 0 for l in r["losses"])
