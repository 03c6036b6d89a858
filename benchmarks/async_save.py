"""How long training stands still per checkpoint save: synchronous vs --async-save, side by side.

    .venv/bin/python benchmarks/async_save.py --rounds 2 --out benchmarks/results/async_save

A ~58 M parameter Llama (hidden 512, 8 layers, vocab 32000, untied head; from a config, fp32), 2 CPU ranks under
torchrun, `zerotrain train --max-steps 12 --save-every 3` (3 saves in the loop; the final one is not counted),
once per (backend, mode) per round, modes alternating and their order flipped every round. Per run, from
metrics.jsonl: the median `stall_s` of its `"event": "checkpoint"` records (rank 0's wall time inside save(): with
--async-save the copy to host memory and the hand-off), the median `write_s` of its `checkpoint_committed` records
(save to `latest`), and the median step time over every step. Across rounds: median of the per-run medians; the
ratio is sync / async per round, then its median [min-max]. Each mode's losses are compared step by step too (the
async copy must not change training).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from launching import free_port, launch, trial_env  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
          "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
          "vocab_size": 32000, "max_position_embeddings": 512, "tie_word_embeddings": False,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
BACKENDS = {"deepspeed": ["--backend", "deepspeed", "--stage", "2"], "fsdp": ["--backend", "fsdp", "--stage", "3"]}


def run_one(work: Path, backend: str, mode: str, tag: str) -> dict:
    out = work / f"{backend}_{mode}_{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "zerotrain", "train", "--model-config", str(work / "config.json"),
           "--seq-len", "128", "--pack", "--micro-batch", "2", "--max-steps", "12", "--save-every", "3",
           "--keep-last", "2", "--no-save-final", "--output", str(out), *BACKENDS[backend],
           *(["--async-save"] if mode == "async" else [])]
    res = launch(cmd, work / f"{out.name}.log", 1200, trial_env(REPO), REPO)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if "loss" in r]
    saves = [r["stall_s"] for r in rows if r.get("event") == "checkpoint"]
    commits = [r["write_s"] for r in rows if r.get("event") == "checkpoint_committed"]
    return {"backend": backend, "mode": mode, "exit": res.get("rc"), "stall_s": saves, "write_s": commits,
            "step_time_s": [r["step_time_s"] for r in steps], "losses": [r["loss"] for r in steps],
            "ckpt_bytes": sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file())
            if (out / "checkpoints").is_dir() else 0}


def summarize(runs: list[dict], backend: str) -> dict:
    def med(mode: str, key: str) -> list[float]:
        return [statistics.median(r[key]) for r in runs if r["backend"] == backend and r["mode"] == mode and r[key]]

    sync, asyn = med("sync", "stall_s"), med("async", "stall_s")
    ratios = [s / a for s, a in zip(sync, asyn) if a > 0]
    losses = {m: [r["losses"] for r in runs if r["backend"] == backend and r["mode"] == m] for m in ("sync", "async")}
    worst = max((abs(a - b) / abs(b) for la, lb in zip(losses["async"], losses["sync"]) for a, b in zip(la, lb)),
                default=None)
    return {"backend": backend, "stall_sync_s": statistics.median(sync) if sync else None,
            "stall_async_s": statistics.median(asyn) if asyn else None,
            "stall_ratio_sync_over_async": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "write_async_s": statistics.median(med("async", "write_s")) if med("async", "write_s") else None,
            "step_sync_s": statistics.median(med("sync", "step_time_s")) if med("sync", "step_time_s") else None,
            "step_async_s": statistics.median(med("async", "step_time_s")) if med("async", "step_time_s") else None,
            "checkpoint_mib": max((r["ckpt_bytes"] for r in runs if r["backend"] == backend), default=0) / 2**20 / 2,
            "loss_max_rel_diff_async_vs_sync": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backends", default="deepspeed,fsdp")
    p.add_argument("--out", default=str(HERE / "results" / "async_save"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zt-async-save-"))
    (work / "config.json").write_text(json.dumps(CONFIG))
    runs = []
    for backend in args.backends.split(","):
        run_one(work, backend, "sync", "warmup")  # JIT builds and page cache, untimed
        for rnd in range(args.rounds):
            for mode in (("sync", "async") if rnd % 2 == 0 else ("async", "sync")):
                t0 = time.monotonic()
                runs.append({**run_one(work, backend, mode, str(rnd)), "round": rnd,
                             "wall_s": round(time.monotonic() - t0, 1)})
                print(json.dumps({k: runs[-1][k] for k in ("backend", "mode", "round", "exit", "stall_s", "wall_s")}),
                      flush=True)
    summary = [summarize(runs, b) for b in args.backends.split(",")]
    import platform

    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{__import__('os').cpu_count()} cores, torch {torch.__version__}", "model": CONFIG,
              "summary": summary, "runs": runs}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| backend | stall per save, sync | stall per save, --async-save | sync / async [range] | async save to "
             "`latest` | step time sync / async | one checkpoint (both ranks) | losses async vs sync |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        def f(x, unit="s"):
            return "n/a" if x is None else f"{x:.3f} {unit}"
        rng = s["ratio_range"]
        lines.append(f"| {s['backend']} | {f(s['stall_sync_s'])} | {f(s['stall_async_s'])} | "
                     f"{s['stall_ratio_sync_over_async'] or 0:.1f}x [{rng[0]:.1f}-{rng[1]:.1f}] | "
                     f"{f(s['write_async_s'])} | {f(s['step_sync_s'])} / {f(s['step_async_s'])} | "
                     f"{s['checkpoint_mib']:.0f} MiB | max rel diff {s['loss_max_rel_diff_async_vs_sync']:.1e} |"
                     if rng else f"| {s['backend']} | failed | | | | | | |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
