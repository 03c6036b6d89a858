"""dp=2 vs tp=2 vs pp=2 side by side in one run, and the pipeline bubble measured against its formula.

    .venv/bin/python benchmarks/parallel_layouts.py --out /tmp/layouts      # ~10 min on 2 CPU cores

Everything goes through `zerotrain compare` (the product's own side-by-side runner: one real
`zerotrain train` job per point, per-rank model-state bytes measured on the engine at the last step,
step_time_s = median of metrics.jsonl over the steps after the first):
  1. layouts: --tp 1,2 x --pp 1,2 on 2 ranks (the tp=2 x pp=2 point needs 4 ranks and is reported
     as refused), on each backend at the stage it runs tp/pp with (FSDP 3, DeepSpeed 1);
  2. bubble: pp=2 at grad-accum (= pipeline micro-batches) m = 2 and 8, same micro-batch. With a
     per-micro-batch stage time t, GPipe takes T(m) = (m + p - 1) t, so t = (T(8) - T(2)) / 6 and the
     measured bubble at m is 1 - m t / T(m), against the formula (p - 1) / (m + p - 1).
Writes OUT/layouts.md (the tables) next to the compare output dirs, and the raw rows (every compare report.csv
row and the bubble step times) to --json (default OUT/layouts.json; benchmarks/results/parallel_layouts.json is the
committed run).
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import time
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "small-llama"
COMMON = ["--tiny-preset", MODEL, "--nproc", "2", "--micro-batch", "4", "--seq-len", "128", "--precision", "fp32"]
STAGE_FOR = {"fsdp": "3", "deepspeed": "1"}
"""The stage each backend runs both tp and pp with (plan/capabilities.STAGES)."""


def compare(out: Path, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "zerotrain", "compare", *COMMON, *args, "--output", str(out)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False)
    with open(out / "report.csv") as f:
        return list(csv.DictReader(f))


def num(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def fmt(v: str, spec: str) -> str:
    x = num(v)
    return "-" if x is None else format(x, spec)


def mib(v: str) -> str:
    x = num(v)
    return "-" if x is None else f"{x / 2**20:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backends", default="fsdp,deepspeed")
    p.add_argument("--json", type=Path, default=None, help="raw rows (default OUT/layouts.json)")
    a = p.parse_args()
    raw: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": MODEL, "common": COMMON, "steps": a.steps,
                 "layouts": {}, "bubble": {}}
    a.out.mkdir(parents=True, exist_ok=True)
    lines = [f"Model {MODEL}, 2 CPU ranks over gloo, fp32, micro-batch 4 x 128 tokens, {a.steps} steps per run.", ""]
    lines += ["| backend | stage | tp | pp | grad-accum | step time (s) | tokens/s | model state / rank (MiB) measured "
              "| predicted | error % | final loss | status |", "|" + "---|" * 12]
    for backend in a.backends.split(","):
        rows = compare(a.out / f"layouts-{backend}", "--backends", backend, "--stages", STAGE_FOR[backend],
                       "--tp", "1,2", "--pp", "1,2", "--grad-accum", "4", "--max-steps", str(a.steps))
        raw["layouts"][backend] = rows
        for r in rows:
            lines.append(f"| {backend} | {r['stage']} | {r['tp']} | {r['pp']} | 4 | {fmt(r['step_time_s'], '.3f')} | "
                         f"{fmt(r['tokens_per_s'], ',.0f')} | {mib(r['model_state_bytes_measured'])} | "
                         f"{mib(r['model_state_bytes_predicted'])} | {r['model_state_error_pct'] or '-'} | "
                         f"{fmt(r['final_loss'], '.4f')} | {r.get('error') or r['status']} |")
    lines += ["", "Pipeline bubble, pp=2 (p = 2), step time T(m) at m pipeline micro-batches:", "",
              "| backend | T(2) s | T(8) s | t per micro-batch s | bubble m=2 measured | formula | "
              "bubble m=8 measured | formula |", "|" + "---|" * 8]
    for backend in a.backends.split(","):
        times = {}
        for m in (2, 8):
            rows = compare(a.out / f"bubble-{backend}-m{m}", "--backends", backend, "--stages", STAGE_FOR[backend],
                           "--pp", "2", "--grad-accum", str(m), "--max-steps", str(a.steps))
            times[m] = num(rows[0]["step_time_s"]) if rows else None
            raw["bubble"][f"{backend}-m{m}"] = rows
        if None in times.values():
            lines.append(f"| {backend} | run failed: see {a.out}/bubble-{backend}-m*/ |" + " |" * 6)
            continue
        t = (times[8] - times[2]) / 6
        measured = {m: 1 - m * t / times[m] for m in (2, 8)}
        lines.append(f"| {backend} | {times[2]:.3f} | {times[8]:.3f} | {t:.4f} | {measured[2]:.3f} | {1 / 3:.3f} | "
                     f"{measured[8]:.3f} | {1 / 9:.3f} |")
    (a.out / "layouts.md").write_text("\n".join(lines) + "\n")
    (a.json or a.out / "layouts.json").write_text(json.dumps(raw, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
