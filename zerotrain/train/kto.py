"""KTO (Kahneman-Tversky optimization): completions labelled desirable or undesirable one by one, against a KL
estimate and a reference model.

The anchor is TRL 1.16 (trl/trainer/kto_trainer.py, loss_type "kto"): the same rows (zerotrain/data/unpaired.py),
loss, metrics and names. Per row, with z = log pi(y|x) - log ref(y|x) summed over the completion's tokens:

  desirable    w_d (1 - s(beta (z - kl)))        undesirable   w_u (1 - s(beta (kl - z)))
  kl = max(0, mean over the KL rows of log pi(y'|x) - log ref(y'|x)), detached

The KL rows pair each row's prompt x with the completion y' of the row before it in data order (rotated). The
loss is the mean over rows (w_d, w_u: --desirable-weight, --undesirable-weight).

One difference from TRL, by design: kl is taken over the GLOBAL batch. begin_step runs the KL rows of every
micro-batch of this rank (no gradient, the policy in train mode as TRL's), and one all-reduce sums them over the
data-parallel ranks; every micro-batch's loss then uses that one kl. TRL takes it per micro-batch (its
gather_for_metrics over processes): the two agree for one process holding the whole batch without accumulation,
and zerotrain's figures do not change with the split over ranks and micro-batches (docs/preference.md).

The reference is DPO's (zerotrain/train/preference.py): a frozen copy the engine holds partitioned like the
policy, the policy with its LoRA adapters disabled, or precomputed log-probs (--precompute-ref). The KL rows'
partners depend on each epoch's data order, so --precompute-ref runs the reference over every epoch the run
reaches and keys the KL rows' log-probs by (row, partner); a resume that reaches further epochs adds theirs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ..tasks import TaskSpec, task_spec
from .recipes.base import ObjectiveOutput
from .preference import Reference, TableReference, sequence_group, sequence_logps, sp_gradient, table_split
from .reference import gather_rows, live_reference, precomputed_tables, store_tables

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
"""What a step reports (TRL's names): the KL estimate, and per class the mean reward (beta x log-ratio) and
completion log-prob over the step's rows of that class; a class absent from a step has no figure (as TRL)."""
_SUMS = ("kl_max", "chosen", "rejected", "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")
"""The per-micro-batch sums METRICS come from: kl (the same on every rank: reduced by max), the rows of each
class, and their rewards and log-probs summed."""


@dataclass(frozen=True)
class KTOLoss:
    """KTO's loss, resolved from the config."""

    beta: float
    """pref.beta (--beta; TRL's default 0.1)."""
    desirable_weight: float
    """pref.desirable_weight (--desirable-weight): the weight of a desirable row's loss."""
    undesirable_weight: float
    """pref.undesirable_weight (--undesirable-weight): the weight of an undesirable row's loss."""

    @classmethod
    def from_config(cls, cfg: Any, task: Optional[TaskSpec] = None) -> "KTOLoss":
        """The loss a config asks for; task: the run's (RunPlan.task; None: model.task's)."""
        p = cfg.pref
        return cls((task or task_spec(cfg.model.task)).beta(cfg), p.desirable_weight, p.undesirable_weight)

    def row_losses(self, logratio: torch.Tensor, label: torch.Tensor, kl: float) -> torch.Tensor:
        """[rows] each row's weighted loss (TRL's _compute_loss, loss_type "kto": Eqn (7) of the KTO paper)."""
        desirable = self.desirable_weight * (1 - torch.sigmoid(self.beta * (logratio - kl)))
        undesirable = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - logratio)))
        return torch.where(label.bool(), desirable, undesirable)

    def describe(self) -> str:
        return f"kto beta {self.beta}, desirable weight {self.desirable_weight}, " \
               f"undesirable weight {self.undesirable_weight}"


def row_sums(loss: KTOLoss, logratio: torch.Tensor, logps: torch.Tensor, label: torch.Tensor,
             rows: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The class sums of _SUMS but kl over some rows (a mask; None: all): each class's rows, rewards, log-probs."""
    keep = torch.ones_like(label, dtype=torch.bool) if rows is None else rows.bool()
    chosen, rejected = (label.bool() & keep).to(logps.dtype), (~label.bool() & keep).to(logps.dtype)
    rewards = loss.beta * logratio.detach()
    return {"chosen": chosen.sum(), "rejected": rejected.sum(), "rewards_chosen": (rewards * chosen).sum(),
            "rewards_rejected": (rewards * rejected).sum(), "logps_chosen": (logps.detach() * chosen).sum(),
            "logps_rejected": (logps.detach() * rejected).sum()}


def metrics_of(totals: dict[str, float], prefix: str = "") -> dict[str, float]:
    """METRICS from the sums over a step's (or an evaluation's) rows, TRL's way: a class's figures only when the
    class has rows, the margin only when both have."""
    out = {f"{prefix}kl": totals["kl_max"]}
    for cls in ("chosen", "rejected"):
        if totals[cls] > 0:
            out[f"{prefix}rewards/{cls}"] = totals[f"rewards_{cls}"] / totals[cls]
            out[f"{prefix}logps/{cls}"] = totals[f"logps_{cls}"] / totals[cls]
    if totals["chosen"] > 0 and totals["rejected"] > 0:
        out[f"{prefix}rewards/margins"] = out[f"{prefix}rewards/chosen"] - out[f"{prefix}rewards/rejected"]
    return out


def kl_view(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch's KL rows as rows of their own (each row's prompt with its partner's completion), with "kl_pair"
    [rows, 2] (row, partner: where precomputed log-probs are looked up)."""
    return {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"],
            "completion_mask": batch["kl_completion_mask"],
            "kl_pair": torch.stack([batch["row_index"], batch["kl_index"]], dim=1)}


# --- the precomputed reference ------------------------------------------------------------------------------
class PrecomputedKTOReference(TableReference):
    """The tables --precompute-ref stored: each row's completion log-prob by row index, and each KL row's by
    (row, partner), per split."""

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.rows = {s: tables[s] for s in ("train", "eval") if s in tables}
        self.kl = {s: {(int(i), int(j)): float(v) for i, j, v in tables[f"{s}_kl"].tolist()}
                   for s in ("train", "eval") if f"{s}_kl" in tables}

    def completion_logps(self, engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "kl_pair" in batch:
            table = self.kl[self.split]
            pairs = [tuple(p) for p in batch["kl_pair"].tolist()]
            missing = [p for p in pairs if p not in table]
            if missing:  # an internal error: the precompute pass walks the same data order as training
                raise RuntimeError(f"--precompute-ref: no reference log-prob of the KL rows (row, partner) {missing} "
                                   f"in the {self.split} table")
            return torch.tensor([table[p] for p in pairs], dtype=torch.float32, device=engine.device)
        return self.rows[self.split][batch["row_index"].cpu()].to(engine.device)


def precompute(engine: Any, setup: Any, reference: Reference, epochs: Iterable[int],
               with_eval: bool = True) -> dict[str, torch.Tensor]:
    """The reference log-probs of every row and KL row the run meets (every rank; each runs its own batches, then
    one all_gather per table): the train rows and their KL rows in every epoch of `epochs` (each epoch's order
    pairs the rows anew), and the eval set's (with_eval)."""
    from ..data.datasets import eval_loader, train_loader

    data, plan = setup.data, setup.plan
    rank, dp, micro = engine.dp_rank, plan.world.dp, plan.batch.micro_batch
    loaders = {"train": [train_loader(data, rank, dp, micro, setup.cfg.run.seed, epoch,
                                      global_batch=plan.batch.global_batch)
                         for epoch in epochs]}
    if with_eval and data.eval is not None:
        loaders["eval"] = [eval_loader(data, rank, dp, micro)]
    tables: dict[str, torch.Tensor] = {}
    for split, batches in loaders.items():
        rows, kl_rows = [], []
        for batch in (b for loader in batches for b in loader):
            valid = batch.pop("valid", torch.ones_like(batch["row_index"], dtype=torch.bool)).double()
            device_batch = engine.to_device(batch)
            logps = reference.completion_logps(engine, device_batch).detach().double().cpu()
            kl = reference.completion_logps(engine, engine.to_device(kl_view(batch))).detach().double().cpu()
            rows.append(torch.stack([batch["row_index"].double(), logps, valid], dim=1))
            kl_rows.append(torch.stack([batch["row_index"].double(), batch["kl_index"].double(), kl, valid], dim=1))
        local = gather_rows(torch.cat(rows) if rows else torch.zeros((0, 3), dtype=torch.float64))
        n = len(data.train if split == "train" else data.eval)
        table = torch.full((n,), float("nan"), dtype=torch.float64)
        kept = local[local[:, 2] > 0]
        table[kept[:, 0].long()] = kept[:, 1]
        tables[split] = table.float()
        pairs = gather_rows(torch.cat(kl_rows) if kl_rows else torch.zeros((0, 4), dtype=torch.float64))
        tables[f"{split}_kl"] = pairs[pairs[:, 3] > 0][:, :3]
    return tables


def _merge(tables: dict[str, torch.Tensor], more: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tables with the train rows and KL rows of more's epochs added."""
    rows = tables["train"].clone()
    seen = ~torch.isnan(more["train"])
    rows[seen] = more["train"][seen]
    return {**tables, "train": rows, "train_kl": torch.cat([tables["train_kl"], more["train_kl"]])}


def _reference_tables(setup: Any, engine: Any, ref_plan: Any, chunked: int) -> dict[str, torch.Tensor]:
    """--precompute-ref's tables for every epoch the run reaches: computed before the first step and saved in the
    run dir; a resume loads them, and computes the epochs it reaches beyond them with the reference itself (a
    frozen copy of the starting weights or --ref-model, or LoRA's base), then saves them again."""
    plan = setup.plan
    epochs = math.ceil(plan.total_steps / max(plan.steps_per_epoch, 1))
    depends_on = ("kto", setup.cfg.run.seed, plan.batch.global_batch)  # the data order pairs the KL rows

    def compute(ref: Reference) -> dict[str, torch.Tensor]:
        return {**precompute(engine, setup, ref, range(epochs)), "epochs": torch.tensor(epochs)}

    tables = precomputed_tables(setup, engine, ref_plan, False, chunked, compute, *depends_on)
    have = int(tables["epochs"])
    if have < epochs:  # a resume that runs longer than the first run planned
        ref = live_reference(setup, engine, ref_plan, False, chunked)
        tables = {**_merge(tables, precompute(engine, setup, ref, range(have, epochs), with_eval=False)),
                  "epochs": torch.tensor(epochs)}
        ref.close()
        engine.release_auxiliary("reference")
        store_tables(setup, engine, ref_plan, tables, *depends_on)
    return tables


# --- the objective ------------------------------------------------------------------------------------------
class KTOObjective:
    """What Engine.train_step runs per micro-batch instead of the model's own loss (its recipe's objective)."""

    metric_names = METRICS

    def __init__(self, loss: KTOLoss, reference: Reference, chunked: int, router_coef: Optional[float]):
        self.spec, self.reference, self.chunked, self.router_coef = loss, reference, chunked, router_coef
        self.kl: Optional[float] = None
        """The step's KL estimate (begin_step), the same on every rank."""

    def _logps(self, engine: Any, batch: dict[str, torch.Tensor]):
        """(the policy's completion log-probs [rows], its router loss or None) through engine."""
        out = sequence_logps(engine, batch, False, self.chunked, sequence_group(engine))
        return out.completion, out.aux_loss

    def _kl_sums(self, engine: Any, batch: dict[str, torch.Tensor],
                 rows: Optional[torch.Tensor] = None) -> tuple[float, float]:
        """(sum of policy - reference log-probs over a host batch's KL rows (a mask: some rows), their count),
        without gradients."""
        view = engine.to_device(kl_view(batch))
        with torch.no_grad():
            policy, _ = self._logps(engine, view)
            ref = self.reference.completion_logps(engine, view)
        diff = (policy - ref).double().cpu()
        keep = torch.ones_like(diff) if rows is None else rows.double()
        return float((diff * keep).sum()), float(keep.sum())

    def begin_step(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Before a step's micro-batches (every rank): the KL estimate over the global batch (one all-reduce)."""
        from ..distributed.collectives import reduce_sum

        sums = [self._kl_sums(engine, b) for b in micro_batches]  # the policy as it is: in train mode, as TRL's
        total, rows = reduce_sum(sum(s for s, _ in sums), sum(n for _, n in sums))
        self.kl = max(total / max(rows, 1.0), 0.0)

    def __call__(self, engine: Any, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        """The policy's forward and the loss of one micro-batch (on the device)."""
        logps, aux = self._logps(engine, batch)
        ref = self.reference.completion_logps(engine, batch)
        logratio = logps - ref
        label = batch["label"]
        loss = sp_gradient(self.spec.row_losses(logratio, label, self.kl).mean(), sequence_group(engine))
        if aux is not None and self.router_coef:
            loss = loss + self.router_coef * aux
        sums = {"kl_max": torch.tensor(self.kl, dtype=torch.float64), **row_sums(self.spec, logratio, logps, label)}
        return ObjectiveOutput(loss, sums, aux.detach() if aux is not None else None)

    def finish(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's METRICS from its sums over micro-batches and ranks (StepFigures finish)."""
        return metrics_of(totals)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """eval_loss and the eval METRICS over the whole eval set (every rank): the KL estimate over all its KL rows
        (row i's partner is eval row i - 1), then each row's loss against it; padding rows ("valid" false) do not
        count."""
        from ..data.datasets import eval_loader
        from ..distributed.collectives import reduce_sum

        e, plan = trainer.engine, trainer.plan
        share = 1.0 if plan.world.counts_for_data(e.rank) else 0.0  # each replica's batches count once
        kl_sum = kl_rows = 0.0
        rows = []  # per batch: (logratio, logps, label, valid) on the host
        e.eval()
        try:
            with table_split(self.reference, "eval"), torch.no_grad():
                for batch in eval_loader(trainer.s.data, e.dp_rank, plan.world.dp, plan.batch.micro_batch):
                    valid = batch.pop("valid")
                    s, n = self._kl_sums(e, batch, valid)
                    kl_sum, kl_rows = kl_sum + s, kl_rows + n
                    device_batch = e.to_device(batch)
                    logps, _ = self._logps(e, device_batch)
                    ref = self.reference.completion_logps(e, device_batch)
                    rows.append(((logps - ref).cpu(), logps.cpu(), batch["label"], valid))
        finally:
            e.train()
        total, count = reduce_sum(share * kl_sum, share * kl_rows)
        kl = max(total / max(count, 1.0), 0.0)
        sums = dict.fromkeys(("loss", "rows", *_SUMS[1:]), 0.0)
        for logratio, logps, label, valid in rows:
            keep = valid.to(logps.dtype)
            sums["loss"] += float((self.spec.row_losses(logratio, label, kl) * keep).sum())
            sums["rows"] += float(keep.sum())
            for k, v in row_sums(self.spec, logratio, logps, label, valid).items():
                sums[k] += float(v)
        totals = dict(zip(sums, reduce_sum(*(share * v for v in sums.values()))))
        return {"eval_loss": totals["loss"] / max(totals["rows"], 1.0),
                **metrics_of({**totals, "kl_max": kl}, prefix="eval_")}

    def close(self, engine: Any) -> None:
        """Release the reference model (every rank; before the policy is gathered for export)."""
        self.reference.close()
        engine.release_auxiliary("reference")


# --- building it --------------------------------------------------------------------------------------------
def balance_warning(desirable: int, undesirable: int, w_d: float, w_u: float) -> Optional[str]:
    """TRL's class-balance warning (its KTOTrainer's, from Eqn (8) of the KTO paper) with zerotrain's flags, or None
    when the classes are balanced or either weight is in its recommended range."""
    desirable, undesirable = max(desirable, 1), max(undesirable, 1)
    if desirable == undesirable:
        return None
    d_lo, d_hi = round(undesirable * w_u / desirable, 2), round(undesirable * w_u / desirable * 1.33, 2)
    u_lo, u_hi = round(desirable * w_d / undesirable / 1.33, 2), round(desirable * w_d / undesirable, 2)
    if d_lo <= w_d <= d_hi or u_lo <= w_u <= u_hi:
        return None
    return (f"zerotrain: warning: the train set has {desirable} desirable and {undesirable} undesirable rows, and "
            f"--desirable-weight {w_d} / --undesirable-weight {w_u} are outside the range the KTO paper recommends "
            f"for them: set EITHER --desirable-weight in [{d_lo}, {d_hi}] OR --undesirable-weight in [{u_lo}, {u_hi}] "
            "(not both)")


def build_objective(setup: Any, engine: Any) -> KTOObjective:
    """The KTO objective and its reference (every rank, after the engine and any resume)."""
    cfg = setup.cfg
    task = setup.plan.task
    spec, ref_plan, chunked = KTOLoss.from_config(cfg, task), task.reference(cfg), cfg.model.chunked_loss or 0
    if ref_plan.precomputed:
        reference: Reference = PrecomputedKTOReference(_reference_tables(setup, engine, ref_plan, chunked))
    else:
        reference = live_reference(setup, engine, ref_plan, False, chunked)
    if engine.is_main:
        labels = [bool(x) for x in setup.data.train["label"]]
        line = balance_warning(sum(labels), len(labels) - sum(labels), spec.desirable_weight, spec.undesirable_weight)
        if line is not None:
            print(line, flush=True)
        print(f"zerotrain: {spec.describe()}; reference: {reference.kind}", flush=True)
    return KTOObjective(spec, reference, chunked, engine.router_aux_coef)
