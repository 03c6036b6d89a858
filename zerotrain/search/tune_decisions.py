"""`zerotrain tune`'s decisions, free of any launching: the search space, pruning by the memory estimate,
the order trials run in, and the winner.

    candidates = search_space(base_cfg, space)              # backend x stage x offload x micro-batch x ckpt x tp/pp/sp
                                                            # x memory reducers (grpo: x rollout engine, rows, gather)
    rows = [predict(c, base_cfg, nproc, facts, device) ...] # the plan `train` builds, or why it refuses
    prune(rows, limit)                                      # predicted peak per rank above the usable limit
    order = trial_order(rows)                               # the cheapest-looking first (prior_cost)
    ... run trials (zerotrain/commands/tune.py) ...
    winner = pick_winner(rows, limit, measure=measure_of(cfg))  # fastest measured that fits; ties -> less memory

A row is a plain dict (the report's CSV columns, TUNE_COLUMNS) so saved trial results (tuned/trials.json)
can be reloaded and decided again without running anything (`zerotrain tune --replay`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from ..errors import UserError
from ..util import human_bytes

if TYPE_CHECKING:
    from ..config.schema import RunConfig
    from ..memory.estimate import Estimate
    from ..model.facts import ModelFacts
    from ..plan.run_plan import RunPlan

TUNE_COLUMNS: tuple[str, ...] = (
    "name", "backend", "stage", "offload_optimizer", "offload_param", "micro_batch", "grad_accum",
    "gradient_checkpointing", "tp", "pp", "sp", "ep", "reducers", "rollout_engine", "rollout_rows",
    "generation_gather", "prior_cost", "prior_rank",
    "predicted_peak_bytes", "predicted_model_state_bytes",
    "measured_peak_bytes", "peak_error_pct", "measured_model_state_bytes", "model_state_error_pct",
    "tokens_per_s", "tokens_per_s_runs", "samples_per_s", "samples_per_s_runs", "step_time_s", "generation_s",
    "final_loss", "trial_seconds",
    "outside_calibration", "status", "reason", "error",
)
"""Columns of tuned/report.csv. predicted_peak_bytes: the per-rank need tune prunes with (peak RSS of a CPU-only
rank, or device bytes on a GPU); outside_calibration: why that prediction was never checked against a measured run
of its kind (zerotrain/memory/runtime.py CALIBRATED; empty inside the region); measured_peak_bytes: the trial's largest rank (whole-run VmHWM on CPU, peak
allocated GPU memory on a GPU); peak_error_pct = (measured - predicted) / predicted; tokens_per_s: median over
the trial's timed steps (median of rounds when --repeats > 1, each round in tokens_per_s_runs); samples_per_s
likewise (completions/s for grpo: what ranks a grpo search, MEASURES); generation_s: grpo's median generation phase
per step; rollout_engine, rollout_rows, generation_gather: grpo's rl.* choices ('' / 0: not searched); status:
winner, ok, pruned, refused, failed, timeout, over-limit, unknown-peak (ran, but reported no peak), not-run."""

PEAK_TOLERANCE_PCT = 15.0
"""A measured peak more than this above its prediction is called out in the report."""


@dataclass(frozen=True)
class Candidate:
    """One point of the search space: what tune varies; everything else is the user's run config."""

    backend: str
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    micro_batch: int = 1
    gradient_checkpointing: bool = False
    tp: int = 1
    pp: int = 1
    sp: int = 1
    reducers: bool = False
    """The long-sequence memory reducer on: the tiled MLP at REDUCER_TOKENS (the fused loss chunks the logits in every
    candidate)."""
    ep: int = 1
    """Expert-parallel degree (mixtures of experts only)."""
    rollout_engine: str = ""
    """grpo: rl.rollout_engine (batched or exact); '' for other tasks (not set)."""
    rollout_rows: int = 0
    """grpo, batched engine: rl.rollout_rows, the most completions one generate call samples (0: all of a rank's)."""
    generation_gather: str = ""
    """grpo where the weights are sharded (ZeRO-3, FSDP2 stage 1-3): rl.generation_gather (phase or forward); ''
    elsewhere (every rank holds them whole: not set)."""

    @property
    def name(self) -> str:
        """A file-name-safe id, e.g. deepspeed-z3-mb4-ckpt, fsdp-tp2-z2-mb8-opt, fsdp-sp2-z3-mb1-tiled or (grpo)
        deepspeed-z3-mb4-rows8-gfwd, fsdp-z2-mb4-exact."""
        par = "".join(f"-{d}{n}" for d, n in (("tp", self.tp), ("pp", self.pp), ("sp", self.sp), ("ep", self.ep))
                      if n > 1)
        off = "".join(f"-{n}" for n, v in (("opt", self.offload_optimizer), ("param", self.offload_param))
                      if v != "none")
        return (f"{self.backend}{par}-z{self.stage}-mb{self.micro_batch}" + ("-ckpt" if self.gradient_checkpointing
                                                                               else "") + off
                + ("-tiled" if self.reducers else "") + rollout_suffix(self.rollout_engine, self.rollout_rows,
                                                                      self.generation_gather))

    def overrides(self) -> dict[str, Any]:
        """The run-config keys this candidate sets (global batch stays the user's: grad-accum follows)."""
        return {"backend": self.backend, "zero.stage": self.stage, "zero.offload_optimizer": self.offload_optimizer,
                "zero.offload_param": self.offload_param, "batch.micro_batch": self.micro_batch,
                "model.gradient_checkpointing": self.gradient_checkpointing, "parallel.tp": self.tp,
                "parallel.pp": self.pp, "parallel.sp": self.sp, "parallel.ep": self.ep,
                "model.tiled_mlp": REDUCER_TOKENS if self.reducers else 0,
                "model.chunked_loss": 0,  # the fused loss (on by default) chunks the logits in every candidate
                **({"rl.rollout_engine": self.rollout_engine} if self.rollout_engine else {}),
                **({"rl.rollout_rows": self.rollout_rows} if self.rollout_engine == "batched" else {}),
                **({"rl.generation_gather": self.generation_gather} if self.generation_gather else {})}

    @classmethod
    def of_row(cls, r: dict[str, Any]) -> "Candidate":
        """The candidate of a saved report row (trials.json; rows from before sp/reducers/ep count as 1/off)."""
        return cls(r["backend"], int(r["stage"]), r["offload_optimizer"], r["offload_param"], int(r["micro_batch"]),
                   str(r["gradient_checkpointing"]) in ("True", "true", "1"), int(r["tp"]), int(r["pp"]),
                   int(r.get("sp") or 1), str(r.get("reducers")) in ("True", "true", "1"), int(r.get("ep") or 1),
                   r.get("rollout_engine") or "", int(r.get("rollout_rows") or 0), r.get("generation_gather") or "")


def rollout_suffix(engine: str, rows: int, gather: str) -> str:
    """A grpo candidate's name tail: -exact, -rowsN (batched, N completions a call), -gfwd (per-forward gather);
    nothing for the batched engine's whole-batch call with the phase gather (the defaults) or another task."""
    return ("-exact" if engine == "exact" else f"-rows{rows}" if engine == "batched" and rows else "") \
        + ("-gfwd" if gather == "forward" else "")


MEASURES: dict[str, str] = {"tokens_per_s": "tokens/s", "samples_per_s": "completions/s"}
"""What a trial's speed is ranked by, and its unit in the report. tokens/s for the supervised tasks; completions per
second (the global batch / the step time, generation included) for grpo, whose step is mostly generation and whose
trained tokens per step vary with the sampled lengths (their tokens/s would rank luck)."""


def measure_of(cfg: RunConfig) -> str:
    """The measure that ranks this run's trials (a MEASURES key)."""
    from ..tasks import task_spec

    return "samples_per_s" if task_spec(cfg.model.task).online_rl is not None else "tokens_per_s"


def sharded_weights(backend: str, stage: int) -> bool:
    """Whether generation must gather the weights (rl.generation_gather means something): ZeRO-3, FSDP2 stage 1-3
    (the rules' Unused rl.generation_gather is the complement)."""
    return stage == 3 or (backend == "fsdp" and stage > 0)


def rollout_rows_choices(per_replica: int, num_generations: int) -> tuple[int, ...]:
    """The batched engine's rows per call searched: 0 (a rank's whole generation batch in one call) and half of it
    in whole groups, where that is at least one group and less than the whole."""
    half = (per_replica // 2) // num_generations * num_generations
    return (0, half) if num_generations <= half < per_replica else (0,)


REDUCER_TOKENS = 2048
"""Tokens per MLP tile of a candidate with the reducers on (the flag's bare value)."""

LONG_SEQUENCE = 4096
"""From this --seq-len on, tune's auto search adds sequence parallelism and the memory reducers."""



@dataclass(frozen=True)
class Space:
    """The axes of the search (each a tuple of values tried)."""

    backends: tuple[str, ...] = ("deepspeed",)
    stages: tuple[int, ...] = (0, 1, 2, 3)
    offload: bool = False
    """Try optimizer offload (stages 1-3) and parameter offload (stage 3): only where there is a device to
    move them off (a GPU); on a CPU-only machine both live in the same RAM."""
    micro_batches: Optional[tuple[int, ...]] = None
    """None: every power of two (and the largest) that divides the global batch per data-parallel replica."""
    checkpointing: tuple[bool, ...] = (False, True)
    tps: tuple[int, ...] = (1,)
    pps: tuple[int, ...] = (1,)
    sps: tuple[int, ...] = (1,)
    reducers: tuple[bool, ...] = (False,)
    eps: tuple[int, ...] = (1,)
    """Expert-parallel degrees: searched for mixtures of experts (the rules refuse ep on a dense model)."""
    rollout_engines: tuple[str, ...] = ("",)
    """grpo: rl.rollout_engine values (batched, exact); ('',) for other tasks."""
    rollout_rows: Optional[tuple[int, ...]] = None
    """grpo, batched engine: rl.rollout_rows values; None: rollout_rows_choices of each layout's batch per replica."""
    num_generations: int = 0
    """grpo: rl.num_generations (rows per call come in whole groups of it); 0 for other tasks."""
    gathers: tuple[str, ...] = ("",)
    """grpo: rl.generation_gather values, tried where the weights are sharded (sharded_weights); ('',) elsewhere."""


def parse_size(text: str, flag: str = "--memory-per-rank") -> int:
    """'24GiB', '1.5 GB', '800MiB', '123456' -> bytes (binary units for KiB/MiB/GiB/TiB, decimal for KB/MB/GB/TB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*", text.strip().lower())
    if not m:
        raise UserError(f"{flag} {text!r}: expected a size such as 24GiB, 1.5GB, 800MiB or a number of bytes")
    value, unit = float(m.group(1)), (m.group(2) or "b")
    scale = {"": 1, "b": 1, "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000, "m": 2**20, "mi": 2**20, "mib": 2**20,
             "mb": 10**6, "g": 2**30, "gi": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "ti": 2**40, "tib": 2**40,
             "tb": 10**12}.get(unit)
    if scale is None:
        raise UserError(f"{flag} {text!r}: unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    if value <= 0:
        raise UserError(f"{flag} {text!r}: must be > 0")
    return int(value * scale)


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def micro_batch_choices(per_replica: int, limit: int = 64) -> tuple[int, ...]:
    """Powers of two that divide the per-replica batch, and the per-replica batch itself, up to `limit`."""
    out = {m for m in (2**k for k in range(0, 7)) if m <= min(per_replica, limit) and per_replica % m == 0}
    if per_replica <= limit:
        out.add(per_replica)
    return tuple(sorted(out))


def search_space(global_batch: int, nproc: int, space: Space) -> list[Candidate]:
    """Every candidate of the space, in a fixed order; micro-batches follow each layout's data-parallel size
    (tp x pp that does not divide nproc is left to the rules, which refuse it with its reason)."""
    from ..distributed.layout import ParallelDegrees
    from ..memory.estimate import setups

    offloads = ("none", "cpu") if space.offload else ("none",)
    rows = setups(space.backends, space.stages, offloads, offloads)
    out: list[Candidate] = []
    for tp in space.tps:
        for pp in space.pps:
            for sp in space.sps:
                # ep splits the experts of data-parallel ranks, not the batch
                dp = ParallelDegrees(tp=tp, pp=pp, sp=sp).replicas(nproc)
                per_replica = global_batch // dp if global_batch % dp == 0 else global_batch
                mbs = space.micro_batches or micro_batch_choices(per_replica)
                for ep in space.eps:
                    for s in rows:
                        for mb in mbs:
                            for ckpt in space.checkpointing:
                                for red in space.reducers:
                                    for rl in _rollouts(space, per_replica, sharded_weights(s.backend, s.stage)):
                                        out.append(Candidate(s.backend, s.stage, s.offload_optimizer, s.offload_param,
                                                             mb, ckpt, tp, pp, sp, red, ep, *rl))
    return out


def _rollouts(space: Space, per_replica: int, sharded: bool) -> list[tuple[str, int, str]]:
    """(engine, rows, gather) of grpo's axes: rows only for the batched engine, the gather only where sharded."""
    gathers = [g for g in space.gathers if g] if sharded and any(space.gathers) else [""]
    out = []
    for engine in space.rollout_engines:
        rows = (space.rollout_rows or rollout_rows_choices(per_replica, space.num_generations or per_replica)
                if engine == "batched" else (0,))
        out += [(engine, n, g) for n in rows for g in gathers]
    return out


def prior_cost(c: Candidate, grad_accum: int, bubble: float = 0.0) -> float:
    """Relative step time guessed before measuring, to decide which candidates get a trial first (the measured
    trials decide the winner; these factors only order them). Recomputing activations costs a third more
    compute (one extra forward); each micro-batch pays a fixed overhead (hooks, launches, Python) worth ~0.3 of
    a sample; higher ZeRO stages add communication per step (stage 3: a parameter gather in every micro-batch's
    forward and backward); offload adds host transfers and a CPU optimizer step; tensor parallelism adds two
    collectives per block; sequence parallelism four all-to-alls per block; expert parallelism four token
    all-to-alls per MoE block but no gather of the experts (guessed even); the reducers recompute the MLPs and
    the head (about a fifth more compute); a pipeline idles for its bubble."""
    cost = (1.0 + 0.3 / c.micro_batch) * (4.0 / 3.0 if c.gradient_checkpointing else 1.0)
    cost *= {0: 1.0, 1: 1.02, 2: 1.05, 3: 1.12 + 0.03 * min(grad_accum, 8)}[c.stage]
    cost *= 1.5 if c.offload_optimizer != "none" else 1.0
    cost *= 1.5 if c.offload_param != "none" else 1.0
    cost *= 1.25 if c.tp > 1 else 1.0
    cost *= 1.15 if c.sp > 1 else 1.0
    cost *= 1.2 if c.reducers else 1.0
    # grpo: an exact rollout is a generate call per prompt, a rows cap more calls, a per-forward gather a gather per
    # generated token
    cost *= 1.5 if c.rollout_engine == "exact" else 1.1 if c.rollout_rows else 1.0
    cost *= 2.0 if c.generation_gather == "forward" else 1.0
    return cost / max(1e-6, 1.0 - bubble)


def predicted_need(est: Estimate, device: str) -> int:
    """The per-rank memory a candidate needs at its peak: on a CPU-only machine the whole-run peak RSS of a
    rank (`zerotrain train`: baseline, model states, activations, the largest transient); on a GPU what the
    device holds (model states kept there + activations)."""
    return est.device_bytes if device == "cuda" else est.run_peak_rss


def predict(c: Candidate, cfg: RunConfig, nproc: int, facts: ModelFacts,
            device: str) -> tuple[dict[str, Any], Optional[RunPlan]]:
    """(report row, the plan `train` builds for this candidate) or (row with status refused, None)."""
    from ..memory.estimate import estimate
    from ..plan.run_plan import build_plan

    row: dict[str, Any] = {"name": c.name, "backend": c.backend, "stage": c.stage,
                           "offload_optimizer": c.offload_optimizer, "offload_param": c.offload_param,
                           "micro_batch": c.micro_batch, "gradient_checkpointing": c.gradient_checkpointing,
                           "tp": c.tp, "pp": c.pp, "sp": c.sp, "ep": c.ep, "reducers": c.reducers,
                           "rollout_engine": c.rollout_engine, "rollout_rows": c.rollout_rows,
                           "generation_gather": c.generation_gather, "status": "",
                           "reason": "",
                           "error": ""}
    try:
        variant = with_overrides(cfg, c.overrides())
        plan = build_plan(variant, nproc, backend=c.backend, device=device, facts=facts)
    except UserError as e:
        row.update(status="refused", reason=f"refused: {e}")
        return row, None
    est = estimate(plan)
    row.update(grad_accum=plan.batch.grad_accum, predicted_peak_bytes=predicted_need(est, device),
               outside_calibration="; ".join(est.outside_calibration),
               predicted_model_state_bytes=est.largest_stage_model_states,
               prior_cost=round(prior_cost(c, plan.batch.grad_accum, est.bubble), 4))
    return row, plan


def with_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """cfg with dotted keys set, validated as `train` validates a run config (one-line ConfigError)."""
    from ..config.load import build_config

    return build_config(overrides=overrides, base=cfg)


def usable(limit: int, margin: float) -> int:
    """The memory per rank candidates are pruned against: the limit less the safety margin."""
    return int(limit * (1.0 - margin))


def prune(rows: list[dict[str, Any]], limit: int, margin: float) -> None:
    """Mark every planned row whose predicted peak exceeds the usable limit as pruned (in place)."""
    cap = usable(limit, margin)
    for r in rows:
        if r["status"] == "" and r["predicted_peak_bytes"] > cap:
            r.update(status="pruned", reason=f"pruned: predicted {mib(r['predicted_peak_bytes'])} > {mib(cap)} usable "
                                             f"({mib(limit)} - {margin:.0%} margin)"
                                             + (f"; the prediction is outside the calibrated region "
                                                f"({r['outside_calibration']})" if r.get("outside_calibration") else ""))


def mib(n: float) -> str:
    """Bytes as whole MiB with thousands separators: pruning decisions are read at this precision."""
    return f"{n / 2**20:,.0f} MiB"


def trial_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows still in the running, cheapest prior first (ties: less predicted memory, then search order);
    sets prior_rank (1 = first)."""
    live = [r for r in rows if r["status"] == ""]
    order = sorted(live, key=lambda r: (r["prior_cost"], r["predicted_peak_bytes"], rows.index(r)))
    for i, r in enumerate(order, 1):
        r["prior_rank"] = i
    return order


def out_of_budget(spent_s: float, longest_s: float, budget_s: float, any_done: bool) -> bool:
    """Whether another trial would overrun the budget: the time spent plus the longest trial so far (the best
    guess of the next one's length) exceeds it. The first trial always runs (nothing to decide without it)."""
    return any_done and spent_s + longest_s > budget_s


def no_fit_message(rows: list[dict[str, Any]], limit: int, margin: float, nproc: int, *, lora: bool,
                   offload_searched: bool, on_gpu: bool) -> str:
    """The one line for a limit that no candidate meets: the smallest predicted need and what would lower it."""
    planned = [r for r in rows if r.get("predicted_peak_bytes") is not None]
    if not planned:
        reasons = list(dict.fromkeys(r["reason"] for r in rows if r["reason"]))
        return "no candidate can run: " + (reasons[0] if reasons else "the search space is empty")
    best = min(planned, key=lambda r: r["predicted_peak_bytes"])
    levers = [f"more ranks (--nproc {2 * nproc} shards ZeRO-3 states twice as thin)"]
    if on_gpu and not offload_searched:
        levers.append("CPU offload (--offload)")
    elif on_gpu:
        levers.append("CPU offload is already searched: a bigger GPU or more ranks")
    if not lora:
        levers.append("LoRA (--lora-r 16: no gradients or optimizer states for the frozen base)")
    if best["micro_batch"] > 1:
        levers.append("a smaller micro-batch (--micro-batches 1)")
    if not best["gradient_checkpointing"]:
        levers.append("gradient checkpointing")
    levers.append("a shorter --seq-len")
    return (f"--memory-per-rank {human_bytes(limit)} ({human_bytes(usable(limit, margin))} after the {margin:.0%} "
            f"safety margin): no candidate fits; the smallest predicted need is "
            f"{human_bytes(best['predicted_peak_bytes'])} per rank ({best['name']}); lower it with "
            + ", ".join(levers))


def pick_winner(rows: list[dict[str, Any]], limit: int, tie_pct: float = 3.0,
                measure: str = "tokens_per_s") -> Optional[dict[str, Any]]:
    """The fastest measured candidate that fits, marking every measured row (in place).

    Eligible: status ok, `measure` (a MEASURES key: tokens/s, or grpo's completions/s) measured, measured peak <=
    limit (a trial that ran but peaked above the limit is over-limit, one that reported no peak unknown-peak:
    neither is a winner). Ties: rows within tie_pct % of the best speed (the machine's noise) count as
    equally fast; among them the one with the smaller measured peak wins, then the earlier in trial order.
    Failed and timed-out trials stay as they are (infeasible, with their first error line)."""
    unit = MEASURES[measure]
    for r in rows:
        if r["status"] == "ok" and not r.get("measured_peak_bytes"):  # unknown is not "fits"
            r.update(status="unknown-peak", reason="the trial reported no peak memory: whether it fits is unknown")
        elif r["status"] == "ok" and r["measured_peak_bytes"] > limit:
            r.update(status="over-limit", reason=f"measured peak {mib(r['measured_peak_bytes'])} > the "
                                                 f"{mib(limit)} limit")
    ok = [r for r in rows if r["status"] == "ok" and float(r.get(measure) or 0) > 0]
    if not ok:
        return None
    best = max(float(r[measure]) for r in ok)
    tied = [r for r in ok if float(r[measure]) >= best * (1.0 - tie_pct / 100.0)]
    winner = min(tied, key=lambda r: (r.get("measured_peak_bytes") or math.inf, r.get("prior_rank") or math.inf))
    for r in ok:
        if r is winner:
            r.update(status="winner", reason=f"fastest that fits ({len(tied)} within {tie_pct:g}% of the best: "
                                             "smallest measured peak)" if len(tied) > 1 else "fastest that fits")
        elif r in tied:
            r["reason"] = (f"tie: {float(r[measure]) / float(winner[measure]):.2f}x the winner's {unit} (within "
                           f"{tie_pct:g}%), lost on memory ({mib(r.get('measured_peak_bytes') or 0)} vs "
                           f"{mib(winner.get('measured_peak_bytes') or 0)})")
        else:
            r["reason"] = f"slower: {float(r[measure]) / float(winner[measure]):.2f}x the winner's {unit}"
    return winner


def peak_error_pct(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
    if not measured or not predicted:
        return None
    return round(100.0 * (measured - predicted) / predicted, 2)


def underpredicted(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured rows whose peak exceeds the prediction by more than PEAK_TOLERANCE_PCT."""
    return [r for r in rows if (r.get("peak_error_pct") or 0) > PEAK_TOLERANCE_PCT]
