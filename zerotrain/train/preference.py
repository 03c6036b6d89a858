"""Preference tuning: the DPO, IPO, SimPO and ORPO losses on chosen/rejected pairs, and the reference model.

The anchor is TRL 1.16 (trl/trainer/dpo_trainer.py, trl/experimental/cpo and orpo): the same tokenization
(zerotrain/data/preference.py), losses, reward metrics and their names. A micro-batch of B pairs is one
forward over 2B rows (chosen then rejected; --dpo-split-forward: two forwards of B rows); each row's
log-probability is the sum over its completion tokens (SimPO, ORPO and IPO's loss: the per-token mean).

  dpo sigmoid  -(1-e) log s(beta z) - e log s(-beta z),  z = (pi_c - ref_c) - (pi_r - ref_r)   (e: cDPO's smoothing)
  dpo ipo      (z_c / n_c - z_r / n_r - 1 / (2 beta))^2,  z_x = pi_x - ref_x
  simpo        -(1-e) log s(beta (avg_c - avg_r) - gamma) - e log s(-(...))
  orpo         NLL(chosen) - beta log s(log odds(avg_c) - log odds(avg_r))
  --rpo-alpha  adds alpha x NLL(chosen) to dpo
NLL(chosen) is the token mean over the whole global batch (every micro-batch and replica, as the causal-LM
loss is, zerotrain/backends/base.py _token_weighting); the pair losses are means over pairs.

The reference (dpo) is, by what the run has: precomputed log-probs (--precompute-ref; a table over the data's
pair indices, saved in the run dir so a resume finds it: zerotrain/train/reference.py), the policy with its LoRA
adapters disabled (no second copy), or a frozen model the engine holds partitioned like the policy
(Engine.auxiliary "reference"). Every rank runs the same forwards in the same order (no rank ever enters a ZeRO-3
gather alone). The objective is built by the pairs recipe (zerotrain/train/recipes/pairs.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..config.schema import RunConfig
from ..model import sequence_parallel as seqpar
from ..tasks import PairLossSpec, TaskSpec, task_spec
from .recipes.base import ObjectiveOutput

IGNORE = -100
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""The per-pair figures every step and evaluation reports (TRL's names), means over the global batch."""


@dataclass(frozen=True)
class PreferenceLoss:
    """The loss of a preference task, resolved from the config."""

    pair: PairLossSpec
    """The task's pair loss (zerotrain/tasks.py TaskSpec.preference): its family, reference and NLL term."""
    beta: float
    loss: str
    label_smoothing: float
    rpo_alpha: float
    simpo_gamma: float

    @classmethod
    def from_config(cls, cfg: RunConfig, task: Optional[TaskSpec] = None) -> "PreferenceLoss":
        """The loss a config asks for; task: the run's (RunPlan.task; None: model.task's)."""
        p, task = cfg.pref, task or task_spec(cfg.model.task)
        return cls(task.preference, task.beta(cfg), p.loss, p.label_smoothing, p.rpo_alpha, p.simpo_gamma)

    @property
    def needs_reference(self) -> bool:
        return self.pair.reference

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen rows' NLL in the loss: ORPO's 1, RPO's alpha (--rpo-alpha), SimPO's 0."""
        weight = self.pair.nll_weight
        return self.rpo_alpha if weight is None else weight

    def describe(self) -> str:
        return _DESCRIBE[self.pair.family](self)

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor, n_chosen: torch.Tensor,
                    n_rejected: torch.Tensor, ref_chosen: Optional[torch.Tensor] = None,
                    ref_rejected: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss per pair, chosen reward, rejected reward) from each row's summed completion log-prob and its
        completion token count (and, for dpo, the reference's)."""
        return _PAIR_LOSSES[self.pair.family](self, chosen, rejected, n_chosen, n_rejected, ref_chosen, ref_rejected)


def _dpo(loss: PreferenceLoss, chosen: torch.Tensor, rejected: torch.Tensor, n_chosen: torch.Tensor,
         n_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor):
    """DPO (sigmoid, cDPO's label smoothing) and IPO: the policy's log-ratios against the reference's."""
    beta, eps = loss.beta, loss.label_smoothing
    dc, dr = chosen - ref_chosen, rejected - ref_rejected
    if loss.loss == "ipo":  # TRL: normalized by the completion lengths (confirmed with IPO's authors)
        losses = (dc / n_chosen.clamp(min=1) - dr / n_rejected.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        z = beta * (dc - dr)
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    return losses, beta * dc.detach(), beta * dr.detach()


def _reference_free(per_pair):
    """A reference-free family's pair loss from the per-token mean log-probs (SimPO, ORPO)."""
    def pair_losses(loss: PreferenceLoss, chosen: torch.Tensor, rejected: torch.Tensor, n_chosen: torch.Tensor,
                    n_rejected: torch.Tensor, *_reference):
        avg_c, avg_r = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        return per_pair(loss, avg_c, avg_r), loss.beta * avg_c.detach(), loss.beta * avg_r.detach()
    return pair_losses


def _simpo(loss: PreferenceLoss, avg_c: torch.Tensor, avg_r: torch.Tensor) -> torch.Tensor:
    eps = loss.label_smoothing
    z = loss.beta * (avg_c - avg_r) - loss.simpo_gamma
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _orpo(loss: PreferenceLoss, avg_c: torch.Tensor, avg_r: torch.Tensor) -> torch.Tensor:
    """log odds = log p - log(1 - p), p the per-token mean probability."""
    log_odds = (avg_c - avg_r) - (_log1mexp(avg_c) - _log1mexp(avg_r))
    return -loss.beta * F.logsigmoid(log_odds)


_PAIR_LOSSES = {"dpo": _dpo, "simpo": _reference_free(_simpo), "orpo": _reference_free(_orpo)}
"""PairLossSpec.family -> (loss per pair, chosen reward, rejected reward); a new family (KTO) is a new entry."""


def _describe_dpo(loss: PreferenceLoss) -> str:
    extra = (f", label smoothing {loss.label_smoothing}" if loss.label_smoothing else "") + \
        (f", rpo alpha {loss.rpo_alpha}" if loss.rpo_alpha else "")
    return f"dpo ({loss.loss}) beta {loss.beta}{extra}"


_DESCRIBE = {
    "dpo": _describe_dpo,
    "simpo": lambda loss: f"simpo beta {loss.beta} gamma {loss.simpo_gamma}"
    + (f", label smoothing {loss.label_smoothing}" if loss.label_smoothing else ""),
    "orpo": lambda loss: f"orpo lambda {loss.beta}",
}
"""PairLossSpec.family -> the line the run prints about its loss."""


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stably (TRL's log1mexp)."""
    return torch.where(x > -0.693147, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def shifted_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[rows, seq]: the token each position predicts (every attended token after the first), IGNORE elsewhere (the
    pre-shifted labels memory_reducers.chunked_token_logps takes)."""
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)


def token_logps(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """[rows, seq] log-probability of each (pre-shifted) label, 0 where IGNORE; in fp32 as TRL's fused head.
    As the label's logit minus the logsumexp: backward keeps the logits it already has and a [rows, seq]
    result, not a second [rows, seq, vocab] tensor of log-softmax (fp32 logits are not even copied)."""
    logits = logits.float()
    picked = torch.gather(logits, 2, shift_labels.clamp(min=0).unsqueeze(2)).squeeze(2) - logits.logsumexp(-1)
    return torch.where(shift_labels == IGNORE, torch.zeros_like(picked), picked)


@dataclass
class RowLogps:
    """Each row's summed log-probabilities from one pass over a batch (chosen rows, then rejected)."""

    completion: torch.Tensor
    """[2B] over the completion tokens (what the preference losses compare)."""
    sequence: torch.Tensor
    """[2B] over every token after the first, prompt included (ORPO's NLL term, as TRL's ORPOTrainer)."""
    aux_loss: Optional[torch.Tensor] = None
    """The mixture of experts' router load-balancing loss of the pass (None: none)."""


def pair_output(loss: torch.Tensor, aux: Optional[torch.Tensor], per_pair: dict[str, torch.Tensor],
                pair_loss: torch.Tensor) -> ObjectiveOutput:
    """One micro-batch's output: per_pair holds each pair's figures (detached: METRICS' chosen and rejected rewards and
    log-probs as reported, "nll", the chosen row's summed negative log-likelihood in the NLL term, and "nll_tokens",
    its tokens); its rows add the derived METRICS, "pairs" (1 per pair) and "loss" (each pair's loss: evaluation
    averages them); its sums are the METRICS and pairs summed over the micro-batch (what a training step reports)."""
    c, r = per_pair["rewards/chosen"], per_pair["rewards/rejected"]
    figures = {"rewards/chosen": c, "rewards/rejected": r, "rewards/accuracies": (c > r).to(c.dtype),
               "rewards/margins": c - r, "logps/chosen": per_pair["logps/chosen"],
               "logps/rejected": per_pair["logps/rejected"], "pairs": torch.ones_like(c)}
    rows = {**figures, "loss": pair_loss, "nll": per_pair["nll"], "nll_tokens": per_pair["nll_tokens"]}
    return ObjectiveOutput(loss, {k: v.sum() for k, v in figures.items()}, aux, rows)


def _rows_logps(engine: Any, batch: dict[str, torch.Tensor], rows: slice, chunked: int, group: Any,
                forward_kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(per-token log-probs [rows, seq] of every attended token after the first, the completion mask aligned with
    them, router aux loss or None) of some rows through engine's forward. Under sp (group) engine cuts the rows
    itself (Engine._sequence_parallel_forward, or SequenceCut for a frozen copy) and both tensors are this rank's
    shard of the sequence, cut the same way (sequence_parallel.cut)."""
    ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows]
    labels = shifted_labels(ids, mask)
    completion = batch["completion_mask"][rows]  # label t+1 sits at t
    in_completion = torch.cat([completion[:, 1:], completion.new_zeros((completion.shape[0], 1))], dim=1)
    if group is not None:
        labels, in_completion = seqpar.cut(labels, group, IGNORE), seqpar.cut(in_completion, group, 0)
    if chunked:  # the head and log-softmax chunk by chunk (memory_reducers); the forward returns them
        out = engine(input_ids=ids, attention_mask=mask, use_cache=False, token_logps_of=labels, **forward_kwargs)
        return out["token_logps"], in_completion, out.get("aux_loss")
    out = engine(input_ids=ids, attention_mask=mask, use_cache=False, **forward_kwargs)
    return token_logps(out.logits, labels), in_completion, out.get("aux_loss")


def sequence_logps(engine: Any, batch: dict[str, torch.Tensor], split: bool, chunked: int, group: Any = None,
                   **forward_kwargs: Any) -> RowLogps:
    """Each row's summed log-probs through engine (the policy or a reference): one forward of the 2B rows, or
    with split two of B rows (chosen, then rejected). Under sp (group: the engine's SequenceGroup) each rank sums
    its shard of every row and group_total adds the shards up: the whole row's sum on every rank of the group."""
    n = batch["input_ids"].shape[0]
    parts = [slice(0, n // 2), slice(n // 2, n)] if split else [slice(0, n)]
    completion, sequence, aux = [], [], []
    for rows in parts:
        per_token, in_completion, a = _rows_logps(engine, batch, rows, chunked, group, forward_kwargs)
        sequence.append(per_token.sum(1))
        if group is None:  # the last position predicts nothing
            per_token, in_completion = per_token[:, :-1], in_completion[:, :-1]
        completion.append((per_token * in_completion.to(per_token.dtype)).sum(1))
        if a is not None:
            aux.append(a)
    completion_sum, sequence_sum = torch.cat(completion), torch.cat(sequence)
    if group is not None:
        completion_sum, sequence_sum = group_total(completion_sum, group), group_total(sequence_sum, group)
    return RowLogps(completion_sum, sequence_sum, sum(aux) / len(aux) if aux else None)


# --- sequence parallelism: rows cut over the sp ranks, their sums added up ---------------------------------
def sequence_group(engine: Any) -> Any:
    """The engine's sequence-parallel group (zerotrain/model/sequence_parallel.py SequenceGroup), None without sp."""
    return getattr(engine, "sequence_group", None)


def group_total(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of a per-row tensor over the sp group (each rank's shard sum -> the whole row's): its value is the
    total on every rank, its gradient flows into this rank's shard only (the other shards' parts are constants
    here; their ranks backpropagate them, and the attention's all-to-all carries what crosses shards)."""
    import torch.distributed as tdist

    total = local.detach().clone()
    tdist.all_reduce(total, group=group.group)
    return local + (total - local.detach())


def sp_gradient(loss: torch.Tensor, group: Any) -> torch.Tensor:
    """A loss of group_total's sums, the same value on every rank of the group: each rank's gradient is its
    shard's part, and the backends average gradients over dp x sp ranks, so the gradient is scaled by sp (the
    sp parts add up to the replica's gradient) while the value stays the loss that is logged."""
    if group is None:
        return loss
    return group.size * loss - (group.size - 1) * loss.detach()


class SequenceCut:
    """A frozen copy (Engine.auxiliary) called under sp: the rows cut to this rank's shard as the engine's own
    forward cuts them (sequence_parallel.shard_batch), its attention switched to the all-to-all one."""

    def __init__(self, model: Any, group: Any):
        self.model, self.group = model, group
        seqpar.install(getattr(model, "module", model), group)  # a DeepSpeed engine holds the HF model

    def __call__(self, **batch: Any) -> Any:
        return self.model(**seqpar.shard_batch(batch, self.group))


# --- the reference ------------------------------------------------------------------------------------------
class Reference:
    """Where the reference log-probs of a batch come from."""

    kind = "reference"

    def logps(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what it holds."""


class ForwardReference(Reference):
    """A model run under no_grad in eval mode: a frozen copy (Engine.auxiliary), the policy with its LoRA
    adapters disabled, or the policy itself before its first step (to precompute)."""

    def __init__(self, model: Any, kind: str, adapters_off: Any = None, split: bool = False, chunked: int = 0):
        self.model, self.kind, self.adapters_off, self.split, self.chunked = model, kind, adapters_off, split, chunked
        self._cut: Optional[SequenceCut] = None
        """Under sp: the frozen copy called on this rank's shard of the rows (built at the first call)."""

    def logps(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.completion_logps(engine, batch).chunk(2)

    def completion_logps(self, engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[rows]: every row's summed completion log-prob (KTO reads its rows one by one, zerotrain/train/kto.py)."""
        # a frozen copy is called itself (its own wrapper gathers under ZeRO-3 / FSDP2), the policy through the engine
        call = self.model if self.model is not None else engine
        module = self.model if self.model is not None else engine.module
        group = sequence_group(engine)
        if self.model is not None and group is not None:  # the engine cuts its own forward's rows, not the copy's
            if self._cut is None:
                self._cut = SequenceCut(self.model, group)
            call = self._cut
        was_training = module.training
        module.eval()  # the reference is a fixed function: no dropout
        adapters = self.adapters_off() if self.adapters_off is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), adapters:
                logps = sequence_logps(call, batch, self.split, self.chunked, group).completion
        finally:
            module.train(was_training)
        return logps

    def close(self) -> None:
        self.model = self._cut = None


class TableReference(Reference):
    """Log-probs --precompute-ref stored, per split: looked up in `split`'s table (evaluation: "eval")."""

    kind = "precomputed log-probs (--precompute-ref)"
    split = "train"


@contextlib.contextmanager
def table_split(reference: Optional[Reference], split: str) -> Any:
    """Look up precomputed reference log-probs in this split's table meanwhile (a live reference: no change)."""
    if not isinstance(reference, TableReference):
        yield
        return
    before, reference.split = reference.split, split
    try:
        yield
    finally:
        reference.split = before


class PrecomputedReference(TableReference):
    """The table --precompute-ref stored: [pairs, 2] (chosen, rejected) per split, looked up by pair index."""

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.tables = tables

    def logps(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tables[self.split][batch["pair_index"].cpu()].to(engine.device)
        return rows[:, 0], rows[:, 1]


# --- the objective ------------------------------------------------------------------------------------------
class PreferenceObjective:
    """What Engine.train_step runs per micro-batch instead of the model's own loss (its recipe's objective)."""

    def __init__(self, loss: PreferenceLoss, reference: Optional[Reference], split: bool, chunked: int,
                 router_coef: Optional[float]):
        self.spec, self.reference, self.split, self.chunked = loss, reference, split, chunked
        self.router_coef = router_coef
        self._nll_scale: Optional[float] = None

    def begin_step(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Before a step's micro-batches (every rank): the global chosen-token count the NLL term divides by
        (a collective, only when the loss has that term)."""
        if not self.spec.nll_weight:
            return
        from ..distributed.collectives import reduce_sum

        share = 1.0 if engine.plan.world.counts_for_data(engine.rank) else 0.0  # sp ranks repeat their replica's batch
        local = float(sum(int(self._nll_tokens(b).sum()) for b in micro_batches))
        (tokens,) = reduce_sum(share * local)
        self._nll_scale = engine.plan.batch.step_micro_batches / max(tokens, 1.0)

    def _nll_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tokens of each chosen row in the NLL term: its completion (RPO, TRL's "sft" loss) or, for ORPO, every
        token after the first (TRL's ORPOTrainer: "computed over the full prompt and response")."""
        mask = batch["attention_mask"] if self.spec.pair.nll_over == "sequence" else batch["completion_mask"]
        return _tokens(mask).chunk(2)[0]

    def __call__(self, engine: Any, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        """The policy's forward and the loss of one micro-batch (on the device)."""
        group = sequence_group(engine)
        policy = sequence_logps(engine, batch, self.split, self.chunked, group)
        return self._finish(engine, batch, policy, self._nll_scale, group)

    def evaluate(self, engine: Any, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        """The same without gradients and without the router loss (an evaluation batch)."""
        with torch.no_grad():
            policy = sequence_logps(engine, batch, self.split, self.chunked, sequence_group(engine))
            policy.aux_loss = None
            return self._finish(engine, batch, policy, None)

    def _finish(self, engine: Any, batch: dict[str, torch.Tensor], policy: RowLogps,
                nll_scale: Optional[float], group: Any = None) -> ObjectiveOutput:
        """The loss and figures from the policy's row sums; group: training under sp (sp_gradient)."""
        chosen, rejected = policy.completion.chunk(2)
        aux = policy.aux_loss
        n_chosen, n_rejected = _tokens(batch["completion_mask"]).chunk(2)
        nll_sum = -(policy.sequence if self.spec.pair.nll_over == "sequence" else policy.completion).chunk(2)[0]
        nll_tokens = self._nll_tokens(batch)
        ref_c = ref_r = None
        if self.spec.needs_reference:
            ref_c, ref_r = self.reference.logps(engine, batch)
        losses, r_c, r_r = self.spec.pair_losses(chosen, rejected, n_chosen, n_rejected, ref_c, ref_r)
        loss = losses.mean()
        if self.spec.nll_weight:
            # scaled so that the engines' mean over micro-batches and replicas gives the global token mean;
            # evaluation (no scale) takes the micro-batch's own mean
            scale = nll_scale if nll_scale is not None else 1.0 / max(float(nll_tokens.sum()), 1.0)
            loss = loss + self.spec.nll_weight * nll_sum.sum() * scale
        loss = sp_gradient(loss, group)
        if aux is not None and self.router_coef:
            loss = loss + self.router_coef * aux
        logps_c, logps_r = chosen.detach(), rejected.detach()
        if self.spec.pair.per_token_logps:  # SimPO / ORPO report the per-token means they train on (TRL's CPO/ORPO)
            logps_c, logps_r = logps_c / n_chosen.clamp(min=1), logps_r / n_rejected.clamp(min=1)
        per_pair = {"rewards/chosen": r_c, "rewards/rejected": r_r, "logps/chosen": logps_c, "logps/rejected": logps_r,
                    "nll": nll_sum.detach(), "nll_tokens": nll_tokens}
        return pair_output(loss, aux.detach() if aux is not None else None, per_pair, losses.detach())

    def on_split(self, split: str) -> Any:
        """Look up precomputed reference log-probs in this split's table meanwhile (evaluation: "eval")."""
        return table_split(self.reference, split)

    def close(self, engine: Any) -> None:
        """Release the reference model (every rank; before the policy is gathered for export)."""
        if self.reference is not None:
            self.reference.close()
            engine.release_auxiliary("reference")


def _tokens(mask: torch.Tensor) -> torch.Tensor:
    """Tokens per row whose log-prob counts under a [rows, seq] mask (a row's first token predicts nothing)."""
    return mask[:, 1:].sum(1).to(torch.float32)


# --- building the reference ---------------------------------------------------------------------------------
