"""Run metrics: per-step figures reduced over ranks, metrics.jsonl (+ TensorBoard), a progress bar.

Every function that reduces is called on every rank (it is a collective); only rank 0 writes.
Memory is peak resident set size (VmHWM from /proc/self/status), max over ranks: on CPU that is
what a job scheduler kills you for. (tracemalloc does not see torch tensors.)
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reduce(values: list[float], op: str) -> list[float]:
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM if op == "sum" else tdist.ReduceOp.MAX)
    return t.tolist()


def reduce_sum(*values: float) -> list[float]:
    """Sum over ranks (collective)."""
    return _reduce(list(values), "sum")


def reduce_max(*values: float) -> list[float]:
    """Max over ranks (collective)."""
    return _reduce(list(values), "max")


def _gather_sum_max(to_sum: list[float], to_max: list[float]) -> tuple[list[float], list[float]]:
    """Sum of the first list and max of the second over ranks, with ONE all_gather (collective)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return list(to_sum), list(to_max)
    local = torch.tensor(to_sum + to_max, dtype=torch.float64)
    rows = torch.empty(tdist.get_world_size() * local.numel(), dtype=torch.float64)  # gloo wants it flat
    tdist.all_gather_into_tensor(rows, local)
    rows, n = rows.view(-1, local.numel()), len(to_sum)
    return rows[:, :n].sum(0).tolist(), rows[:, n:].amax(0).tolist()


class StepTimer:
    """Accumulates one optimizer step's local figures (loss per micro-batch, tokens, samples, time)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.losses: list[float] = []
        self.tokens = 0
        self.samples = 0

    def add(self, loss: float, tokens: int, samples: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        self.samples += samples

    def reduce(self, world: int) -> dict[str, float]:
        """Global figures for the step (collective): mean loss over ranks, summed tokens/samples."""
        elapsed = time.perf_counter() - self.start
        local_loss = sum(self.losses) / max(len(self.losses), 1)
        # One collective per step, not two (sum + max): profiled as zerotrain's largest per-step cost.
        (loss, tokens, samples), (step_time, peak) = _gather_sum_max(
            [local_loss, float(self.tokens), float(self.samples)], [elapsed, float(peak_rss_bytes())])
        return {"loss": loss / world, "tokens": tokens, "samples": samples, "step_time_s": step_time,
                "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
                "samples_per_s": samples / step_time if step_time > 0 else 0.0, "peak_mem_bytes": int(peak)}


def trim_jsonl(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (written after the checkpoint we resume from), keep the rest."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if int(rec.get("step", 0)) <= last_step:
            kept.append(line)
    path.write_text("".join(k + "\n" for k in kept))


class MetricsWriter:
    """metrics.jsonl (one JSON object per line) and optional TensorBoard events; rank 0 only."""

    def __init__(self, output: Path, main: bool, tensorboard: bool, resume_step: Optional[int]):
        self.main = main
        self.path = output / "metrics.jsonl"
        self._tb = None
        if not main:
            return
        if resume_step is None:
            self.path.write_text("")
        else:
            trim_jsonl(self.path, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output / "tensorboard"), purge_step=resume_step)

    def write(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = int(record["step"])
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self._tb.add_scalar(("eval/" if k.startswith("eval_") else "train/") + k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class Progress:
    """tqdm bar on rank 0: steps with loss, lr, tokens/s and ETA."""

    def __init__(self, total: int, initial: int, main: bool):
        self._bar = None
        if main:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=0.5)

    def update(self, loss: float, lr: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.update(1)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
