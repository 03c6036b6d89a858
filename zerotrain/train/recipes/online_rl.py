"""Online RL (grpo): completions sampled from the policy and scored by reward functions are the micro-batches
(zerotrain/train/grpo.py OnlineRL generates them at every cycle's start); the objective is the clipped
policy-gradient loss; a step reports the generation's reward and length figures and the loss's own; a few completions
are logged every rl.log_completions_every steps. No evaluation (refused at the data: held-out prompts are not built)."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from ..grpo import COMPLETIONS_FILE, OBJECTIVE_METRICS, OnlineRL, objective_figures
from .base import Batch, BatchSource, Objective, Recipe, iterate


class GenerationSource(BatchSource):
    """The rollouts: generated inside the fetch (minutes), so fetched after the step boundary, and a SIGTERM is acted
    on before the next generation; its loss counts no label tokens ahead (the objective's own)."""

    ahead = False

    def __init__(self, online: OnlineRL, grad_accum: int):
        self.online, self.grad_accum = online, grad_accum
        self.batches: Optional[Iterator[Batch]] = None

    def new_epoch(self) -> None:
        self.batches = None

    def next_step(self, epoch: int, position: int) -> list[Batch]:
        if self.batches is None:
            self.batches = self.online.batches(epoch, position)
        return iterate(self.batches, self.grad_accum)


class OnlineRLRecipe(Recipe):
    """grpo (GRPO, DAPO, Dr. GRPO, GSPO loss variants)."""

    def __init__(self, setup: Any, engine: Any):
        super().__init__(setup, engine)
        self.online: Optional[OnlineRL] = None
        self.source: BatchSource = GenerationSource(None, setup.plan.batch.grad_accum)  # type: ignore[arg-type]

    def make_objective(self) -> Objective:
        self.online = OnlineRL(self.s, self.engine)  # its reference and rewards: after the engine and any resume
        self.source.online = self.online
        return self.online.objective

    def rank_state(self) -> Optional[Callable[[], Any]]:
        """The generation batch in flight, when a cycle spans several steps (exact resume inside a cycle)."""
        return self.online.state if self.online.cycle.steps > 1 else None

    def restore_rank_state(self, saved: Any) -> None:
        self.online.saved_state = saved

    def step_figures(self, timer: Any, position: int) -> dict[str, Any]:
        """The generation's reward and length figures, and the loss's own."""
        timer.objective_finish = objective_figures
        return {"objective_figures": self.online.step_figures(position), "objective_names": OBJECTIVE_METRICS}

    def start_records(self, step: int) -> list[dict[str, Any]]:
        """How the rollouts generate (engine, rows per call, KV cache): one "rollouts" event record."""
        return [self.online.rollouts.record(step)]

    def after_step(self, writer: Any, step: int) -> None:
        """--log-completions-every: a few samples with their rewards."""
        writer.table("completions", self.online.completions_to_log(step), step, self.s.run_dir.root / COMPLETIONS_FILE)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        return {}
