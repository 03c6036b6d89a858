"""The recipe interface: what one training kind gives the loop (zerotrain/train/trainer.py), and nothing else.

    recipe = build_recipe(setup, engine)     # the class the task names (tasks.TaskSpec.recipe), imported lazily
    micro = recipe.source.next_step(epoch, position)
    recipe.evaluate(trainer); recipe.step_figures(timer, position); recipe.client_state(); recipe.close()

A recipe is a micro-batch source (map-style, a stream or generation: BatchSource), an objective (what the engine
runs per micro-batch: begin_step / __call__ / finish; None: the model's own loss), its evaluation, the figures a
logged step adds, the state it puts in a checkpoint and restores, and its teardown. The trainer calls these and
branches on no kind; adding a kind is one recipe module and one registry entry (docs/architecture.md).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

Batch = dict[str, torch.Tensor]


@dataclass
class ObjectiveOutput:
    """One micro-batch through an objective: what Engine.train_step backpropagates and what a step reports."""

    loss: torch.Tensor
    """What is backpropagated (+ router_aux_coef x a mixture of experts' router loss where the objective adds it)."""
    sums: dict[str, torch.Tensor]
    """The micro-batch's figures summed over its rows (StepFigures reduces them over micro-batches and ranks)."""
    aux_loss: Optional[torch.Tensor] = None
    """A mixture of experts' router load-balancing loss of the forward (detached; None: none)."""
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each row's (pair's) figures, detached, where an evaluation averages them (preference pairs); else empty."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:  # read like a transformers ModelOutput (Engine.train_step)
        return getattr(self, key)


class Objective(Protocol):
    """What Engine.train_step runs (Recipe.objective): the step's global counts, then each micro-batch's loss."""

    def begin_step(self, engine: Any, micro_batches: list[Batch]) -> None:
        """Before the step's first micro-batch (collectives the loss divides by, reference log-probs)."""

    def __call__(self, engine: Any, batch: Batch) -> ObjectiveOutput:
        """One micro-batch's loss and figures."""

    def close(self, engine: Any) -> None:
        """Release what it holds (a reference model) before the export gathers the policy."""


class BatchSource(ABC):
    """Where a step's micro-batches come from."""

    ahead: bool = True
    """The next step's batches are fetched before the step boundary, so their label tokens ride on its exchange;
    False: fetched after it (generation takes minutes: a SIGTERM is acted on before it)."""

    def check_resume(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint's client_state whose data position this source cannot continue (UserError)."""

    def start(self, state: dict[str, Any], epoch: int) -> int:
        """Restore from a checkpoint's client_state ({} for a fresh run); returns the epoch to start in."""
        return epoch

    def new_epoch(self) -> None:
        """The epoch ended: the next fetch starts the next one."""

    @abstractmethod
    def next_step(self, epoch: int, position: int) -> list[Batch]:
        """The micro-batches of optimizer step `position` of `epoch` (grad_accum of them)."""

    def begin_step(self, epoch: int) -> int:
        """The step about to train takes the batches fetched last: returns its epoch."""
        return epoch

    def checkpoint_state(self) -> dict[str, Any]:
        """What the client_state records of the data position beside (epoch, position); collective."""
        return {}


class Recipe(ABC):
    """One training kind, as the loop sees it."""

    source: BatchSource
    """The micro-batch source (set by __init__)."""

    def __init__(self, setup: Any, engine: Any):
        self.s, self.engine, self.plan = setup, engine, setup.plan
        self.objective: Optional[Objective] = None
        """What Engine.train_step runs per micro-batch (make_objective's, set by the trainer's start); None: the
        model's own loss."""

    def make_objective(self) -> Optional[Objective]:
        """What the engine runs per micro-batch (built on every rank, after the engine and any resume); None: the
        model's own loss."""
        return None

    def rank_state(self) -> Optional[Callable[[], Any]]:
        """What each checkpoint keeps of this rank beyond the backend's state (called at each save,
        backends/checkpointing.py CheckpointExtras); None: nothing."""
        return None

    def restore_rank_state(self, saved: Any) -> None:
        """This rank's rank_state from the checkpoint resumed (None: none saved, or saved on another world size);
        after make_objective."""

    @abstractmethod
    def evaluate(self, trainer: Any) -> dict[str, float]:
        """The task's eval figures (TaskSpec.eval_metrics) over the whole eval set; every replica runs the same
        number of batches (collectives)."""

    def step_figures(self, timer: Any, position: int) -> dict[str, Any]:
        """What a step's record adds (the objective's metric names and figures; PendingRecord); may set the timer's
        objective_finish (how the summed figures become metrics)."""
        return {}

    def start_records(self, step: int) -> list[dict[str, Any]]:
        """metrics.jsonl's records of how the task runs, written when the run starts (step: its first: 0, or the
        resumed one)."""
        return []

    def after_step(self, writer: Any, step: int) -> None:
        """After each step (rank 0 writes what it logs)."""

    def close(self) -> None:
        """Release what the recipe holds before the export (every rank)."""
        if self.objective is not None:
            self.objective.close(self.engine)


def recipe_class(ref: str) -> type[Recipe]:
    """The Recipe class of a `module:Class` reference (tasks.TaskSpec.recipe), imported when a run builds it."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def build_recipe(setup: Any, engine: Any) -> Recipe:
    """The recipe of the run's task (RunPlan.task.recipe)."""
    return recipe_class(setup.plan.task.recipe)(setup, engine)


def iterate(source: Iterator[Batch], n: int) -> list[Batch]:
    """The next n micro-batches of an iterator."""
    return [next(source) for _ in range(n)]
