"""The fused linear + cross-entropy loss (zerotrain/model/fused_loss.py) vs the model's own head and loss, on CPU:

1. speed: one process, forward + backward of a whole causal LM (small-gpt2: tied head, vocab 4096; small-llama:
   untied head, vocab 4096; and both at vocab 32768), plain and fused in interleaved rounds, median and range
   of the per-round median step times;
2. memory: the head + loss alone at vocab 32k and 128k (2048 tokens x hidden 512, fp32 and bf16), each variant
   in a fresh subprocess, peak RSS growth over the inputs (VmHWM after resetting it), against zerotrain's estimate of the
   logits (memory/activations.py activation_bytes: tokens x vocab x (dtype bytes + 8)).

    .venv/bin/python benchmarks/fused_loss.py [--rounds 5] [--out benchmarks/results/fused_loss]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _model(preset: str, vocab: int, fused: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotrain.assets.demo import TINY_PRESETS
    from zerotrain.model import memory_reducers
    from zerotrain.model.fused_loss import auto_chunk_tokens

    kw = dict(TINY_PRESETS[preset])
    kw["vocab_size"] = vocab
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**kw), attn_implementation="sdpa")
    if fused:
        memory_reducers.apply(model, 0, auto_chunk_tokens(vocab), fused=True)
    return model


def speed(rounds: int, steps: int) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for preset in ("small-gpt2", "small-llama"):
        for vocab in (4096, 32768):
            models = {v: _model(preset, vocab, v == "fused") for v in ("plain", "fused")}
            x = torch.randint(0, vocab, (4, 128))
            per = {v: [] for v in models}
            losses = {}
            for r in range(rounds + 1):
                for v, m in (models.items() if r % 2 == 0 else reversed(models.items())):
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        out = m(input_ids=x, labels=x)
                        out.loss.backward()
                        times.append(time.perf_counter() - t0)
                        m.zero_grad(set_to_none=True)
                    losses[v] = float(out.loss)
                    if r:  # round 0 warms up
                        per[v].append(statistics.median(times))
            med = {v: statistics.median(t) for v, t in per.items()}
            row = dict(preset=preset, vocab=vocab, tokens=x.numel(), rounds=rounds, steps_per_round=steps,
                       plain_s=med["plain"], fused_s=med["fused"], plain_over_fused=med["plain"] / med["fused"],
                       ratio_range=[min(p / f for p, f in zip(per["plain"], per["fused"])),
                                    max(p / f for p, f in zip(per["plain"], per["fused"]))],
                       loss_plain=losses["plain"], loss_fused=losses["fused"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _peak_child(variant: str, vocab: int, dtype: str, tokens: int, hidden: int) -> None:
    """In a fresh process: peak RSS growth of one forward + backward of the head + loss."""
    from zerotrain.model.fused_loss import IGNORE, auto_chunk_tokens, fused_linear_cross_entropy

    torch.manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    h = torch.randn(tokens, hidden, dtype=dt, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).to(dt).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    # one warm-up pass at a tiny size, so kernels and allocator pools do not count
    small = fused_linear_cross_entropy(h[:8], w, None, y[:8], 8) if variant == "fused" else \
        torch.nn.functional.cross_entropy((h[:8] @ w.t()).float(), y[:8], ignore_index=IGNORE, reduction="sum")
    small.backward()
    h.grad = w.grad = None
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak RSS (VmHWM) to the current RSS
    base = _status_kib("VmRSS")
    if variant == "fused":
        loss = fused_linear_cross_entropy(h, w, None, y, auto_chunk_tokens(vocab))
    else:  # what transformers' ForCausalLMLoss does: logits in the model dtype, upcast to fp32 for the loss
        loss = torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=IGNORE, reduction="sum")
    loss.backward()
    peak = _status_kib("VmHWM")
    print(json.dumps({"peak_growth_bytes": (peak - base) * 1024, "loss": float(loss)}))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory(tokens: int, hidden: int) -> list[dict]:
    rows = []
    for vocab in (32768, 131072):
        for dtype in ("fp32", "bf16"):
            row = dict(vocab=vocab, dtype=dtype, tokens=tokens, hidden=hidden)
            for variant in ("plain", "fused"):
                out = subprocess.run([sys.executable, __file__, "--child", variant, str(vocab), dtype, str(tokens),
                                      str(hidden)], capture_output=True, text=True, timeout=600,
                                     env={**os.environ, "OMP_NUM_THREADS": "2"})
                got = json.loads(out.stdout.strip().splitlines()[-1])
                row[f"{variant}_peak_bytes"] = got["peak_growth_bytes"]
                row[f"{variant}_loss"] = got["loss"]
            e = 2 if dtype == "bf16" else 4
            from zerotrain.model.fused_loss import auto_chunk_tokens

            chunk = auto_chunk_tokens(vocab)
            row["estimate_plain_bytes"] = tokens * vocab * (e + 8)  # memory/activations.py activation_bytes' head term
            row["estimate_fused_bytes"] = min(chunk, tokens) * vocab * (e + 8) + 4 * vocab * hidden
            row["chunk_tokens"] = chunk
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/fused_loss"))
    ap.add_argument("--child", nargs=5)
    a = ap.parse_args()
    if a.child:
        v, vocab, dtype, tokens, hidden = a.child
        _peak_child(v, int(vocab), dtype, int(tokens), int(hidden))
        return
    torch.set_num_threads(2)
    res = {"machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, native bf16: "
                      f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}",
           "speed": speed(a.rounds, a.steps), "memory": memory(2048, 512)}
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    lines = ["# Fused linear + cross-entropy vs the model's own loss (benchmarks/fused_loss.py)", "",
             f"Machine: {res['machine']}. fp32.", "",
             "## Step time (forward + backward, micro-batch 4 x 128 tokens, one process)", "",
             "| model | vocab | plain s | fused s | plain / fused (range over rounds) | loss plain / fused |",
             "|---|---|---|---|---|---|"]
    for r in res["speed"]:
        lines.append(f"| {r['preset']} | {r['vocab']} | {r['plain_s']:.4f} | {r['fused_s']:.4f} | "
                     f"{r['plain_over_fused']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}) | "
                     f"{r['loss_plain']:.6f} / {r['loss_fused']:.6f} |")
    lines += ["", "## Peak memory of the head + loss (2048 tokens, hidden 512; peak RSS growth in a fresh process: VmHWM reset after the inputs)",
              "", "| vocab | dtype | plain | fused | estimate plain | estimate fused | chunk tokens |",
              "|---|---|---|---|---|---|---|"]
    for r in res["memory"]:
        lines.append(f"| {r['vocab']} | {r['dtype']} | {_mib(r['plain_peak_bytes'])} | {_mib(r['fused_peak_bytes'])} "
                     f"| {_mib(r['estimate_plain_bytes'])} | {_mib(r['estimate_fused_bytes'])} | {r['chunk_tokens']} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
