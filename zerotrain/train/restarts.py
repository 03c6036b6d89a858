"""What a resumed run records about the run it continues: a restart of an elastic worker group
(zerotrain launch --elastic) or a person's --resume.

The banner prints it and metrics.jsonl holds it as one `"event": "resume"` record (at the resumed step, so a
later resume's trim keeps it): which elastic restart this is (torchrun's TORCHELASTIC_RESTART_COUNT), the
world size before and after, the step resumed from, and how many optimizer steps the previous attempt had
logged past that checkpoint (they run again: recomputed).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional


def elastic_restart() -> int:
    """Which restart of the worker group this process belongs to (0: the first attempt, or not elastic)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def last_logged_step(metrics: Path) -> Optional[int]:
    """The newest optimizer step a training record of metrics.jsonl holds (None: none)."""
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
        if "loss" in rec and "step" in rec:
            last = max(int(rec["step"]), last or 0)
    return last


@dataclass(frozen=True)
class Resumption:
    """One resume of a run, as the banner and metrics.jsonl record it."""

    restart: int
    """The elastic restart count (0: the first attempt of this launch, e.g. a person's --resume)."""
    world_before: int
    """Ranks that wrote the checkpoint."""
    world_after: int
    """Ranks of this run."""
    resumed_from_step: int
    steps_recomputed: int
    """Optimizer steps the previous attempt had done past the checkpoint (logged in metrics.jsonl), run again."""
    global_batch: int
    grad_accum: int
    """This run's grad-accum (recomputed on another world size so the global batch stays)."""
    checkpoint: str

    def record(self) -> dict[str, Any]:
        return {"event": "resume", "step": self.resumed_from_step, "time": round(time.time(), 3), **asdict(self)}

    def line(self) -> str:
        world = (f"world {self.world_before} -> {self.world_after} ranks, global batch {self.global_batch} kept "
                 f"(grad-accum {self.grad_accum})" if self.world_before != self.world_after
                 else f"world {self.world_after} ranks")
        restart = f"elastic restart {self.restart}: " if self.restart else ""
        return (f"zerotrain: {restart}resumed from step {self.resumed_from_step} ({self.checkpoint}); {world}; "
                f"{self.steps_recomputed} step(s) after that checkpoint recomputed")


def resumption(checkpoint: Path, world_before: int, world_after: int, step: int, global_batch: int, grad_accum: int,
               metrics: Path) -> Resumption:
    last = last_logged_step(metrics)
    return Resumption(restart=elastic_restart(), world_before=world_before, world_after=world_after,
                      resumed_from_step=step, steps_recomputed=max(0, (last or step) - step),
                      global_batch=global_batch, grad_accum=grad_accum, checkpoint=str(checkpoint))
