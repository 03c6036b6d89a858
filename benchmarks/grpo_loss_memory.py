"""Peak memory of the GRPO policy loss: the whole [rows, tokens, vocab] logits vs the chunked head (--chunked-loss).

    .venv/bin/python benchmarks/grpo_loss_memory.py [--completion 1024] [--prompt 32] [--rows 4] [--vocab 32768]
        [--chunk 1024] [--out benchmarks/results/grpo_loss_memory]

One forward + backward of zerotrain's policy loss (zerotrain/train/grpo.py completion_logps with entropies, then
grpo_loss.GRPOLoss, dapo, token ratios, beta 0.04 with old and reference log-probs given) on a random-init Llama
(2 layers x 256, 4 heads / 2 kv, untied head) with the given vocabulary, fp32, one process on CPU. Each variant runs
in a fresh subprocess: peak RSS growth over the built model and batch (VmHWM reset through /proc/self/clear_refs
after they exist), so the figure is what the loss's forward and backward add. Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def child(a: argparse.Namespace) -> None:
    """In a fresh process: the peak RSS growth of one policy-loss forward + backward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from zerotrain.model.memory_reducers import apply
    from zerotrain.train.grpo import completion_logps
    from zerotrain.train.grpo_loss import GRPOLoss, StepNormaliser

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=688, vocab_size=a.vocab,
                                         max_position_embeddings=a.prompt + a.completion, tie_word_embeddings=False))
    chunk = a.chunk if a.variant == "chunked" else 0
    if chunk:
        apply(model, 0, chunk)
    width = a.prompt + a.completion
    ids = torch.randint(1, a.vocab, (a.rows, width), generator=torch.Generator().manual_seed(1))
    comp = torch.zeros((a.rows, width))
    comp[:, a.prompt - 1:width - 1] = 1.0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": comp}
    old = torch.full((a.rows, width), -10.0)
    ref = old - 0.1
    adv = torch.linspace(-1.0, 1.0, a.rows)
    loss = GRPOLoss(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28,
                    importance_sampling_level="token", max_completion_len=a.completion)
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak RSS (VmHWM) to the current RSS
    base = _status_kib("VmHWM")
    t0 = time.perf_counter()
    logps, ent = completion_logps(model, batch, 1.0, entropies=True, chunked=chunk)
    out = loss(logps, old, ref, adv, comp, StepNormaliser.whole(comp), entropies=ent)
    out.loss.backward()
    seconds = time.perf_counter() - t0
    print(json.dumps({"peak_growth_bytes": (_status_kib("VmHWM") - base) * 1024, "loss": float(out.loss),
                      "seconds": seconds}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--variant", choices=("whole", "chunked"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grpo_loss_memory"))
    a = p.parse_args(argv)
    if a.variant:
        child(a)
        return 0
    shared = ["--completion", str(a.completion), "--prompt", str(a.prompt), "--rows", str(a.rows), "--vocab",
              str(a.vocab), "--chunk", str(a.chunk)]
    got = {}
    for variant in ("whole", "chunked"):
        res = subprocess.run([sys.executable, __file__, *shared, "--variant", variant], capture_output=True, text=True,
                             check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        got[variant] = json.loads(res.stdout.strip().splitlines()[-1])
    logits = a.rows * (a.prompt + a.completion) * a.vocab * 4
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a), "logits_fp32_bytes": logits, **got,
           "ratio": got["chunked"]["peak_growth_bytes"] / got["whole"]["peak_growth_bytes"]}
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    md = ["# GRPO policy loss: peak memory, whole logits vs chunked head", "",
          f"Run {res['date']}, one process on CPU, fp32 (`benchmarks/grpo_loss_memory.py`): a random-init Llama 2 x 256 "
          f"with vocab {a.vocab}, {a.rows} completions of {a.completion} tokens after a {a.prompt}-token prompt; one "
          "forward + backward of the policy loss (dapo, token ratios, beta 0.04, entropies); peak RSS growth over the "
          f"built model and batch, each variant in a fresh process. One [rows, tokens, vocab] fp32 logits tensor is "
          f"{mib(logits)} here.", "",
          "| variant | peak RSS growth | seconds | loss |", "| --- | --- | --- | --- |",
          f"| whole logits (the model's own head) | {mib(got['whole']['peak_growth_bytes'])} | "
          f"{got['whole']['seconds']:.1f} | {got['whole']['loss']:.6f} |",
          f"| chunked head, {a.chunk} tokens per chunk (--chunked-loss {a.chunk}) | "
          f"{mib(got['chunked']['peak_growth_bytes'])} | {got['chunked']['seconds']:.1f} | {got['chunked']['loss']:.6f} |",
          "", f"Chunked / whole peak: {res['ratio']:.3f} (target <= 0.5). Seconds: one run on a shared 2-core machine."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
