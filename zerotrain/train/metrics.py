"""Run metrics: per-step figures reduced over ranks, metrics.jsonl (+ TensorBoard), a progress bar.

Every function that reduces is called on every rank (it is a collective); only rank 0 writes.
Memory is peak resident set size (VmHWM from /proc/self/status), max over ranks: on CPU that is
what a job scheduler kills you for. (tracemalloc does not see torch tensors.)
A metrics.jsonl write that fails (a full disk) is one warning line, once, and the run goes on: losing metrics is
not worth losing the training; records are tried again at every write, so the file has a gap, not an end.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..checkpoint.run_dir import RunDir
from ..distributed.collectives import is_distributed
from ..errors import os_error_line
from ..util import peak_rss_bytes


def peak_gpu_bytes(device: str) -> int:
    """Peak memory torch allocated on this rank's GPU on a cuda run (RunPlan.device), else 0."""
    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else 0


class StepFigures:
    """One step's figures: this rank's row, then every rank's rows (gathered by the trainer's step-boundary
    exchange, zerotrain/distributed/preemption.py StopSignal.agree, which the next step waits for anyway: no
    collective of their own), then the global figures (`result`).
    """

    def __init__(self, to_sum: list[float], to_max: list[float], dp_size: int,
                 router: Optional[tuple[float, float, torch.Tensor]] = None,
                 pair_sums: Optional[dict[str, float]] = None, *, device: str,
                 finish: Optional[Callable[[dict[str, float]], dict[str, float]]] = None,
                 sums: Optional[dict[str, float]] = None):
        """device: the run's (RunPlan.device; a cuda run reports its GPU peak). router: this rank's (router aux
        loss sum, micro-batches it counts, expert counts [blocks, experts]), summed over ranks like the loss (a
        mixture-of-experts run; zerotrain/model/router.py). pair_sums: a preference task's figures summed over
        this rank's pairs, with their count under "pairs"; each is reported as its mean over every pair of the
        step (zerotrain/train/preference.py METRICS). finish: turns the objective's global figures into its metrics
        instead (online RL: zerotrain/train/grpo.py objective_figures); a figure named *_min / *_max is reduced by
        min / max over micro-batches and ranks, the others by sum. sums: figures summed over ranks and reported
        as they are (a mixture's tokens and rows per source)."""
        self.dp_size = dp_size
        self.device = device
        self.counts_shape = tuple(router[2].shape) if router is not None else None
        if router is not None:
            to_sum = to_sum + [router[0], router[1]] + router[2].reshape(-1).tolist()
        self.finish = finish
        self.pair_names = list(pair_sums or {})
        self.pair_at = len(to_sum)
        to_sum = to_sum + [pair_sums[k] for k in self.pair_names]
        self.sum_names = list(sums or {})
        self.sums_at = len(to_sum)
        to_sum = to_sum + [sums[k] for k in self.sum_names]
        self.n_sum = len(to_sum)
        self.local = to_sum + to_max
        """This rank's row (every rank's has the same length and order)."""
        self.rows: Optional[torch.Tensor] = None if is_distributed() else torch.tensor([self.local], dtype=torch.float64)
        """Every rank's row [ranks, len(local)], once gathered (`take`)."""

    def take(self, rows: torch.Tensor) -> None:
        """Every rank's row, as the step-boundary exchange gathered them ([ranks, len(local)])."""
        self.rows = rows.to(torch.float64).reshape(-1, len(self.local))

    def result(self) -> dict[str, float]:
        """Global figures (after `take`): mean loss over replicas, summed tokens/samples, max time/memory."""
        if self.rows is None:
            raise RuntimeError("StepFigures.result before the ranks' rows were gathered (take)")
        rows = self.rows  # one row per rank
        sums = rows[:, :self.n_sum].sum(0)
        (loss, tokens, samples) = sums[:3].tolist()
        (step_time, peak, gpu_peak) = rows[:, self.n_sum:].amax(0).tolist()
        out = {"loss": loss / self.dp_size, "tokens": tokens, "samples": samples, "step_time_s": step_time,
               "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
               "samples_per_s": samples / step_time if step_time > 0 else 0.0, "peak_mem_bytes": int(peak),
               "peak_gpu_mem_bytes": int(gpu_peak)}
        if self.counts_shape is not None:
            from ..model.router import load_figures

            aux_sum, micro = sums[3:5].tolist()
            if micro > 0:
                out["router_aux_loss"] = aux_sum / micro
            out.update(load_figures(sums[5:self.pair_at].view(self.counts_shape)))
        if self.sum_names:
            out.update(zip(self.sum_names, sums[self.sums_at:self.n_sum].tolist()))
        if self.pair_names:
            part = rows[:, self.pair_at:self.sums_at]
            totals = {k: float(part[:, i].amin() if k.endswith("_min") else part[:, i].amax() if k.endswith("_max")
                               else part[:, i].sum()) for i, k in enumerate(self.pair_names)}
            if self.finish is not None:
                out.update(self.finish(totals))
            else:
                pairs = max(totals.pop("pairs"), 1.0)
                out.update({k: v / pairs for k, v in totals.items()})
        return out


def _local(name: str, values: list[float], share: float) -> float:
    """A figure over this rank's micro-batches: *_min / *_max by min / max (a rank that does not count gives the
    neutral value), the others summed."""
    if name.endswith("_min"):
        return min(values) if share else math.inf
    if name.endswith("_max"):
        return max(values) if share else -math.inf
    return share * sum(values)


class StepTimer:
    """Accumulates one optimizer step's local figures (loss per micro-batch, tokens, samples, time)."""

    def __init__(self, device: str, started: Optional[float] = None) -> None:
        self.device = device
        """The run's device (RunPlan.device): a cuda run also reports its peak GPU memory."""
        self.start = time.perf_counter() if started is None else started
        """perf_counter() when the step began: when its micro-batches began to be fetched (the trainer's)."""
        self.losses: list[float | torch.Tensor] = []
        self.tokens = 0
        self.samples = 0
        self.router_aux: list[torch.Tensor] = []
        """Each micro-batch's router load-balancing loss (unweighted; a mixture of experts with the loss on)."""
        self.expert_counts: Optional[torch.Tensor] = None
        """Tokens this rank routed to each expert of each MoE block in the step ([blocks, experts])."""
        self.pair_sums: list[dict[str, torch.Tensor]] = []
        """A preference task's per-micro-batch figures, summed over its pairs (train_step's StepLosses.objective_sums); online RL's
        (grpo.GRPOObjective), with *_min / *_max figures reduced by min / max."""
        self.objective_finish: Optional[Callable[[dict[str, float]], dict[str, float]]] = None
        """The objective's own way from global figures to metrics (StepFigures finish); None: means over pairs."""
        self.sums: dict[str, float] = {}
        """Figures of this rank's step summed over ranks as they are (a mixture's per-source tokens and rows)."""

    def add(self, loss: float | torch.Tensor, tokens: int, samples: int) -> None:
        """loss may be a (detached) device tensor: it is read once per step, not once per micro-batch."""
        self.losses.append(loss)
        self.tokens += tokens
        self.samples += samples

    def figures(self, dp_size: int, counts: bool = True) -> StepFigures:
        """The step's figures on this rank (reads the loss: one device sync; no collective).

        dp_size: data-parallel replicas (the loss is their mean). counts: whether this rank's loss,
        tokens and samples count for its replica (distributed/layout.WorldLayout.counts_for_data: tensor- and
        pipeline-parallel ranks of one replica see the same batch; one of them counts it)."""
        # float64: a bf16 loss tensor summed in bf16 would round (seq-cls heads do not upcast).
        total = sum(x.double() if isinstance(x, torch.Tensor) else x for x in self.losses)
        local_loss = float(total) / max(len(self.losses), 1)  # one device sync per step
        elapsed = time.perf_counter() - self.start  # after that sync: the device's work is done too
        share = 1.0 if counts else 0.0
        router = None
        if self.expert_counts is not None:  # already zero on ranks that repeat another's tokens (the trainer's)
            aux = float(sum(a.double() for a in self.router_aux)) if self.router_aux else 0.0
            router = (share * aux, share * len(self.router_aux), self.expert_counts)
        pair_sums = None
        if self.pair_sums:
            pair_sums = {k: _local(k, [float(s[k]) for s in self.pair_sums], share) for k in self.pair_sums[0]}
        return StepFigures([share * local_loss, share * self.tokens, share * self.samples],
                           [elapsed, float(peak_rss_bytes()), float(peak_gpu_bytes(self.device))], dp_size, router,
                           pair_sums, device=self.device, finish=self.objective_finish,
                           sums={k: share * v for k, v in self.sums.items()})



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
    """metrics.jsonl (one JSON object per line) and the experiment trackers (zerotrain/train/trackers.py); rank 0 only."""

    def __init__(self, run_dir: RunDir, main: bool, trackers: list[str], resume_step: Optional[int],
                 params: Optional[dict[str, str]] = None):
        from .trackers import Trackers

        self.main = main
        self.path = run_dir.metrics
        self.trackers: Optional[Trackers] = None
        if not main:
            return
        self._warned = False
        """A write failed and was warned about (once per run)."""
        self._guarded(lambda: self.path.write_text("") if resume_step is None else trim_jsonl(self.path, resume_step))
        if trackers:
            self.trackers = Trackers(trackers, run_dir, resume_step)
            self.trackers.start(params or {})

    def _guarded(self, write) -> None:
        try:
            write()
        except OSError as e:  # the machine's fault: warn once, keep training (module docstring)
            if not self._warned:
                self._warned = True
                print("zerotrain train: warning: " + os_error_line(
                    e, 0, f"writing {self.path}", kept="training and checkpoints go on; records that cannot be "
                    "written meanwhile are missing from metrics.jsonl (warned once)"), file=sys.stderr, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.main:
            return

        def append() -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

        self._guarded(append)
        if self.trackers is not None:
            self.trackers.log(record)

    def table(self, name: str, rows: list[dict[str, Any]], step: int, path: Path) -> None:
        """Rows of one table at a step (online RL's sampled completions): appended to `path` as JSON lines and
        logged to the trackers that keep tables (W&B)."""
        if not self.main or not rows:
            return

        def append() -> None:
            with open(path, "a") as f:
                f.writelines(json.dumps({"step": step, **r}, default=str) + "\n" for r in rows)

        self._guarded(append)
        if self.trackers is not None:
            self.trackers.table(name, rows, step)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


class Progress:
    """tqdm bar on rank 0: steps with loss, lr, tokens/s and ETA."""

    def __init__(self, total: int, initial: int, main: bool):
        self._bar = None
        if main:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=0.5)

    def update(self, loss: Optional[float] = None, lr: float = 0.0, tokens_per_s: float = 0.0,
               reward: Optional[float] = None) -> None:
        """One step done; its figures when it was logged (loss None: a step --log-every skips keeps the last
        figures shown). reward: online RL's mean reward of the step's generation batch (shown when it generated)."""
        if self._bar is not None:
            if loss is not None:
                extra = {"reward": f"{reward:.3f}"} if reward is not None else {}
                self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", **extra,
                                      refresh=False)
            self._bar.update(1)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
