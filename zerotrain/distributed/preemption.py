"""Preemption: SIGTERM (SLURM's preemption with --signal=B:TERM@N, `scancel`, torch's elastic agent stopping its
workers) stops the run at the next step boundary with a checkpoint, on every rank together.

The signal reaches the ranks at different moments, so the ranks agree at every step boundary: one all_gather
of "did this rank get SIGTERM" on a dedicated gloo group (CPU, also beside NCCL). It is the loop's one collective
between two steps: the next step's label-token count and the logged step's figures ride on it. A rank that got the
signal waits for it AGREE_TIMEOUT_S at most; the others wait as long as any collective (--dist-timeout), so a peer
that is only slow (rank 0 writing metrics) is no failure. If any rank got it, every rank saves at that same step and
the run exits with PREEMPTED_EXIT. If the exchange fails (a peer is gone: the elastic agent sends SIGTERM to the
survivors of a dead worker, then SIGKILL 30 s later) the rank exits at once without saving, instead of hanging: the
newest complete checkpoint stays `latest`.
"""
from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from .mesh import side_group

PREEMPTED_EXIT = 143
"""Exit code after a preemption checkpoint was committed (128 + SIGTERM, what the shell reports for a job ended
by SIGTERM): a scheduler requeues it and `--resume auto` continues it exactly."""
AGREE_TIMEOUT_S = 20.0
"""Seconds the step-boundary agreement waits for its peers: below the elastic agent's 30 s between its SIGTERM
and SIGKILL, so a rank whose peer died still exits by itself."""


class Preempted(Exception):
    """The run stopped at a step boundary because a rank got SIGTERM."""

    def __init__(self, step: int, saved: bool, why: str):
        super().__init__(why)
        self.step, self.saved = step, saved

    @property
    def exit_code(self) -> int:
        return PREEMPTED_EXIT if self.saved else 1


@dataclass
class Agreed:
    """What every rank learnt at one step boundary (StopSignal.agree)."""

    stopping: bool
    """Some rank got SIGTERM: every rank checkpoints at this step and exits."""
    still_writing: bool
    """Some rank is still writing its share of an asynchronous checkpoint."""
    write_failed: bool
    """Some rank's write of that checkpoint failed."""
    sums: list[float]
    """The `sums` passed, summed over the ranks."""
    rows: torch.Tensor
    """The `rows` passed, every rank's [ranks, len(rows)]."""


class StopSignal:
    """SIGTERM -> a flag; `agree()` at every step boundary tells every rank whether any rank got it (and whether
    any rank's asynchronous checkpoint write is still running, and whether any rank's failed:
    zerotrain/checkpoint/async_save.py).

    Build it on every rank at the same point (its gloo group is created collectively); `close()` puts the
    previous handler back."""

    def __init__(self, rank: int, timeout_s: float):
        import torch.distributed as tdist

        self.rank = rank
        self.received = False
        self._previous: Any = None
        self._group: Optional[Any] = None
        self._world = 1
        if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            self._group = side_group("zerotrain_step_boundary", timeout_s)
            self._world = tdist.get_world_size()
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            self._previous = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: Any) -> None:
        if not self.received:
            print(f"zerotrain: rank {self.rank} got SIGTERM: stopping at the next step boundary with a checkpoint",
                  file=sys.stderr, flush=True)
        self.received = True

    def agree(self, writing: bool = False, write_failed: bool = False, sums: Sequence[float] = (),
              rows: Sequence[float] = ()) -> Agreed:
        """Collective, at a step boundary: whether any rank got SIGTERM, whether any rank is still writing an
        asynchronous checkpoint, whether any rank's write of it failed (`writing` / `write_failed`: this one's).
        What else the loop needs from every rank rides on this one all_gather instead of a collective of its own:
        `sums` summed over the ranks (the next step's label tokens, Engine.local_label_tokens) and `rows` gathered
        (the logged step's figures, zerotrain/train/metrics.py StepFigures). Every rank passes as many values.
        Raises Preempted(saved=False) when this rank got the signal and a peer does not answer."""
        got_signal = self.received  # the handler may set it meanwhile: this wait's bound is chosen now
        local = torch.tensor([1.0 if got_signal else 0.0, 1.0 if writing else 0.0, 1.0 if write_failed else 0.0,
                              *sums, *rows], dtype=torch.float64)
        everyone = self._gather(local, got_signal)
        flags = everyone[:, :3].amax(0).tolist()
        return Agreed(bool(flags[0]), bool(flags[1]), bool(flags[2]), everyone[:, 3:3 + len(sums)].sum(0).tolist(),
                      everyone[:, 3 + len(sums):])

    def gather(self, row: Sequence[float]) -> torch.Tensor:
        """Every rank's `row` [ranks, len(row)] on the same group, between two boundaries (the figures of a step
        that is checkpointed or evaluated before its boundary: metrics.jsonl holds a step before its checkpoint)."""
        return self._gather(torch.tensor(list(row), dtype=torch.float64), self.received)

    def _gather(self, local: torch.Tensor, got_signal: bool) -> torch.Tensor:
        if self._group is None:
            return local.view(1, -1)
        import torch.distributed as tdist

        everyone = torch.empty(self._world * local.numel(), dtype=torch.float64)  # flat: gloo gathers 1-D tensors
        try:
            work = tdist.all_gather_into_tensor(everyone, local, group=self._group, async_op=True)
            work.wait(timeout=timedelta(seconds=AGREE_TIMEOUT_S)) if got_signal else work.wait()
        except Exception as e:  # noqa: BLE001 - a dead or stuck peer: leave without waiting any longer
            if not got_signal:
                raise
            raise Preempted(-1, False, f"SIGTERM on rank {self.rank} and a peer did not answer within "
                                       f"{AGREE_TIMEOUT_S:.0f} s ({type(e).__name__}); exiting without a checkpoint "
                                       "(the newest complete one stays `latest`)") from e
        return everyone.view(self._world, -1)

    def close(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        self._group = None
