"""Model states per rank on one model in every layout of 4 ranks (dp4, tp4, pp4, tp2 x pp2), measured vs estimated.

    .venv/bin/python benchmarks/model_states_grid.py --out /tmp/zt/grid \\
        --json benchmarks/results/model_states_grid.json           # ~15 min on 2 CPU cores
    .venv/bin/python benchmarks/model_states_grid.py --out /tmp/zt/grid --only tp2xpp2 \\
        --json benchmarks/results/model_states_grid.json           # one layout, merged into the raw file

Every layout is one `zerotrain compare` point (a real `zerotrain train` job on 4 local CPU ranks over gloo), so the
measurement is the product's own: each rank writes measure.py's count of the model-state bytes it holds (params,
grads, optimizer states, flat buffers, deduplicated by storage; zerotrain/memory/measure.py) after the first backward
of the last optimizer step (model_state_rank<R>.json), and the step time is the median of metrics.jsonl's step_time_s
over the steps after the first (search/trials.step_metrics). The estimate of each rank is zerotrain.memory.estimate
of the plan compare launched (the YAML it wrote): under pp the rank's own pipeline stage (Estimate.stages, the
stage from distributed/layout.WorldLayout.coordinate), else the one figure every rank shares.

The model: a Llama of hidden 256, 8 blocks, 8 query / 4 key-value heads, MLP 688, vocab 4096, untied head (about
8.5 M parameters: the blocks hold three quarters, so tp and pp both have something to split), fp32, micro-batch 2 x
128 tokens, grad-accum 4 (the pipeline's 4 micro-batches per step), --max-steps steps.
Writes the raw rows to --json (existing layouts not rerun are kept) and prints the table RESULTS.md quotes.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = dict(model_type="llama", num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, hidden_size=256,
             intermediate_size=688, max_position_embeddings=512, vocab_size=4096, tie_word_embeddings=False)
"""The one model every layout trains (a config.json: initialised from it, no weights)."""
NPROC = 4
COMMON = ["--nproc", str(NPROC), "--micro-batch", "2", "--seq-len", "128", "--grad-accum", "4", "--precision", "fp32"]

LAYOUTS: dict[str, dict] = {
    "dp4-fsdp": dict(backend="fsdp", stage=3, tp=1, pp=1),
    "dp4-deepspeed": dict(backend="deepspeed", stage=3, tp=1, pp=1),
    "tp4": dict(backend="fsdp", stage=3, tp=4, pp=1),
    "pp4": dict(backend="fsdp", stage=3, tp=1, pp=4),
    "tp2xpp2": dict(backend="fsdp", stage=3, tp=2, pp=2),
}
"""Each layout of the 4 ranks: backend, ZeRO stage, tp, pp (dp = 4 / (tp x pp))."""


def torch_version() -> str:
    import torch

    return torch.__version__


def rank_estimates(run_yaml: Path) -> tuple[list[int], dict]:
    """The estimated model-state bytes of each rank of the plan compare launched, and the plan's facts."""
    from zerotrain.config.load import build_config
    from zerotrain.memory.estimate import estimate
    from zerotrain.model.source import model_facts_for
    from zerotrain.plan.run_plan import build_plan

    cfg = build_config(run_yaml)
    plan = build_plan(cfg, NPROC, backend=cfg.backend, device="cpu", facts=model_facts_for(cfg))
    est = estimate(plan)
    world = plan.world
    per_rank = [est.stages[world.coordinate(r, "pp")][0] if est.stages else est.model_states for r in range(NPROC)]
    facts = {"num_params": plan.facts.num_params, "dp": world.dp, "tp": world.tp, "pp": world.pp,
             "grad_accum": plan.batch.grad_accum, "micro_batch": plan.batch.micro_batch,
             "by_category_worst": est.by_category(), "worst_stage": est.pp_stage}
    return per_rank, facts


def run_layout(out: Path, name: str, lay: dict, config: Path, steps: int) -> dict:
    cmp_dir = out / name
    cmd = [sys.executable, "-m", "zerotrain", "compare", "--model-config", str(config), *COMMON,
           "--backends", lay["backend"], "--stages", str(lay["stage"]), "--tp", str(lay["tp"]), "--pp", str(lay["pp"]),
           "--max-steps", str(steps), "--timeout", "1500", "--output", str(cmp_dir)]
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=False)
    with open(cmp_dir / "report.csv") as f:
        row = next(csv.DictReader(f))
    rec = {"layout": name, **lay, "dp": NPROC // (lay["tp"] * lay["pp"]), "status": row["status"],
           "error": row.get("error") or "", "wall_s": round(time.perf_counter() - t0, 1)}
    if row["status"] != "ok":
        return rec
    run_dir = Path(row["output"])
    from zerotrain.checkpoint.run_dir import RunDir

    state_dir = RunDir(run_dir).model_state
    measured = {}
    for p in sorted(state_dir.glob("model_state_rank*.json")):
        r = json.loads(p.read_text())
        measured[r["rank"]] = r["measured"]
    yaml = next(cmp_dir.glob("*.yaml"))
    estimated, facts = rank_estimates(yaml)
    ranks = []
    for r in range(NPROC):
        m = measured[r]
        cats = {k: m.get(k, 0) for k in ("params", "grads", "optimizer_states", "master", "buffers")}
        ranks.append({"rank": r, "measured": m["total"], "estimated": estimated[r],
                      "error_pct": round(100.0 * (m["total"] - estimated[r]) / estimated[r], 2),
                      "measured_by_category": cats})
    rec.update(ranks=ranks, step_time_s=float(row["step_time_s"]), tokens_per_s=float(row["tokens_per_s"]),
               final_loss=float(row["final_loss"]), **facts)
    return rec


def table(raw: dict) -> list[str]:
    """The rows RESULTS.md quotes (tests/unit/test_figures.py renders the same from the raw file)."""
    from tests.unit.test_figures import _model_states_grid

    return _model_states_grid(raw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--json", type=Path, default=None, help="raw rows (default OUT/model_states_grid.json)")
    a = p.parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        p.error(f"--only {bad[0]}: pick from {', '.join(LAYOUTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    config = a.out / "grid-llama" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(MODEL, indent=1))
    path = a.json or a.out / "model_states_grid.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    raw.update({"model": MODEL, "ranks": NPROC, "common": COMMON, "steps": a.steps,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {NPROC} ranks over gloo, torch "
                           f"{torch_version()}",
                "layouts": raw.get("layouts", {})})
    for name in names:
        rec = run_layout(a.out, name, LAYOUTS[name], config, a.steps)
        rec["date"] = time.strftime("%Y-%m-%d %H:%M")
        rec["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip()
        raw["layouts"][name] = rec
        raw["layouts"] = {k: raw["layouts"][k] for k in LAYOUTS if k in raw["layouts"]}  # report order
        path.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"{name}: {rec['status']} {rec.get('error') or ''}", flush=True)
    print("\n".join(table(raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
