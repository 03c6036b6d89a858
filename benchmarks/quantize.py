"""Quantized export side by side: size, eval perplexity and CPU forward tokens/s of fp32 vs every scheme,
and QAT-then-int4 vs fine-tune-then-int4 on the same data and steps.

    python benchmarks/quantize.py --out /tmp/zt-quant [--steps 300] [--json benchmarks/results_quantize.json]

One process each (this machine's CPU): small-llama (4 blocks, hidden 256, MLP 688, vocab sized to the local
tokenizer) trained with `zerotrain train` on the first 90% of the embedded corpus, evaluated on the last 10%
(--eval-data). Every scheme is one `zerotrain export --quantize` of the same final/, whose report holds the
bytes on disk, eval loss before/after and forward tokens/s of the fp32 and quantized models timed in
interleaved rounds. The QAT run trains with --qat int4-weight (same data, steps, seed) and its
final/quantized-int4-weight/ report gives the QAT figure.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SCHEMES = ("int8-weight", "int8-dynamic", "int4-weight", "int8-dynamic-int4-weight")
GROUP = 16  # divides small-llama's widths (256, 688)


def zt(*args: str) -> None:
    cmd = [sys.executable, "-m", "zerotrain", *args]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")


def split_corpus(root: Path) -> tuple[Path, Path]:
    from zerotrain.assets.demo import CORPUS

    lines = CORPUS.read_text().splitlines()
    cut = int(len(lines) * 0.9)
    train, val = root / "train.txt", root / "val.txt"
    train.write_text("\n".join(lines[:cut]) + "\n")
    val.write_text("\n".join(lines[cut:]) + "\n")
    return train, val


def train(model: Path, data: Path, val: Path, out: Path, steps: int, *extra: str) -> Path:
    zt("train", "--model", str(model), "--data", str(data), "--eval-data", str(val), "--seq-len", "128",
       "--micro-batch", "8", "--lr", "3e-3", "--max-steps", str(steps), "--eval-every", str(steps),
       "--save-every", str(steps), "--output", str(out), *extra)
    return out / "final"


def export(final: Path, out: Path, scheme: str, val: Path) -> dict:
    zt("export", str(final), str(out), "--quantize", scheme, "--quant-group-size", str(GROUP), "--eval-data", str(val),
       "--seq-len", "128", "--batch-size", "8")
    return json.loads((out / "quantization_report.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", default=None, help="also write the raw reports here")
    a = p.parse_args()
    from zerotrain.assets.demo import build_tiny

    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    model = build_tiny(root / "small-llama", "small-llama")
    data, val = split_corpus(root)
    plain = train(model, data, val, root / "plain", a.steps)
    reports = {s: export(plain, root / f"plain-{s}", s, val) for s in SCHEMES}
    untrained = export(model, root / "untrained-int8-weight", "int8-weight", val)
    qat_final = train(model, data, val, root / "qat", a.steps, "--qat", "int4-weight", "--quant-group-size", str(GROUP))
    qat = export(qat_final, root / "qat-int4-weight", "int4-weight", val)

    base = reports["int8-weight"]
    print(f"untrained eval loss {untrained['eval_loss_before']:.4f}; fine-tuned fp32 {base['eval_loss_before']:.4f} "
          f"(perplexity {base['perplexity_before']:.3f}); fp32 weights {base['bytes_source']:,} bytes")
    print("| scheme | bytes on disk | x fp32 | eval loss | perplexity | vs fp32 | forward tokens/s fp32 -> quantized | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| fp32 | {base['bytes_source']:,} | 1.00 | {base['eval_loss_before']:.4f} | {base['perplexity_before']:.3f} | | | |")
    for s, r in reports.items():
        print(f"| {s} | {r['bytes_quantized']:,} | {r['size_ratio']:.2f} | {r['eval_loss_after']:.4f} | "
              f"{r['perplexity_after']:.3f} | {100 * r['perplexity_change']:+.2f}% | "
              f"{r['forward_tokens_per_s_before']:,.0f} -> {r['forward_tokens_per_s_after']:,.0f} | "
              f"{r['forward_tokens_per_s_after'] / r['forward_tokens_per_s_before']:.2f} |")
    plain4 = reports["int4-weight"]
    print(f"\nint4-weight (group {GROUP}) after plain fine-tuning: eval loss {plain4['eval_loss_after']:.4f} "
          f"(fp32 {plain4['eval_loss_before']:.4f}); after QAT: {qat['eval_loss_after']:.4f} (its fp32 weights "
          f"{qat['eval_loss_before']:.4f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"steps": a.steps, "group_size": GROUP, "plain": reports, "qat_int4": qat,
                                            "untrained_int8_weight": untrained}, indent=1) + "\n")


if __name__ == "__main__":
    main()
