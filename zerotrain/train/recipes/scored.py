"""Kinds whose objective evaluates itself and names its own step metrics: reward models (a Bradley-Terry loss on a
one-label head's scores of chosen and rejected, zerotrain/train/reward_model.py) and KTO (completions labelled
desirable or not against a KL estimate, zerotrain/train/kto.py)."""
from __future__ import annotations

from typing import Any

from .. import kto, reward_model
from .base import Objective, Recipe
from .sources import MapSource


class _SelfEvaluated(Recipe):
    """A recipe whose objective module builds the objective, and the objective evaluates and reports itself."""

    module: Any = None
    """The objective's module (its build_objective(setup, engine))."""

    def __init__(self, setup: Any, engine: Any):
        super().__init__(setup, engine)
        self.source = MapSource(setup, engine)

    def make_objective(self) -> Objective:
        return self.module.build_objective(self.s, self.engine)

    def step_figures(self, timer: Any, position: int) -> dict[str, Any]:
        """The step's metrics under TRL's names (the objective's finish of the summed figures)."""
        timer.objective_finish = self.objective.finish
        return {"objective_names": self.objective.metric_names}

    def evaluate(self, trainer: Any) -> dict[str, float]:
        return self.objective.evaluate(trainer)


class RewardRecipe(_SelfEvaluated):
    """reward: a one-label sequence classifier trained on chosen/rejected pairs."""

    module = reward_model


class UnpairedRecipe(_SelfEvaluated):
    """kto: completions labelled desirable or not, one by one, against a reference."""

    module = kto
