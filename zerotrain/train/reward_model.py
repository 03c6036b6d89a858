"""Reward models: the Bradley-Terry loss on a one-label head's scores of chosen and rejected (--task reward).

The anchor is TRL 1.16's RewardTrainer (trl/trainer/reward_trainer.py compute_loss): a micro-batch of B pairs is
one forward over its 2B rows (chosen then rejected, zerotrain/data/preference.py collate_pairs); each row's score
is logits[:, 0] of the sequence classifier, and

  loss = -log s(r_c - r_r - margin)  (mean over pairs; margin: the data's optional "margin" column, Llama 2)
         + coef x mean((r_c + r_r)^2)  (--center-rewards-coef, TRL's center_rewards_coefficient)

The metrics carry TRL's names: accuracy (pairs with r_c > r_r), margin (mean r_c - r_r), mean_reward, min_reward
and max_reward (over every chosen and rejected score of the global batch). Each micro-batch reports sums (and a
min / max) that StepFigures reduces over micro-batches and ranks, so a step's figures are those of its whole global
batch: equal to TRL's in one process holding the whole batch per device.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..model import sequence_parallel as seqpar
from .preference import group_total, sequence_group, sp_gradient
from .recipes.base import ObjectiveOutput

METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")
"""TRL's reward metrics (RewardTrainer compute_loss), means over the global batch except the min and max."""


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor],
                center_coef: Optional[float]) -> torch.Tensor:
    """Each pair's loss: -log s(r_c - r_r - margin) + coef x (r_c + r_r)^2 (their mean is TRL's loss; evaluation
    averages them over the eval set)."""
    loss = -F.logsigmoid(_difference(chosen, rejected, margin))
    if center_coef is not None:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def batch_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor],
               center_coef: Optional[float]) -> torch.Tensor:
    """The mean of pair_losses in TRL's own order of operations (compute_loss: the log-sigmoid's mean, then + coef x
    the centring term's mean), so that one process with TRL's batch rounds as TRL does."""
    loss = -F.logsigmoid(_difference(chosen, rejected, margin)).mean()
    if center_coef is not None:
        loss = loss + center_coef * torch.mean((chosen + rejected) ** 2)
    return loss


def _difference(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor]) -> torch.Tensor:
    diff = chosen - rejected
    return diff if margin is None else diff - margin.to(diff.dtype)


def pair_sums(chosen: torch.Tensor, rejected: torch.Tensor, valid: Optional[torch.Tensor] = None
              ) -> dict[str, torch.Tensor]:
    """The sums (and min / max) of the figures over some pairs (valid: a 0/1 mask over them, evaluation's padding
    rows out): "pairs", "accuracy" and "margin" per pair, "scores" and "score_sum" over both rows of each pair,
    "reward_min" / "reward_max" (names ending _min / _max: StepFigures reduces them by min / max). float64."""
    c, r = chosen.detach().double(), rejected.detach().double()
    keep = torch.ones_like(c) if valid is None else valid.to(c.device).double()
    kept = keep > 0
    scores = torch.cat([c[kept], r[kept]])
    return {"pairs": keep.sum(), "accuracy": ((c > r).double() * keep).sum(), "margin": ((c - r) * keep).sum(),
            "scores": 2 * keep.sum(), "score_sum": scores.sum(),
            "reward_min": scores.min() if scores.numel() else c.new_tensor(math.inf),
            "reward_max": scores.max() if scores.numel() else c.new_tensor(-math.inf)}


def metrics_from_sums(totals: dict[str, float], prefix: str = "") -> dict[str, float]:
    """TRL's metrics (METRICS, under prefix) from pair_sums' totals over the global batch or the eval set."""
    pairs, scores = max(totals["pairs"], 1.0), max(totals["scores"], 1.0)
    empty = totals["scores"] == 0
    return {f"{prefix}accuracy": totals["accuracy"] / pairs, f"{prefix}margin": totals["margin"] / pairs,
            f"{prefix}mean_reward": totals["score_sum"] / scores,
            f"{prefix}min_reward": math.nan if empty else totals["reward_min"],
            f"{prefix}max_reward": math.nan if empty else totals["reward_max"]}


def scores(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(chosen scores [B], rejected scores [B], router aux loss or None): one forward of the batch's 2B rows, the
    head's one logit per row in fp32 (TRL: torch.chunk(logits.squeeze(-1), 2)). Under sp: sp_scores."""
    group = sequence_group(engine)
    if group is not None:
        row, aux = sp_scores(engine, batch["input_ids"], batch["attention_mask"], group)
    else:
        out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        row, aux = out.logits[:, 0].float(), out.get("aux_loss")
    chosen, rejected = row.chunk(2)
    return chosen, rejected, aux


def sp_scores(engine: Any, ids: torch.Tensor, mask: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
    """([rows] scores, router aux loss or None) under sp: the head reads the last token that is not the pad token
    (transformers' sequence classifiers), which one rank of the group holds. Each rank's forward pools over its
    shard alone, so only that rank's score is the row's: kept there, zero elsewhere, and the group's sum is the
    row's score on every rank (group_total). The rows are padded with the pad token to a multiple of sp first, so
    the engine's cut (sequence_parallel.shard_batch) adds no other token."""
    pad = engine.hf_model.config.pad_token_id
    s = ids.shape[1]
    width = seqpar.padded_width(s, group)
    if width != s:
        ids = torch.nn.functional.pad(ids, (0, width - s), value=pad)
        mask = torch.nn.functional.pad(mask, (0, width - s), value=0)
    real = (ids != pad).to(torch.int64)  # transformers' rule: the last position holding no pad token
    last = (torch.arange(width, device=ids.device) * real).argmax(-1)
    mine = (last // (width // group.size)) == group.rank
    out = engine(input_ids=ids, attention_mask=mask, use_cache=False)
    local = out.logits[:, 0].float()
    return group_total(torch.where(mine, local, torch.zeros_like(local)), group), out.get("aux_loss")


class RewardObjective:
    """What Engine.train_step runs per micro-batch instead of the model's own loss (its recipe's objective)."""

    metric_names = METRICS

    def __init__(self, center_coef: Optional[float], router_coef: Optional[float]):
        self.center_coef, self.router_coef = center_coef, router_coef

    def begin_step(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Nothing to agree on before a step: every pair's loss is its own (a mean over pairs per micro-batch)."""

    def __call__(self, engine: Any, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        """The model's forward and the loss of one micro-batch (on the device)."""
        chosen, rejected, aux = scores(engine, batch)
        loss = sp_gradient(batch_loss(chosen, rejected, batch.get("margin"), self.center_coef), sequence_group(engine))
        if aux is not None and self.router_coef:
            loss = loss + self.router_coef * aux
        return ObjectiveOutput(loss, pair_sums(chosen, rejected), aux.detach() if aux is not None else None)

    def finish(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's metrics under TRL's names from its totals over micro-batches and ranks."""
        return metrics_from_sums(totals)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """eval_loss (the mean pair loss, margin and centring term as in training) and the metrics over the whole
        eval set (every rank, the same number of batches; collectives)."""
        from ..data.datasets import eval_loader
        from ..distributed.collectives import reduce_max, reduce_sum

        e = trainer.engine
        names = ("pairs", "accuracy", "margin", "scores", "score_sum", "loss")
        totals = dict.fromkeys(names, 0.0)
        low, high = math.inf, -math.inf
        e.eval()
        try:
            with torch.no_grad():
                for batch in eval_loader(trainer.s.data, e.dp_rank, trainer.plan.world.dp,
                                         trainer.plan.batch.micro_batch):
                    valid = batch.pop("valid").double()  # padding rows repeat pairs: not counted
                    device_batch = e.to_device(batch)
                    chosen, rejected, _ = scores(e, device_batch)
                    losses = pair_losses(chosen, rejected, device_batch.get("margin"), self.center_coef)
                    sums = pair_sums(chosen, rejected, valid)
                    sums["loss"] = (losses.double().cpu() * valid).sum()
                    for k in names:
                        totals[k] += float(sums[k])
                    low, high = min(low, float(sums["reward_min"])), max(high, float(sums["reward_max"]))
        finally:
            e.train()
        counts = trainer.plan.world.counts_for_data(e.rank)  # each replica's batches count once
        share = 1.0 if counts else 0.0
        summed = dict(zip(names, reduce_sum(*(share * totals[k] for k in names))))
        neg_low, high = reduce_max(-low if counts else -math.inf, high if counts else -math.inf)
        summed.update(reward_min=-neg_low, reward_max=high)
        return {"eval_loss": summed["loss"] / max(summed["pairs"], 1.0), **metrics_from_sums(summed, "eval_")}

    def close(self, engine: Any) -> None:
        """Nothing to release (no reference model)."""


def describe(center_coef: Optional[float], margin: bool) -> str:
    """The line a run prints about its loss."""
    return "reward model (Bradley-Terry" + (", margin column" if margin else "") + (
        f", center rewards coef {center_coef}" if center_coef is not None else "") + ")"


def build_objective(setup: Any, engine: Any) -> RewardObjective:
    """The objective of a reward-model run (every rank, after the engine and any resume)."""
    coef = setup.cfg.pref.center_rewards_coef
    if engine.is_main:
        print(f"zerotrain: {describe(coef, _has_margin(setup.data))}", flush=True)
    return RewardObjective(coef, engine.router_aux_coef)


def _has_margin(data: Any) -> bool:
    """Whether the training pairs carry the margin column (zerotrain/data/preference.py keeps it)."""
    from ..data.preference import MARGIN

    return MARGIN in getattr(data.train, "column_names", ())
