"""Quantization that pays: the dynamic / static / QAT table the quantization guides show, measured side by side
on this machine's CPU for two families.

    python benchmarks/quantize.py --out /tmp/zt-quant [--steps 60] [--families small-llama,small-qwen2] \
        [--rounds 15] [--json benchmarks/results/quantize_table.json] [--profile benchmarks/results/quantize_profile.txt] \
        [--widths 256,512,1024]

Per family (zerotrain's presets: 4 blocks, hidden 256, MLP 688, vocab sized to the local tokenizer; Llama and
Qwen2 with q/k/v biases): a random init fine-tuned with `zerotrain train` on the first 90% of the embedded corpus,
evaluated on the last 10%. Every quantized row is one `zerotrain export --quantize` of that final/, whose report
gives the bytes on disk and the eval perplexity of the reloaded artifact:

- int8-dynamic (torchao, HF directory)
- int8-static (PT2E + x86 inductor quantizer, torch.export program; calibrated on the training split)
- QAT: a second fine-tune with `--qat int8-dynamic-int4-weight` (torchao 0.18 has no int8-weight QAT), exported
  to that scheme; beside it the same scheme quantized after plain fine-tuning (what QAT has to beat)
- int8-dynamic and int8-static with --quantize-embeddings (the size row)

Latency: every model loaded in this one process (HF dirs with from_pretrained, the program with its loader) and
timed together in interleaved rounds (zerotrain/export/latency.py): eager and torch.compile'd (inductor
freezing), at the prefill batch 4 x 128 and a decode-like step 1 x 1; medians and ranges in the JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

SEQ, BATCH = 128, 4
GROUP = 16  # divides the presets' widths (256, 688)
QAT_SCHEME = "int8-dynamic-int4-weight"


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
    zt("train", "--model", str(model), "--data", str(data), "--eval-data", str(val), "--seq-len", str(SEQ),
       "--micro-batch", "8", "--lr", "3e-3", "--max-steps", str(steps), "--eval-every", str(steps),
       "--save-every", str(steps), "--output", str(out), *extra)
    return out / "final"


def export(final: Path, out: Path, scheme: str, val: Path, *extra: str) -> dict:
    zt("export", str(final), str(out), "--quantize", scheme, "--eval-data", str(val), "--seq-len", str(SEQ),
       "--batch-size", str(BATCH), "--serve-timing", "off", *extra)
    return json.loads((out / "quantization_report.json").read_text())


def family_rows(root: Path, preset: str, data: Path, val: Path, steps: int) -> list[dict]:
    """The family's rows: name, artifact dir, its export report (None for fp32)."""
    from zerotrain.assets.demo import build_tiny

    model = build_tiny(root / preset, preset)
    plain = train(model, data, val, root / f"{preset}-plain", steps)
    calib = ("--calibration-data", str(data))
    group = ("--quant-group-size", str(GROUP))
    rows = [{"row": "fp32", "dir": plain, "report": None}]
    for row, scheme, extra in (("dynamic (int8-dynamic)", "int8-dynamic", ()),
                               ("static (int8-static)", "int8-static", calib),
                               (f"PTQ {QAT_SCHEME}", QAT_SCHEME, group),
                               ("dynamic + embeddings", "int8-dynamic", ("--quantize-embeddings",)),
                               ("static + embeddings", "int8-static", (*calib, "--quantize-embeddings"))):
        out = root / f"{preset}-{row.split(' (')[0].replace(' + ', '-').replace(' ', '-')}"
        rows.append({"row": row, "dir": out, "report": export(plain, out, scheme, val, *extra)})
    qat_final = train(model, data, val, root / f"{preset}-qat", steps, "--qat", QAT_SCHEME, *group)
    out = root / f"{preset}-qat-{QAT_SCHEME}"
    rows.append({"row": f"QAT {QAT_SCHEME}", "dir": out, "report": export(qat_final, out, QAT_SCHEME, val, *group)})
    return rows


def load_rows(rows: list[dict]) -> dict:
    """Every row's model as a callable input_ids -> logits, loaded the way a user loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from zerotrain.export import static_int8
    from zerotrain.export.quantized import logits_forward

    models = {}
    for r in rows:
        if (r["dir"] / static_int8.PROGRAM_FILE).is_file():
            models[r["row"]] = static_int8.load_program(r["dir"], compile=False)
        else:
            models[r["row"]] = logits_forward(AutoModelForCausalLM.from_pretrained(r["dir"], dtype=torch.float32).eval())
    return models


def profile(models: dict, vocab: int, names: list[str]) -> str:
    """torch.profiler's top operators (self CPU time) of the compiled models at the prefill batch: where the
    time goes once the Linears are int8 (attention, norms, rotary and the fp32 head stay as they were)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from zerotrain.export import latency

    ids = latency.serve_ids(latency.serve_shapes(BATCH, SEQ)[0], vocab)
    out = []
    with latency.freezing(), torch.no_grad():
        for name in names:
            fwd = latency.compiled(models[name])
            for _ in range(3):
                fwd(ids)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    fwd(ids)
            out += [f"## {name}: 10 prefill forwards ({BATCH} x {SEQ}), compiled", "",
                    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), ""]
    return "\n".join(out)


def table(preset: str, rows: list[dict], timed: dict) -> list[str]:
    fp32 = timed["fp32"]
    base = rows[1]["report"]

    def ratio(name, mode, shape, base_mode):
        return timed[name][mode][shape]["median_ms"] / fp32[base_mode][shape]["median_ms"]

    lines = [f"### {preset}", "",
             f"fp32: {base['bytes_source']:,} bytes, eval perplexity {base['perplexity_before']:.3f}; prefill "
             f"{fp32['eager']['prefill']['median_ms']:.2f} ms eager, {fp32['compiled']['prefill']['median_ms']:.2f} ms "
             f"compiled; decode {fp32['eager']['decode']['median_ms']:.2f} / {fp32['compiled']['decode']['median_ms']:.2f} ms",
             "",
             "| row | size x fp32 | perplexity vs fp32 | vs its own fp32 weights | prefill compiled / fp32 eager "
             "| prefill compiled / fp32 compiled | prefill eager / fp32 eager | decode compiled / fp32 eager "
             "| decode compiled / fp32 compiled |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows[1:]:
        rep, name = r["report"], r["row"]
        ppl = rep["perplexity_after"] / base["perplexity_before"] - 1.0  # QAT: its own run's weights differ
        lines.append(f"| {name} | {rep['size_ratio']:.2f} | {100 * ppl:+.2f}% | {100 * rep['perplexity_change']:+.2f}% | "
                     f"{ratio(name, 'compiled', 'prefill', 'eager'):.2f} | {ratio(name, 'compiled', 'prefill', 'compiled'):.2f} | "
                     f"{ratio(name, 'eager', 'prefill', 'eager'):.2f} | {ratio(name, 'compiled', 'decode', 'eager'):.2f} | "
                     f"{ratio(name, 'compiled', 'decode', 'compiled'):.2f} |")
    return lines + [""]


def build_wide(root: Path, hidden: int) -> Path:
    """A random-init 4-block Llama of the given width (small-llama's proportions: MLP 2.6875x, 64-wide heads, 2 query
    heads per key/value head), with the local tokenizer: latency only, no perplexity."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zerotrain.assets.demo import build_tokenizer

    tokenizer = build_tokenizer()
    heads = hidden // 64
    config = LlamaConfig(num_hidden_layers=4, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=512,
                         vocab_size=-(-len(tokenizer) // 64) * 64, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = root / f"llama-h{hidden}"
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def width_sweep(root: Path, widths: list[int], data: Path, val: Path, rounds: int) -> tuple[list[str], dict]:
    """fp32 / int8-dynamic / int8-static latency as the Linears' share of the work grows with the width."""
    from zerotrain.export import latency

    lines = ["### width sweep (random-init 4-block Llama, prefill 4 x 128; ratios of medians)", "",
             "| hidden | fp32 eager ms | fp32 compiled ms | dynamic compiled / fp32 eager | static compiled / fp32 eager "
             "| dynamic compiled / fp32 compiled | static compiled / fp32 compiled |", "|---|---|---|---|---|---|---|"]
    raw = {}
    for hidden in widths:
        model = build_wide(root, hidden)
        rows = [{"row": "fp32", "dir": model, "report": None}]
        for row, scheme, extra in (("dynamic", "int8-dynamic", ()),
                                   ("static", "int8-static", ("--calibration-data", str(data)))):
            out = root / f"llama-h{hidden}-{row}"
            rows.append({"row": row, "dir": out, "report": export(model, out, scheme, val, *extra)})
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        t = latency.measure(load_rows(rows), vocab, latency.serve_shapes(BATCH, SEQ)[:1], rounds=rounds)
        raw[hidden] = t

        def ms(name, mode):
            return t[name][mode]["prefill"]["median_ms"]

        lines.append(f"| {hidden} | {ms('fp32', 'eager'):.1f} | {ms('fp32', 'compiled'):.1f} | "
                     f"{ms('dynamic', 'compiled') / ms('fp32', 'eager'):.2f} | {ms('static', 'compiled') / ms('fp32', 'eager'):.2f} | "
                     f"{ms('dynamic', 'compiled') / ms('fp32', 'compiled'):.2f} | "
                     f"{ms('static', 'compiled') / ms('fp32', 'compiled'):.2f} |")
    return lines + [""], raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--families", default="small-llama,small-qwen2", help="presets for the table ('' for none)")
    p.add_argument("--widths", default="", help="also time fp32/dynamic/static Llamas of these hidden sizes, e.g. 256,512,1024")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per model, mode and shape")
    p.add_argument("--json", default=None, help="also write the raw reports and timings here")
    p.add_argument("--profile", default=None, help="also write the compiled fp32 / dynamic / static profiles here")
    a = p.parse_args()
    import torch

    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    data, val = split_corpus(root)
    results, lines = {}, []
    from zerotrain.export import latency

    profiles = []
    for preset in [f for f in a.families.split(",") if f]:
        rows = family_rows(root, preset, data, val, a.steps)
        models = load_rows(rows)
        vocab = json.loads((rows[0]["dir"] / "config.json").read_text())["vocab_size"]
        timed = latency.measure(models, vocab, latency.serve_shapes(BATCH, SEQ), rounds=a.rounds)
        lines += table(preset, rows, timed)
        results[preset] = {"rows": [{"row": r["row"], "report": r["report"]} for r in rows], "latency_ms": timed}
        if a.profile:
            profiles += [f"# {preset}", "", profile(models, vocab, [rows[0]["row"], rows[1]["row"], rows[2]["row"]])]
    if a.widths:
        sweep_lines, results["width_sweep"] = width_sweep(root, [int(w) for w in a.widths.split(",")], data, val,
                                                          a.rounds)
        lines += sweep_lines
    print("\n".join(lines))
    if a.profile:
        Path(a.profile).write_text("\n".join(profiles) + "\n")
    if a.json:
        meta = {"steps": a.steps, "prefill": [BATCH, SEQ], "decode": [1, 1], "rounds": a.rounds, "group_size": GROUP,
                "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
        Path(a.json).write_text(json.dumps({"meta": meta, "families": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
