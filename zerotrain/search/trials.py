"""Short measured `zerotrain train` runs, shared by `zerotrain compare` and `zerotrain tune`.

A trial is a fresh `torchrun -m zerotrain train --config RUN.yaml` in its own process group with a
timeout (a hang is killed as a whole group and recorded, never waited on). What it measured is read
back from files the run writes: metrics.jsonl (tokens/s, step time), and, because
$ZEROTRAIN_MODEL_STATE_DIR is set, every rank's model-state bytes (zerotrain/memory/measure.py
record_model_state) and its whole-run peak RSS (record_run_peak: loading, steps, checkpoint and
final saves).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.run_dir import RunDir
from ..launch.subprocess_run import run_with_timeout
from ..util import free_port


def train_cmd(nproc: int, run_yaml: Path, out: Path) -> list[str]:
    """The torchrun command line of one trial on this machine's ranks."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "zerotrain", "train",
            "--config", str(run_yaml), "--output", str(out)]


def last_error(text: str) -> str:
    """The most telling line of a failed run's output: zerotrain's own one-line error, else the last
    exception line that is not torchrun's wrapper (ChildFailedError), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("zerotrain ") and "error:" in ln:
            return ln[:300]
    for ln in reversed(lines):
        if ("Error" in ln or "Exception" in ln) and not ln.startswith("File ") \
                and "ChildFailedError" not in ln and "elastic" not in ln:
            return ln[:300]
    for ln in reversed(lines):  # a rank killed by a signal (the OOM killer) leaves torchrun's summary
        if "Signal" in ln or "signal" in ln or "exitcode" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def launch(cmd: list[str], env: dict, timeout: float, log: Path) -> tuple[int, str]:
    """Run in its own process group, output to `log`; kill the whole group on timeout. Returns (exit code,
    error line); exit code -9 means timed out."""
    res = run_with_timeout(cmd, timeout, env=env, log=log)
    if res.timed_out:
        return -9, f"timed out after {timeout:.0f}s (killed)"
    return res.returncode, "" if res.returncode == 0 else last_error(res.stdout)


def median(xs: list[float]) -> float:
    """The median of a non-empty list."""
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def step_metrics(out: Path, warmup: int = 1) -> dict[str, Any]:
    """final_loss, tokens_per_s, samples_per_s and step_time_s (medians over the steps after the first `warmup`,
    which pay for lazy init: Adam state, JIT, allocator growth; grpo's generation_s too), steps, and the step
    records' peak RSS (max)."""
    path = RunDir(out).metrics
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    steps = [r for r in recs if "loss" in r and "tokens_per_s" in r]
    if not steps:
        return {}
    timed = steps[warmup:] or steps[-1:]
    return {"final_loss": steps[-1]["loss"], "tokens_per_s": median([r["tokens_per_s"] for r in timed]),
            "samples_per_s": median([r.get("samples_per_s") or 0.0 for r in timed]),
            "step_time_s": median([r["step_time_s"] for r in timed]), "timed_steps": len(timed),
            **({"generation_s": median([r["generation_s"] for r in timed])} if "generation_s" in timed[-1] else {}),
            "peak_rss_bytes": max(int(r.get("peak_mem_bytes") or 0) for r in steps),
            **({"peak_gpu_mem_bytes": max(int(r.get("peak_gpu_mem_bytes") or 0) for r in steps)}
               if any("peak_gpu_mem_bytes" in r for r in steps) else {})}


def largest_model_state(state_dir: Path) -> Optional[dict]:
    """The largest rank's model-state record (the trainer writes one per rank)."""
    recs = [json.loads(p.read_text()) for p in sorted(state_dir.glob("model_state_rank*.json"))]
    return max(recs, key=lambda r: r["measured"]["total"]) if recs else None


def run_peak(state_dir: Path) -> Optional[int]:
    """The largest rank's whole-run peak RSS (record_run_peak), None when no rank finished."""
    peaks = [json.loads(p.read_text())["peak_rss_bytes"] for p in sorted(state_dir.glob("peak_rank*.json"))]
    return max(peaks) if peaks else None


@dataclass
class TrialResult:
    """What one trial run measured."""

    status: str
    """ok, failed or timeout."""
    error: str
    """The first telling error line of a failed or timed-out run, else ''."""
    seconds: float
    """Wall time of the whole launch (start-up included)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """step_metrics of the run (empty when it logged no step)."""
    model_state: Optional[dict] = None
    """largest_model_state of the run."""
    run_peak_rss: Optional[int] = None
    """Whole-run peak RSS of the largest rank (falls back to the step records' peak)."""


def run_trial(run_yaml: Path, out: Path, nproc: int, timeout: float, log: Path, warmup: int = 1,
              env_extra: Optional[dict[str, str]] = None) -> TrialResult:
    """Launch one `zerotrain train --config run_yaml` on nproc local ranks and read back what it measured."""
    from ..memory.measure import MODEL_STATE_ENV

    state_dir = RunDir(out).model_state
    out.mkdir(parents=True, exist_ok=True)
    for old in [*state_dir.glob("model_state_rank*.json"), *state_dir.glob("peak_rank*.json")]:
        old.unlink()
    env = dict(os.environ, **{MODEL_STATE_ENV: str(state_dir)}, **(env_extra or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    rc, err = launch(train_cmd(nproc, run_yaml, out), env, timeout, log)
    m = step_metrics(out, warmup)
    peak = run_peak(state_dir)
    return TrialResult(status={0: "ok", -9: "timeout"}.get(rc, "failed"), error=err,
                       seconds=time.perf_counter() - t0, metrics=m, model_state=largest_model_state(state_dir),
                       run_peak_rss=peak if peak is not None else m.get("peak_rss_bytes"))
