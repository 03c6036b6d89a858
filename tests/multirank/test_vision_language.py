"""Image-text models (issue 55) through `zerotrain train` as a user runs it: a tiny LLaVA / Gemma 3 / Qwen2-VL
(tests/support/vision.py, saved with its real processor) and a chat set with images in TRL's vision format, the
default task (causal-lm resolves to the image-text entry; the banner says so).

One cell per family and backend, each doing in one test (one one-process run, two 2-rank launches):
- one process, 4 steps, global batch 8 = the whole set: its step-1 loss equals the independent computation of
  tests/support/vision.py reference_loss (the processor's own call, AutoModelForImageTextToText.from_pretrained) to
  1e-5, and its losses are the reference of the 2-rank run;
- 2 ranks (torchrun) with --gradient-checkpointing (the one process runs without it) stopped after step 2 (a
  constant LR: --max-steps 2 then 4 give one schedule), then `--resume`d to step 4: steps 1-4 equal the one
  process's (1e-5) and the resumed run started at step 3; checkpointing recomputes both the tower's and the
  decoder's blocks (counted on the model zerotrain builds, in this process);
- evaluation with images: --eval-data (4 held-out image chats) at steps 2 and 4: the 2-rank eval losses equal the
  one process's, and the step-4 one equals reference_loss of the held-out chats on final/ (1e-5);
- --freeze (FREEZE: the cell's frozen role, on both runs): final/'s frozen weights equal the loaded ones bit for
  bit, each other role's moved;
- final/ reloaded by AutoModelForImageTextToText + AutoProcessor: it generates, its weights moved from the start, and
  `zerotrain export`'s exporter on the step-4 checkpoint gives the same logits (the processor exported with it).
CI: LLaVA on FSDP2 stage 3 (--freeze projector) and Gemma 3 on DeepSpeed ZeRO-3 with leaf blocks (--freeze vision;
SLOW's docstring says why; Qwen2-VL's processor needs torchvision, which does not load on this CPU machine: its cells
exist only where it does, tests/support/vision.py unavailable); the swapped pairs and Qwen2-VL are slow.
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
FREEZE = {"llava": "projector", "gemma3": "vision", "qwen2-vl": "projector"}
"""The role each family's cells freeze. LLaVA keeps its tower training: its CLIP post_layernorm never gets a gradient,
the resume path the FSDP2 cell proves (below)."""
ROWS = 8
EVAL_ROWS = 4
COMMON = ["--seq-len", "64", "--global-batch", str(ROWS), "--micro-batch", "2", "--lr", "1e-3", "--schedule",
          "constant", "--save-every", "2", "--dist-timeout", "120", "--seed", "0"]


def losses(out: Path, key: str = "loss") -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def _params(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def _recomputed(model_dir: Path) -> dict[str, int]:
    """Forward calls inside the tower's and the decoder's first block in one forward + backward of the model zerotrain
    builds with --gradient-checkpointing (2: recomputed in backward)."""
    from transformers import AutoProcessor

    from zerotrain.config.load import build_config
    from zerotrain.model.source import resolve_model
    from zerotrain.model.vision_roles import tower_blocks

    model = resolve_model(build_config(None, {"model.name": str(model_dir), "model.gradient_checkpointing": True,
                                              "data.seq_len": 64})).factory()()
    model.train()
    calls = {"tower": 0, "decoder": 0}
    for name, block in (("tower", tower_blocks(model)[0]), ("decoder", model.get_decoder().layers[0])):
        # a Linear inside the block: transformers checkpoints the block's forward, its own hooks stay outside
        inner = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
        inner.register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    proc = AutoProcessor.from_pretrained(str(model_dir))
    from PIL import Image

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    batch = proc(text=[proc.apply_chat_template(msgs, tokenize=False)], images=[[Image.new("RGB", (28, 28))]],
                 return_tensors="pt", add_special_tokens=False)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    return calls


@pytest.mark.parametrize("family,flags", cells(CASES.values(), SLOW, ids=lambda v: next(
    k for k, c in CASES.items() if c == v)))
def test_two_ranks_equal_one_process_resume_and_export(tmp_path, family, flags):
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from zerotrain.export.to_hf import export_checkpoint

    from zerotrain.model.vision_roles import role_map

    env = rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache"))
    model = make_vl_model_dir(family, tmp_path / "model")
    data = make_vl_dataset(tmp_path / "data.jsonl", ROWS, tmp_path / "img")
    held_out = make_vl_dataset(tmp_path / "eval.jsonl", EVAL_ROWS, tmp_path / "eval_img", seed=1)
    args = ["-m", "zerotrain", "train", "--model", str(model), "--data", str(data), *COMMON, *flags,
            "--eval-data", str(held_out), "--eval-every", "2", "--freeze", FREEZE[family]]

    one = run([sys.executable, *args, "--max-steps", "4", "--output", str(tmp_path / "one")], env=env, timeout=420,
              check=True)
    assert f"task image-text (AutoModelForImageTextToText, {type(AutoProcessor.from_pretrained(model)).__name__})" \
        in one.stdout, one.stdout[-2000:]
    ref = losses(tmp_path / "one")
    assert len(ref) == 4
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert ref[0] == pytest.approx(reference_loss(model, rows), rel=1e-5)  # step 1: the whole set, before any update
    ref_eval = losses(tmp_path / "one", "eval_loss")
    assert len(ref_eval) == 2 and ref_eval[0] != pytest.approx(ref_eval[1], rel=1e-4)  # steps 2 and 4: it moved

    two = tmp_path / "two"
    ckpt = ["--gradient-checkpointing"]  # the one process runs without it: equal losses prove it changes nothing
    torchrun([*args, *ckpt, "--max-steps", "2", "--output", str(two)], env=env, timeout=420)
    assert losses(two) == pytest.approx(ref[:2], rel=1e-5)
    res = torchrun([*args, *ckpt, "--max-steps", "4", "--resume", "--output", str(two)], env=env, timeout=420)
    assert "done: 2 steps (to step 4)" in res.stdout + res.stderr, res.stdout[-3000:]
    assert losses(two) == pytest.approx(ref, rel=1e-5)
    assert _recomputed(model) == {"tower": 2, "decoder": 2}

    final = two / "final"
    # evaluation with images: every held-out chat once over the 2 ranks, token-weighted as one process does
    assert losses(two, "eval_loss") == pytest.approx(ref_eval, rel=1e-5)
    assert ref_eval[1] == pytest.approx(
        reference_loss(final, [json.loads(x) for x in held_out.read_text().splitlines()]), rel=1e-5)

    # --freeze: the frozen role bit for bit, each other role moved
    before, after = _params(model), _params(final)
    with torch.device("meta"):
        roles = role_map(AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(model))))
    for role in ("vision", "projector", "language"):
        keys = [k for k in before if roles.role_of(k) == role]
        moved = [k for k in keys if not torch.equal(before[k], after[k])]
        assert keys and (not moved if role == FREEZE[family] else moved), (role, moved[:3])

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
