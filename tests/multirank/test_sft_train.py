"""`zerotrain train` as an LLM fine-tuner uses it: a local chat .jsonl, a tiny Llama with its own tokenizer and
--chat-template chatml, LoRA on DeepSpeed ZeRO-3 over 2 ranks, packing, eval, --merge-lora and
--report-to mlflow. Checks the banner (data stats, packing efficiency, LoRA line), that the loss falls,
that final/ is a peft adapter whose logits equal final/merged's, and that MLflow's client finds every
step. Plus the one-line refusals of LoRA/chat options before any rank starts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tests.support.families as families
from tests.support.launch import rank_env, run, torchrun

pytestmark = pytest.mark.multirank  # every test here starts `zerotrain train` processes

ANSWERS = {"red": "apple", "yellow": "banana", "green": "lime", "purple": "grape", "orange": "carrot",
           "brown": "bread", "white": "milk", "black": "coffee"}


def chat_rows(n: int) -> list[dict]:
    rows = []
    colors = list(ANSWERS)
    for i in range(n):
        c = colors[i % len(colors)]
        msgs = [{"role": "user", "content": f"name a {c} food"}, {"role": "assistant", "content": ANSWERS[c]}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "answer with one word"})
        if i % 4 == 0:  # multi-turn
            d = colors[(i + 3) % len(colors)]
            msgs += [{"role": "user", "content": f"and {d}?"}, {"role": "assistant", "content": ANSWERS[d]}]
        rows.append({"messages": msgs})
    return rows


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory) -> Path:
    from zerotrain.assets.demo import build_tokenizer

    root = tmp_path_factory.mktemp("sft")
    model = families.make_model_dir("llama", root / "llama")
    build_tokenizer(vocab_size=families.VOCAB - 24).save_pretrained(str(model))
    return model


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_lora_chat_packing_zero3_mlflow_end_to_end(tmp_path, llama_with_tokenizer):
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(96))
    out = tmp_path / "run"
    res = torchrun(["-m", "zerotrain", "train", "--model", str(llama_with_tokenizer), "--data", str(data),
                    "--chat-template", "chatml", "--packing", "--seq-len", "64", "--lora-r", "8", "--lora-alpha", "16",
                    "--merge-lora", "--stage", "3", "--micro-batch", "2", "--lr", "5e-3", "--max-steps", "12",
                    "--schedule", "constant", "--eval-split", "0.1", "--report-to", "mlflow", "--output", str(out),
                    "--dist-timeout", "60"], env=rank_env(MLFLOW_TRACKING_URI=""), timeout=420)
    assert res.returncode == 0, res.stderr[-6000:]
    banner = res.stdout
    assert "(chat)" in banner and "truncated" in banner and "efficiency" in banner, banner
    assert "LoRA r=8:" in banner and "trainable of" in banner, banner
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert any("eval_loss" in r for r in steps)

    final = out / "final"
    assert (final / "adapter_config.json").is_file() and (final / "tokenizer_config.json").is_file()
    x = torch.tensor([[5, 17, 99, 300, 2, 41]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(llama_with_tokenizer))
        adapted = PeftModel.from_pretrained(base, str(final)).eval()(input_ids=x).logits
        merged = AutoModelForCausalLM.from_pretrained(str(final / "merged")).eval()(input_ids=x).logits
        untouched = AutoModelForCausalLM.from_pretrained(str(llama_with_tokenizer)).eval()(input_ids=x).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)
    assert (adapted - untouched).abs().max() > 1e-3  # the adapter changed the model

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run_id = (out / "mlflow_run_id").read_text().strip()
    logged = client.get_metric_history(run_id, "loss")
    assert [m.step for m in logged] == list(range(1, 13))
    assert client.get_run(run_id).data.params["lora.r"] == "8"


@pytest.mark.parametrize("args,line", [
    (["--chat-template", "chatml", "--lora-r", "4", "--lora-targets", "q_proj,qkv"],
     "--lora-targets q_proj,qkv: no module named qkv in LlamaForCausalLM; its linear modules are down_proj, "
     "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or pass all-linear)"),
    (["--merge-lora"], "--merge-lora needs LoRA; pass --lora-r 8"),
    (["--chat-template", "chatml", "--lora-r", "4", "--pp", "2", "--backend", "deepspeed", "--pack"],
     "lora.r=4 with --pp 2 on the deepspeed backend: not supported yet"),
    (["--data-format", "chat"], "the tokenizer has none; pass --chat-template chatml"),
])
def test_lora_and_chat_refusals_are_one_line(tmp_path, llama_with_tokenizer, args, line):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    res = run([sys.executable, "-m", "zerotrain", "train", "--model", str(llama_with_tokenizer), "--data", str(data),
               "--output", str(tmp_path / "out"), *args], timeout=120)
    errors = [x for x in res.stderr.splitlines() if "error:" in x]
    assert res.returncode != 0 and len(errors) == 1 and line in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
