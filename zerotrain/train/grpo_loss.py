"""GRPO's clipped surrogate loss, its KL term, the clip/KL/entropy metrics and the group advantages: TRL 1.16's.

The anchor is TRL 1.16's GRPOTrainer (trl/trainer/grpo_trainer.py): `_compute_loss` for the loss and its logged
metrics, `_generate_and_score_completions` for the advantages and the reward metrics, with the names of its loss
types and metrics. Per completion token t of completion i (A_i its advantage, m its completion mask):

  r        = exp(logp - old)                     token level; sequence level (GSPO): exp(masked mean of logp - old)
  loss_it  = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i) + beta kl_it
  kl_it    = (exp(ref - logp) - (ref - logp) - 1) x r     (k3; x r: TRL's use_bias_correction_kl, its default)

and the loss types differ only in how the masked token losses are summed and divided (the whole step's batch):

  grpo     each completion's token mean, averaged over the completions
  dr_grpo  token sum / (completions x max_completion_len)
  dapo     token sum / completion tokens   (TRL's default)
  bnpo     token sum / completion tokens   (TRL: of the local micro-batch; here of the global batch)

The engines average each backward's loss over the micro-batches of a step and the data-parallel replicas, so a
micro-batch's loss is its share of the sum scaled by micro_batches / (the global divisor) (StepNormaliser): the mean
over every micro-batch and replica is then the loss of one process holding the whole global batch, and so are the
gradients (tests/unit/test_grpo_loss.py proves both against TRL's own `_compute_loss`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..tasks import RL_LOSS_TYPES as LOSS_TYPES  # the one list (config/rules.py refuses any other)

SEQUENCE_MEAN = LOSS_TYPES[0]
"""The loss type that averages each completion's tokens first (GRPO's own; its name is also the task's)."""
"""TRL's loss types this loss computes; its others (cispo, sapo, vespo, luspo, ...) are refused by the config layer."""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
"""TRL's importance_sampling_level: per-token ratios, or one per completion (GSPO)."""

SCALE_REWARDS = ("group", "batch", "none")
"""TRL's scale_rewards: divide the advantages by their group's std, the whole batch's std, or not at all."""

LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean", "entropy")
"""TRL's names of the loss's own metrics (kl only when beta > 0, entropy only when entropies are given)."""
SAMPLING_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
"""TRL's names of how far the generation's log-probs are from the training forward's (sampling_difference_sums)."""
METRICS = LOSS_METRICS + SAMPLING_METRICS
"""Every name `step_metrics` may return."""

REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std")
"""TRL's names of the metrics `advantages` returns."""


@dataclass(frozen=True)
class StepNormaliser:
    """The global counts a micro-batch's loss is scaled by, so that the engines' mean over micro-batches and
    data-parallel replicas (each backward's loss is averaged: DeepSpeed/FSDP divide by grad_accum and average over dp
    ranks) equals the loss of ONE process holding the whole global batch of completions."""

    completions: int
    """Completions in the global batch (all micro-batches, all ranks): grpo's and dr_grpo's divisor."""
    tokens: float
    """Completion tokens (the mask's sum) in the global batch: bnpo's divisor, and dapo's unless dapo_tokens is set."""
    micro_batches: int
    """What the engines' mean divides by: grad_accum x data-parallel replicas."""
    dapo_tokens: float | None = None
    """dapo's divisor when it is not `tokens`: TRL divides by the generation batch's tokens (its num_items_in_batch)
    x grad_accum / steps_per_generation, i.e. the generation batch's tokens x (this step's completions / the
    generation batch's completions); equal to `tokens` when one generation serves one optimizer step."""

    @classmethod
    def whole(cls, mask: torch.Tensor) -> "StepNormaliser":
        """One process holding the whole global batch in one micro-batch."""
        return cls(completions=int(mask.shape[0]), tokens=float(mask.float().sum()), micro_batches=1)

    def divisor(self, loss_type: str, max_completion_len: int) -> float:
        """The global number the step's summed loss is divided by (clamped at 1 as TRL clamps its token counts)."""
        if loss_type == SEQUENCE_MEAN:
            return float(self.completions)
        if loss_type == "dr_grpo":
            return float(self.completions * max_completion_len)
        if loss_type == "dapo" and self.dapo_tokens is not None:
            return max(float(self.dapo_tokens), 1.0)
        return max(float(self.tokens), 1.0)


@dataclass
class GRPOOutput:
    """One micro-batch's loss and the sums its step's metrics are made of."""

    loss: torch.Tensor
    """This micro-batch's scaled loss (backpropagated): the mean of it over the step's micro-batches and replicas is
    the global batch's loss."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-d tensors: summed over the step's micro-batches and ranks (keys ending in `_min` / `_max`: their
    min / max, see `reduction`), `step_metrics` turns them into TRL's METRICS."""


def reduction(key: str) -> str:
    """How a key of GRPOOutput.sums is reduced over micro-batches and ranks: "min", "max" or "sum"."""
    return "min" if key.endswith("_min") else "max" if key.endswith("_max") else "sum"


def combine(a: dict, b: dict) -> dict:
    """Two micro-batches' sums as one (each key by its `reduction`); values may be tensors or floats."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
            continue
        op = reduction(k)
        x, y = float(out[k]), float(v)
        out[k] = min(x, y) if op == "min" else max(x, y) if op == "max" else x + y
    return out


@dataclass(frozen=True)
class GRPOLoss:
    """TRL 1.16's GRPO loss (GRPOTrainer._compute_loss) for one micro-batch of completions, scaled for the step."""

    loss_type: str
    """One of LOSS_TYPES (TRL's loss_type)."""
    beta: float
    """The KL weight to the reference (TRL's beta); 0: no reference, no kl metric."""
    epsilon_low: float
    """The ratio's lower clip is 1 - epsilon_low (TRL's epsilon)."""
    epsilon_high: float
    """The ratio's upper clip is 1 + epsilon_high (TRL's epsilon_high, defaulting to epsilon)."""
    importance_sampling_level: str
    """"token": a ratio per token; "sequence": one per completion, the exp of its masked mean log-ratio (GSPO)."""
    max_completion_len: int
    """dr_grpo's constant normaliser (TRL's max_completion_length)."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL by the importance ratio (TRL's use_bias_correction_kl, default True)."""

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}: not one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level {self.importance_sampling_level!r}: not token or sequence")

    def __call__(self, logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, norm: StepNormaliser,
                 entropies: torch.Tensor | None = None) -> GRPOOutput:
        """logps [N, T]: the policy's per-token log-probs of the completion tokens (with grad); old_logps [N, T] or
        None (the on-policy case: logps.detach(), as TRL); ref_logps [N, T] (needed when beta != 0); advantages [N];
        mask [N, T] the completion mask (truncated completions already zeroed); entropies [N, T] or None: only for
        the entropy metric."""
        mask = mask.to(logps.dtype)
        old = logps.detach() if old_logps is None else old_logps
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        # The same expressions in the same order as TRL's _compute_loss, so the numbers and gradients are its.
        log_ratio = logps - old
        if self.importance_sampling_level == "token":
            log_weights = log_ratio
        else:
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_weights)
        per_token_kl = None
        if self.beta != 0.0:
            if ref_logps is None:
                raise ValueError("GRPOLoss: beta != 0 needs the reference's log-probs (ref_logps)")
            per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
            if self.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        if per_token_kl is not None:
            per_token_loss = per_token_loss + self.beta * per_token_kl
        masked = per_token_loss * mask
        if self.loss_type == SEQUENCE_MEAN:
            total = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        else:
            total = masked.sum()
        loss = total * (norm.micro_batches / norm.divisor(self.loss_type, self.max_completion_len))
        return GRPOOutput(loss=loss, sums=self._sums(coef_1.detach(), adv.detach(), mask,
                                                     None if per_token_kl is None else per_token_kl.detach(),
                                                     None if entropies is None else entropies.detach()))

    def _sums(self, coef_1, adv, mask, per_token_kl, entropies) -> dict[str, torch.Tensor]:
        """TRL's logged metrics as sums over this micro-batch (its global_masked_mean's numerator and denominator,
        and its per-completion clip means' min / max)."""
        sums = {"completions": torch.tensor(float(mask.shape[0])), "tokens": mask.sum()}
        if per_token_kl is not None:
            sums["kl_sum"], sums["kl_tokens"] = (per_token_kl * mask).sum(), mask.sum()
        if entropies is not None:
            sums["entropy_sum"], sums["entropy_tokens"] = (entropies * mask).sum(), mask.sum()
        low = ((coef_1 < 1 - self.epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((coef_1 > 1 + self.epsilon_high) & (adv > 0)).to(mask.dtype)
        region = ((low > 0) | (high > 0)).to(mask.dtype)
        if coef_1.shape[1] == 1:  # sequence level: one value per completion, every completion counted (as TRL)
            sums["clip_low_sum"], sums["clip_high_sum"] = low.sum(), high.sum()
            sums["clip_region_sum"], sums["clip_count"] = region.sum(), torch.tensor(float(coef_1.shape[0]))
            low_seq, high_seq = low.squeeze(1), high.squeeze(1)
        else:  # token level: token means; a completion without tokens has no mean (NaN, skipped by TRL's nanmin)
            sums["clip_low_sum"], sums["clip_high_sum"] = (low * mask).sum(), (high * mask).sum()
            sums["clip_region_sum"], sums["clip_count"] = (region * mask).sum(), mask.sum()
            n = mask.sum(-1)
            low_seq, high_seq = ((low * mask).sum(-1) / n)[n > 0], ((high * mask).sum(-1) / n)[n > 0]
        sums["clip_low_seq_min"] = low_seq.min() if low_seq.numel() else torch.tensor(math.inf)
        sums["clip_high_seq_max"] = high_seq.max() if high_seq.numel() else torch.tensor(-math.inf)
        return sums


def sampling_difference_sums(trained: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's sampling/sampling_logp_difference sums of a micro-batch: |the training forward's log-prob - the
    generation's| of each completion token (trained: before any update of the cycle), its sum, tokens and max."""
    delta = (trained.detach() - sampled).abs() * mask
    return {"sampling_diff_sum": delta.sum(), "sampling_diff_tokens": mask.sum(),
            "sampling_diff_max": delta.max() if delta.numel() else torch.tensor(0.0)}


def step_metrics(summed: dict) -> dict[str, float]:
    """TRL's METRICS from a step's sums (GRPOOutput.sums reduced over its micro-batches and ranks by `reduction`:
    keys ending in `_min` by min, `_max` by max, the rest by sum). TRL logs each micro-batch's value (global over
    ranks) and averages them over the logging interval; these are the step's token- (or completion-) weighted means
    and its min / max, equal to TRL's for a step of one micro-batch per rank."""

    def ratio(num: str, den: str) -> float:
        return float(summed[num]) / max(float(summed[den]), 1.0)

    def finite(key: str) -> float:
        v = float(summed[key])
        return v if math.isfinite(v) else math.nan  # no completion with tokens: TRL's nanmin gives NaN

    out = {}
    if "kl_sum" in summed:
        out["kl"] = ratio("kl_sum", "kl_tokens")
    out["clip_ratio/low_mean"] = ratio("clip_low_sum", "clip_count")
    out["clip_ratio/low_min"] = finite("clip_low_seq_min")
    out["clip_ratio/high_mean"] = ratio("clip_high_sum", "clip_count")
    out["clip_ratio/high_max"] = finite("clip_high_seq_max")
    out["clip_ratio/region_mean"] = ratio("clip_region_sum", "clip_count")
    if "entropy_sum" in summed:
        out["entropy"] = ratio("entropy_sum", "entropy_tokens")
    if "sampling_diff_sum" in summed:
        out["sampling/sampling_logp_difference/mean"] = ratio("sampling_diff_sum", "sampling_diff_tokens")
        out["sampling/sampling_logp_difference/max"] = float(summed["sampling_diff_max"])
    return out


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The std ignoring NaNs with Bessel's correction (NaN under 2 values): trl/trainer/utils.py's nanstd."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance = variance * correction
    if not keepdim:
        variance = variance.squeeze(dim) if dim is not None else variance.squeeze()
    return torch.sqrt(variance)


def advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL 1.16's advantages (_generate_and_score_completions, multi_objective_aggregation "sum_then_normalize") and
    its reward metrics. rewards [n_prompts x G]: the reward functions' weighted sum (NaN-summed) per completion, NaN
    where every function returned None, for the WHOLE generation batch in group order (a prompt's G completions
    contiguous). Returns (advantages [n_prompts x G], {"reward", "reward_std", "frac_reward_zero_std"})."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale!r}: not one of {', '.join(SCALE_REWARDS)}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"advantages: {tuple(rewards.shape)} rewards are no whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    if scale in ("group", "none"):  # "none" keeps the group std only for frac_reward_zero_std
        if num_generations > 1:
            std = nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
    else:
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    adv = torch.nan_to_num(adv, nan=0.0)  # unscorable completions carry no signal
    metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
               "frac_reward_zero_std": is_std_zero.float().mean().item()}
    return adv, metrics


_NOTES = {
    "grpo": "each completion's token mean, averaged over the global batch's completions: TRL's (its mean of "
            "micro-batch means is this when micro-batches hold equal numbers of completions, as here)",
    "dr_grpo": "token sum / (global completions x max_completion_len): TRL's",
    "dapo": "token sum / the global batch's completion tokens: TRL's (its num_items_in_batch is global too; when a "
            "generation serves several steps, the generation batch's tokens per step)",
    "bnpo": "token sum / the global batch's completion tokens: TRL divides by the tokens of each local micro-batch, "
            "so its loss depends on the layout; here it does not",
}


def loss_scale_note(loss_type: str) -> str:
    """One line for docs: how a loss type is normalised here and how that differs from TRL."""
    return f"{loss_type}: {_NOTES[loss_type]}"
