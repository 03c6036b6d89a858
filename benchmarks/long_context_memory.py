"""Long context: measured peak memory per rank next to the estimate, at one long sequence, for sp=1 and sp=2 with
each memory reducer off and on (issue #32).

    .venv/bin/python benchmarks/long_context_memory.py [--seq-len 16384] [--out benchmarks/results/long_context_memory.json]

Each reducer setting is one `zerotrain compare --sp 1,2` (so the figures come from the product's own measure and
estimate: peak RSS = the whole run's VmHWM, largest rank; predicted = Estimate.run_peak_rss of the same plan;
model states measured vs predicted as well). The model is benchmarks/long_context.py's Llama (hidden 256, 4
layers, 8 heads / 4 kv heads, vocab 32000, 65536 positions), fp32, DeepSpeed ZeRO-3, micro-batch 1, 2 steps,
2 CPU ranks; the data its long-line corpus. Writes the raw rows (JSON) and a markdown table beside it.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

VARIANTS = {"none": [], "tiled-mlp": ["--tiled-mlp"], "chunked-loss": ["--chunked-loss"],
            "both": ["--tiled-mlp", "--chunked-loss"]}
"""Reducer settings measured (the flags' bare value: 2048-token tiles and chunks)."""


def main() -> int:
    import long_context as lc

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--workdir", default="/tmp/zt_long_context")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/long_context_memory.json"))
    p.add_argument("--only", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per compared run")
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = lc.build_model(work, max(65536, a.seq_len))
    data = lc.data_file(work, 4 * a.seq_len, lc.corpus_tokens(model))
    env = {**lc.env(), "ZEROTRAIN_CACHE": str(work / "cache")}
    rows = []
    for name in a.only.split(","):
        out = work / f"memory_{name}"
        cmd = [sys.executable, "-m", "zerotrain", "compare", "--backends", "deepspeed", "--stages", "3", "--sp", "1,2",
               "--model", str(model), "--data", str(data), "--seq-len", str(a.seq_len), "--micro-batch", "1",
               "--grad-accum", "1", "--max-steps", "2", "--nproc", "2", "--timeout", str(a.timeout),
               "--output", str(out), *VARIANTS[name]]
        t0 = time.time()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        print(f"{name}: rc {res.returncode} in {time.time() - t0:.0f} s", file=sys.stderr)
        for r in csv.DictReader((out / "report.csv").open()):
            rows.append({"reducers": name, "sp": int(r["sp"]), "status": r["status"], "error": r["error"],
                         **{k: int(r[k]) if r[k] else None for k in ("peak_rss_bytes", "peak_rss_predicted",
                                                                     "model_state_bytes_measured",
                                                                     "model_state_bytes_predicted")},
                         "step_time_s": float(r["step_time_s"]) if r["step_time_s"] else None})
    meta = {"seq_len": a.seq_len, "model": "llama h256 x 4 layers, 8/4 heads, ffn 688, vocab 32000", "ranks": 2,
            "backend": "deepspeed z3", "precision": "fp32", "micro_batch": 1, "steps": 2,
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(a.out).with_suffix(".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


def markdown(meta: dict, rows: list[dict]) -> str:
    gib = 2**30
    lines = [f"# Peak memory per rank at {meta['seq_len']} tokens: measured vs estimated", "",
             f"{meta['ranks']} CPU ranks, {meta['model']}, {meta['backend']}, {meta['precision']}, micro-batch "
             f"{meta['micro_batch']}, {meta['steps']} steps; `zerotrain compare --sp 1,2` per reducer setting "
             f"({meta['date']}). Peak RSS: the whole run's VmHWM, largest rank; predicted: `zerotrain estimate` "
             "(Estimate.run_peak_rss).", "",
             "| sp | reducers | status | peak RSS measured (GiB) | predicted (GiB) | error | step time (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["sp"], list(VARIANTS).index(r["reducers"]))):
        m, p = r["peak_rss_bytes"], r["peak_rss_predicted"]
        err = f"{100 * (m - p) / p:+.1f}%" if m and p else "-"
        step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.1f}"
        lines.append(f"| {r['sp']} | {r['reducers']} | {r['status']} | {m / gib:.2f} | {p / gib:.2f} | {err} | {step} |"
                     if m and p else f"| {r['sp']} | {r['reducers']} | {r['status']} | - | - | - | - |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
