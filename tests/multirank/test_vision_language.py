"""Image-text models (issue 55) through `zerotrain train` as a user runs it: a tiny LLaVA / Gemma 3 / Qwen2-VL
(tests/support/vision.py, saved with its real processor) and a chat set with images in TRL's vision format, the
default task (causal-lm resolves to the image-text entry; the banner says so).

One cell per family and backend, each doing in one test:
- one process, 4 steps, global batch 8 = the whole set: its step-1 loss equals the independent computation of
  tests/support/vision.py reference_loss (the processor's own call, AutoModelForImageTextToText.from_pretrained) to
  1e-5, and its losses are the reference of the 2-rank run;
- 2 ranks (torchrun) stopped after step 2 (a constant LR: --max-steps 2 then 4 give one schedule), then `--resume`d
  to step 4: steps 1-4 equal the one process's (1e-5) and the resumed run started at step 3;
- final/ reloaded by AutoModelForImageTextToText + AutoProcessor: it generates, its weights moved from the start, and
  `zerotrain export`'s exporter on the step-4 checkpoint gives the same logits (the processor exported with it).
CI: LLaVA on FSDP2 stage 3 and Gemma 3 on DeepSpeed ZeRO-3 with leaf blocks (SLOW's docstring says why; Qwen2-VL's
processor needs torchvision, which does not load on this CPU machine: its cells exist only where it does,
tests/support/vision.py unavailable); the swapped pairs and Qwen2-VL are slow.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import rank_env, run, torchrun
from tests.support.matrix import cells
from tests.support.vision import make_vl_dataset, make_vl_model_dir, reference_loss, unavailable

pytestmark = pytest.mark.multirank

CASES = {
    "llava-fsdp3": ("llava", ["--backend", "fsdp", "--stage", "3"]),
    "gemma3-deepspeed3-leaf": ("gemma3", ["--backend", "deepspeed", "--stage", "3", "--leaf-blocks"]),
    "llava-deepspeed3": ("llava", ["--backend", "deepspeed", "--stage", "3"]),
    "gemma3-fsdp3": ("gemma3", ["--backend", "fsdp", "--stage", "3"]),
    **({} if unavailable("qwen2-vl") else {
        "qwen2-vl-fsdp3": ("qwen2-vl", ["--backend", "fsdp", "--stage", "3"]),
        "qwen2-vl-deepspeed3": ("qwen2-vl", ["--backend", "deepspeed", "--stage", "3"])}),
}
SLOW = {"llava-deepspeed3", "gemma3-fsdp3", *({} if unavailable("qwen2-vl") else
                                              {"qwen2-vl-fsdp3", "qwen2-vl-deepspeed3"})}
"""CI: LLaVA on FSDP2 (its CLIP post_layernorm never gets a gradient, so its checkpoint holds no optimizer state for
it: the resume reads around it, zerotrain/backends/fsdp/engine.py) and Gemma 3 on DeepSpeed ZeRO-3 with the towers'
and decoder's blocks as leaf modules (--leaf-blocks forced: auto keeps them off for unmeasured model types)."""
ROWS = 8
COMMON = ["--seq-len", "64", "--global-batch", str(ROWS), "--micro-batch", "2", "--lr", "1e-3", "--schedule",
          "constant", "--save-every", "2", "--dist-timeout", "120", "--seed", "0"]


def losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("family,flags", cells(CASES.values(), SLOW, ids=lambda v: next(
    k for k, c in CASES.items() if c == v)))
def test_two_ranks_equal_one_process_resume_and_export(tmp_path, family, flags):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from zerotrain.export.to_hf import export_checkpoint

    env = rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache"))
    model = make_vl_model_dir(family, tmp_path / "model")
    data = make_vl_dataset(tmp_path / "data.jsonl", ROWS, tmp_path / "img")
    args = ["-m", "zerotrain", "train", "--model", str(model), "--data", str(data), *COMMON, *flags]

    one = run([sys.executable, *args, "--max-steps", "4", "--output", str(tmp_path / "one")], env=env, timeout=420,
              check=True)
    assert f"task image-text (AutoModelForImageTextToText, {type(AutoProcessor.from_pretrained(model)).__name__})" \
        in one.stdout, one.stdout[-2000:]
    ref = losses(tmp_path / "one")
    assert len(ref) == 4
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert ref[0] == pytest.approx(reference_loss(model, rows), rel=1e-5)  # step 1: the whole set, before any update

    two = tmp_path / "two"
    torchrun([*args, "--max-steps", "2", "--output", str(two)], env=env, timeout=420)
    assert losses(two) == pytest.approx(ref[:2], rel=1e-5)
    res = torchrun([*args, "--max-steps", "4", "--resume", "--output", str(two)], env=env, timeout=420)
    assert "done: 2 steps (to step 4)" in res.stdout + res.stderr, res.stdout[-3000:]
    assert losses(two) == pytest.approx(ref, rel=1e-5)

    final = two / "final"
    trained = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(final)
    assert type(proc).__name__ == type(AutoProcessor.from_pretrained(model)).__name__ and proc.chat_template
    start = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))
    prompt = proc.apply_chat_template(rows[0]["messages"][:1], tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[prompt], images=[[Image.open(rows[0]["images"][0]).convert("RGB")]], return_tensors="pt",
                  add_special_tokens=False)
    with torch.no_grad():
        out = trained.generate(**inputs, max_new_tokens=4, do_sample=False)
        logits = trained(**inputs).logits
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4

    exported = tmp_path / "exported"  # `zerotrain export`'s function, in this process (the CLI's own cells: no new one)
    export_checkpoint(two / "checkpoints" / "global_step4", exported)
    again = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32).eval()
    assert type(AutoProcessor.from_pretrained(exported)).__name__ == type(proc).__name__
    with torch.no_grad():
        assert torch.allclose(again(**inputs).logits, logits, rtol=1e-5, atol=1e-6)
