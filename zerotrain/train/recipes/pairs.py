"""Preference pairs: dpo, simpo, orpo. The objective is the pair loss (zerotrain/train/preference.py, with its reference
where the loss has one); a step reports the pair METRICS; evaluation averages the pair loss (+ the NLL term's token
mean) and the METRICS over the eval pairs."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...data.datasets import eval_loader
from ...distributed.collectives import reduce_sum
from ..preference import METRICS, PrecomputedReference, PreferenceLoss, PreferenceObjective, Reference
from ..reference import live_reference, precompute, precomputed_tables
from .base import Recipe
from .sources import MapSource


class PairsRecipe(Recipe):
    """dpo, simpo, orpo."""

    def __init__(self, setup: Any, engine: Any):
        super().__init__(setup, engine)
        self.source = MapSource(setup, engine)

    def make_objective(self) -> PreferenceObjective:
        return build_objective(self.s, self.engine)

    def step_figures(self, timer: Any, position: int) -> dict[str, Any]:
        return {"objective_names": METRICS}

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """The mean pair loss (+ the NLL term's token mean) and the pair metrics."""
        e, objective, plan = self.engine, self.objective, self.plan
        names = [*METRICS, "pairs", "loss", "nll", "nll_tokens"]
        totals = torch.zeros(len(names), dtype=torch.float64)
        e.eval()
        with objective.on_split("eval"):
            for batch in eval_loader(self.s.data, e.dp_rank, plan.world.dp, plan.batch.micro_batch):
                valid = batch.pop("valid").to(e.device).double()  # padding rows repeat pairs: not counted
                rows = objective.evaluate(e, e.to_device(batch)).rows
                totals += torch.stack([(rows[k].double() * valid).sum().cpu() for k in names])
        e.train()
        share = 1.0 if plan.world.counts_for_data(e.rank) else 0.0
        t = dict(zip(names, reduce_sum(*(share * totals).tolist())))
        pairs = max(t["pairs"], 1.0)
        loss = t["loss"] / pairs + objective.spec.nll_weight * t["nll"] / max(t["nll_tokens"], 1.0)
        return {"eval_loss": loss, **{f"eval_{k}": t[k] / pairs for k in METRICS}}


def build_objective(setup: Any, engine: Any) -> PreferenceObjective:
    """The objective of a preference run and its reference (every rank, after the engine and any resume)."""
    cfg = setup.cfg
    spec, p, ref_plan = PreferenceLoss.from_config(cfg, setup.plan.task), cfg.pref, setup.plan.task.reference(cfg)
    split, chunked = p.split_forward, cfg.model.chunked_loss or 0
    reference: Optional[Reference] = None
    if ref_plan is not None:
        if ref_plan.precomputed:
            reference = PrecomputedReference(precomputed_tables(
                setup, engine, ref_plan, split, chunked,
                lambda ref: precompute(engine, setup.data, ref, engine.plan.batch.micro_batch)))
        else:
            reference = live_reference(setup, engine, ref_plan, split, chunked)
    if engine.is_main:
        print(f"zerotrain: {spec.describe()}; reference: {reference.kind if reference else 'none (reference-free)'}",
              flush=True)
    return PreferenceObjective(spec, reference, split, chunked, engine.router_aux_coef)
