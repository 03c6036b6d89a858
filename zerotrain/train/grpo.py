"""Online RL (--task grpo): completions sampled from the policy, scored by reward functions, trained with GRPO's
clipped policy-gradient loss (and its variants: DAPO, Dr. GRPO, BNPO, GSPO's sequence-level ratio).

The anchor is TRL 1.16's GRPOTrainer: its config names and defaults (zerotrain/config/schema.py OnlineRLSection),
its loss (zerotrain/train/grpo_loss.py), its reward functions' signature (zerotrain/train/rewards.py) and its metric
names. A cycle, on every rank in lockstep:

  generate   the cycle's prompts (steps_per_generation / grad_accum optimizer steps' worth), num_generations
             completions each, every completion sampled with its own generator seeded by (run seed, epoch,
             generation, prompt's place in the generation batch, its index in the group); a rank's prompts in as
             few calls as --rollout-rows allows (rl.rollout_engine batched), or each prompt's group alone (exact:
             nothing depends on the layout, so 2 ranks sample bitwise what one process samples); see
             zerotrain/backends/generation.py (Engine.generation_phase gathers sharded weights once for the phase);
  score      each rank scores its own completions; the rewards are gathered so every rank has the generation
             batch's (group and batch advantages, TRL's reward metrics);
  remember   the old log-probs (when the batch is trained on more than once: num_iterations > 1 or several
             steps per generation) and the reference's (beta > 0), per micro-batch, before any update;
  train      num_iterations passes over the cycle's optimizer steps; step i's completions are those of its own
             prompts on every layout (prompt j of a generation batch belongs to step j // prompts_per_step and,
             inside it, to rank (j % prompts_per_step) // prompts_per_rank).

Every micro-batch's loss is scaled by the optimizer step's global counts (grpo_loss.StepNormaliser: one
all-reduce in begin_step), so the engines' mean over micro-batches and ranks is the loss of one process holding
the whole global batch.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch

from ..distributed.agree import agree
from ..distributed.collectives import is_distributed, reduce_sum
from ..errors import UserError
from ..model import lora
from ..model.facts import kv_cache_of
from ..model.memory_reducers import installed_chunk
from ..plan.rl_cycle import cycle_of
from .grpo_loss import METRICS as LOSS_AND_SAMPLING_METRICS
from .grpo_loss import GRPOLoss, StepNormaliser, advantages, sampling_difference_sums, step_metrics
from .preference import shifted_labels, token_logps
from .recipes.base import ObjectiveOutput
from .rewards import RewardModel, decode_completions, make_trainer_state, reward_metrics, total_reward

COMPLETIONS_FILE = "completions.jsonl"
"""Under the run dir: the generation batch's completions with their rewards, every rl.log_completions_every steps."""
OBJECTIVE_METRICS = LOSS_AND_SAMPLING_METRICS
"""The step figures of the loss (TRL's names) a record carries beside the generation's."""


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + int(p)) % (2**63 - 1)
    return value


def _order(n: int, seed: int, epoch: int) -> list[int]:
    """The epoch's prompt order: a pure function of (seed, epoch), as the other tasks' data order."""
    g = torch.Generator().manual_seed(_seed(seed, epoch, 17))
    return torch.randperm(n, generator=g).tolist()


# --- the objective: what Engine.train_step runs per micro-batch ---------------------------------------------
def completion_logps(engine_or_model: Any, batch: dict[str, torch.Tensor], temperature: float,
                     entropies: bool = False, forward: Optional[dict] = None,
                     chunked: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[rows, width] per-token log-probs of each next token (TRL: of logits / temperature), 0 where no label;
    with entropies, each position's entropy of the same distribution (no grad). forward: filled with the model's
    output (its router loss, for the objective). chunked (--chunked-loss: the model's forward was given the
    chunked head, zerotrain/model/memory_reducers.py): the head runs over chunks of that many tokens, recomputed
    in backward, so the [rows, width, vocab] logits never exist whole."""
    labels = shifted_labels(batch["input_ids"], batch["attention_mask"])
    if chunked:
        out = engine_or_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                              token_logps_of=labels, logps_temperature=temperature, token_entropies=entropies)
        if forward is not None:
            forward["aux_loss"] = out.get("aux_loss")
        return out["token_logps"], out.get("token_entropies") if entropies else None
    out = engine_or_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    if forward is not None:
        forward["aux_loss"] = out.get("aux_loss")
    logits = out.logits.float() / temperature
    logps = token_logps(logits, labels)
    ent = None
    if entropies:
        with torch.no_grad():
            logp_all = torch.log_softmax(logits, dim=-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logps, ent


class GRPOObjective:
    """The GRPO loss of a micro-batch of completions (the online-RL recipe's objective)."""

    def __init__(self, loss: GRPOLoss, temperature: float, router_coef: Optional[float] = None, chunked: int = 0):
        self.loss, self.temperature, self.chunked = loss, temperature, chunked
        self.router_coef = router_coef
        """--router-aux-coef: a mixture of experts' load-balancing loss added to the policy loss (as for the other
        tasks; None or 0: not added)."""
        self._norm: Optional[StepNormaliser] = None
        self.dapo_tokens: Optional[float] = None
        """dapo with several steps per generation: TRL divides by the generation batch's tokens per step (its
        num_items_in_batch), not by the step's own; set by each generation (None: the step's own)."""

    def begin_step(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """The step's global counts (one all-reduce): completions and completion tokens of every micro-batch and
        rank, what the loss divides by."""
        local = [float(sum(b["advantages"].numel() for b in micro_batches)),
                 float(sum(float(b["completion_mask"].sum()) for b in micro_batches))]
        completions, tokens = reduce_sum(*local)
        self._norm = StepNormaliser(completions=int(completions), tokens=tokens,
                                    micro_batches=engine.plan.batch.step_micro_batches, dapo_tokens=self.dapo_tokens)

    def __call__(self, engine: Any, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        forward: dict[str, Any] = {}
        logps, ent = completion_logps(engine, batch, self.temperature, entropies=True, forward=forward,
                                      chunked=self.chunked)
        mask = batch["completion_mask"].to(logps.dtype)
        old = batch.get("old_logps")
        out = self.loss(logps, old, batch.get("ref_logps"), batch["advantages"].to(logps.dtype),
                        mask, self._norm, entropies=ent)
        aux, loss = forward.get("aux_loss"), out.loss
        if aux is not None and self.router_coef:
            loss = loss + self.router_coef * aux
        sums = dict(out.sums)
        if "sampling_logps" in batch:  # the generation's log-probs against the training forward's before any update
            before = (old if old is not None else logps.detach()).to(logps.dtype)
            sums.update(sampling_difference_sums(before, batch["sampling_logps"].to(logps.dtype), mask))
        return ObjectiveOutput(loss, sums, aux.detach() if aux is not None else None)

    def close(self, engine: Any) -> None:
        engine.release_auxiliary("reference")


objective_figures = step_metrics
"""The step's objective metrics under TRL's names, from the sums over micro-batches and ranks (StepFigures finish)."""


# --- rollouts -----------------------------------------------------------------------------------------------
@dataclass
class Generation:
    """One generation batch of this rank, split by optimizer step of the cycle."""

    steps: list[list[dict[str, torch.Tensor]]]
    """[step of the generation batch] -> its grad_accum collated micro-batches of this rank."""
    figures: dict[str, float]
    """The generation batch's reward and completion metrics (TRL's names), the same on every rank."""
    shown: list[dict[str, Any]] = field(default_factory=list)
    """Every completion of the generation batch (every rank's, in generation order) with its prompt, reward and
    advantage (rl.log_completions_every; empty without it)."""


@dataclass(frozen=True)
class Rollouts:
    """How a grpo run's rollouts generate: the start banner's "rollouts:" phrase and metrics.jsonl's "rollouts"
    event record."""

    engine: str
    """rl.rollout_engine: batched or exact."""
    rows_per_call: int
    """Completions a rank's largest rollout `generate` call samples (Cycle.rows_per_call)."""
    kv_cache: str
    """The calls' KV cache: dynamic, static, or the model's own (model/facts.py kv_cache_of)."""

    def phrase(self) -> str:
        return f"rollouts: {self.engine} engine, {self.rows_per_call} rows per call, {self.kv_cache} KV cache"

    def record(self, step: int) -> dict[str, Any]:
        """metrics.jsonl's record of them, written when the run starts (at its first step: 0, or the resumed one)."""
        return {"event": "rollouts", "step": step, **asdict(self)}


class OnlineRL:
    """The rollout side of a grpo run: generates, scores and batches completions for the trainer."""

    def __init__(self, setup: Any, engine: Any):
        cfg = setup.cfg
        self.cfg, self.rl, self.engine, self.data = cfg, cfg.rl, engine, setup.data
        b = engine.plan.batch
        self.cycle = cycle_of(cfg, b.global_batch, b.grad_accum, engine.plan.world.dp)
        self.micro_batch, self.grad_accum = b.micro_batch, b.grad_accum
        self.beta = setup.plan.task.beta(cfg)
        rl = self.rl
        self.loss = GRPOLoss(loss_type=rl.loss_type, beta=self.beta, epsilon_low=rl.epsilon,
                             epsilon_high=rl.epsilon_high if rl.epsilon_high is not None else rl.epsilon,
                             importance_sampling_level=rl.importance_sampling_level,
                             max_completion_len=rl.max_completion_len)
        # the policy's head as the preparation chunked it (--chunked-loss, else grpo's default: model/preparation.py
        # loss_chunk), and a reference copy's alike
        self.chunked = installed_chunk(engine.hf_model)
        self.objective = GRPOObjective(self.loss, rl.temperature, engine.router_aux_coef, self.chunked)
        self.rewards = setup.rewards  # loaded in preflight, before any engine (a reward model is never partitioned)
        for reward in self.rewards.rewards:  # a reward model runs where the policy does (this rank's device)
            if isinstance(reward, RewardModel):
                reward.model.to(engine.device)
        self.rewards.device = engine.device
        self.tokenizer = setup.source.tokenizer
        self.pad_id = setup.data.pad_id
        self.keep_old = self.cycle.steps > 1  # trained on after an update: the ratio needs the sampling policy's
        self.reference = None
        ref = setup.plan.task.reference(cfg)
        what = "none (beta 0)"
        if ref is not None:
            if ref.adapters_off:
                self.reference = ("adapters_off", engine.hf_model.disable_adapter)
                what = "the policy with its LoRA adapters disabled"
            else:
                from .reference import frozen_copy

                self.reference = ("copy", frozen_copy(engine, setup.model_factory(), self.chunked))
                what = "a frozen copy of the starting weights"
        self.current: Optional[Generation] = None
        self._cycle_key: Optional[tuple[int, int]] = None
        self.saved_state: Any = None
        """This rank's `state` from the checkpoint resumed (the online-RL recipe's restore_rank_state; None: none)."""
        self.rollouts = Rollouts(rl.rollout_engine, self.cycle.rows_per_call(rl.rollout_engine, rl.rollout_rows),
                                 kv_cache_of(lora.unwrapped(engine.hf_model), rl.cache_implementation))
        if engine.is_main:
            c = self.cycle
            print(f"zerotrain: grpo loss {rl.loss_type} ({rl.importance_sampling_level} ratios, epsilon "
                  f"{rl.epsilon}/{self.loss.epsilon_high}), beta {self.beta}, reference: {what}; "
                  f"{c.num_generations} completions per prompt, {c.prompts_per_step} prompts per step, a generation "
                  f"every {c.steps_per_generation} step(s), {c.num_iterations} pass(es) over it; "
                  f"{self.rollouts.phrase()}; rewards: "
                  f"{', '.join(f'{n} x{w:g}' for n, w in zip(self.rewards.names, self.rewards.weights.tolist()))}",
                  flush=True)

    # the trainer's data source -------------------------------------------------------------------------------
    def batches(self, epoch: int, position: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches from optimizer step `position` of `epoch` on (grad_accum per step),
        generating at the start of every cycle."""
        c = self.cycle
        while True:
            generation, within = divmod(position, c.steps)
            if self._cycle_key != (epoch, generation):
                if within:  # resumed inside a cycle: its completions and old log-probs come from the checkpoint
                    self._restore(epoch, generation, within)
                else:
                    self.current = self._generate(epoch, generation)
                    self._cycle_key = (epoch, generation)
            yield from self.current.steps[within % c.steps_per_generation]
            position += 1

    def _generate(self, epoch: int, generation: int) -> Generation:
        from ..backends.generation import SamplingParams

        e, c, rl = self.engine, self.cycle, self.rl
        order = _order(len(self.data.train), self.cfg.run.seed, epoch)
        first = generation * c.prompts_per_generation
        rank = e.dp_rank
        mine = [j for j in range(c.prompts_per_generation) if c.owner(j)[1] == rank]
        eos = self.tokenizer.eos_token_id
        params = SamplingParams(max_new_tokens=rl.max_completion_len, temperature=rl.temperature, top_p=rl.top_p,
                                top_k=rl.top_k, eos_token_id=eos, pad_token_id=self.pad_id, gather=rl.generation_gather,
                                cache_implementation=rl.cache_implementation)
        rows: list[dict[str, Any]] = []
        started = time.perf_counter()
        dataset_rows = [self.data.train[order[first + j]] for j in mine]
        prompts = [torch.as_tensor(row["prompt_ids"], dtype=torch.long) for row in dataset_rows]
        seeds = [_seed(self.cfg.run.seed, epoch, generation, j) for j in mine]
        with e.generation_phase(params) as gen:
            if rl.rollout_engine == "batched":
                groups = gen.generate_batch([p.to(e.device) for p in prompts], c.num_generations, seeds,
                                            rl.rollout_rows)
            else:  # exact: each prompt's group in a call of its own (bitwise the same on every layout)
                groups = [gen.generate(p.to(e.device), c.num_generations, s) for p, s in zip(prompts, seeds)]
            for j, row, prompt, done in zip(mine, dataset_rows, prompts, groups):
                for g in range(c.num_generations):
                    n = int(done.lengths[g])
                    rows.append({"j": j, "g": g, "row": row, "prompt_ids": prompt,
                                 "completion_ids": done.completion_ids[g, :n].cpu(),
                                 "sampling_logps": done.sampling_logps[g, :n].cpu(),
                                 "truncated": bool(done.truncated[g])})
        phase_s = time.perf_counter() - started  # gather, generate and release: the whole phase on this rank
        agree(lambda: self._score(rows, first, epoch), "--reward-funcs")  # a reward error on one rank ends every rank
        gathered = self._gather(rows, phase_s)
        adv, reward_figs = advantages(gathered["total"], c.num_generations, rl.scale_rewards)
        # this rank's rows' advantages, by their place in the generation batch
        place = {(int(j), int(g)): i for i, (j, g) in enumerate(gathered["index"].tolist())}
        for r in rows:
            r["advantage"] = float(adv[place[(r["j"], r["g"])]])
        if c.steps_per_generation > 1:  # TRL's dapo divisor: the generation batch's completion tokens per step
            self.objective.dapo_tokens = self._generation_tokens(gathered) / c.steps_per_generation
        figures = dict(reward_figs)
        figures.update(self._reward_figures(gathered))
        figures.update(_length_figures(gathered["length"], gathered["truncated"]))
        slowest = float(gathered["phase_s"].max())  # the phase ends when its slowest rank's does
        figures.update({"generation_s": slowest,
                        "generation_tokens_per_s": float(gathered["length"].sum()) / slowest if slowest > 0 else 0.0})
        steps = []
        for s in range(c.steps_per_generation):
            step_rows = [r for r in rows if c.owner(r["j"])[0] == s]
            micro = [self._collate(step_rows[i * self.micro_batch:(i + 1) * self.micro_batch])
                     for i in range(self.grad_accum)]
            steps.append(micro)
        self._remember(steps)
        shown = [{**row, "advantage": float(adv[i])} for i, row in enumerate(gathered.get("shown", []))]
        return Generation(steps, figures, shown)

    def _score(self, rows: list[dict[str, Any]], first: int, epoch: int) -> None:
        """Each of this rank's completions' rewards (the reward functions run where the completion is), with
        TRL's keyword arguments: the dataset's other columns, one entry per completion."""
        if not rows:
            return
        skip = {"prompt", "prompt_ids", "prompt_index"}
        ids = [r["completion_ids"].tolist() for r in rows]
        completions = decode_completions(self.tokenizer, ids, isinstance(rows[0]["row"]["prompt"], list))
        columns = {k: [r["row"][k] for r in rows] for k in rows[0]["row"] if k not in skip}
        e = self.engine
        per_func = self.rewards.score([r["row"]["prompt"] for r in rows], completions, ids, columns,
                                      first_index=first + rows[0]["j"],
                                      trainer_state=make_trainer_state(e.global_step, e.plan.total_steps, epoch))
        total = total_reward(per_func, self.rewards.weights)
        for r, t, pf, text in zip(rows, total.tolist(), per_func, completions):
            r["total"], r["per_func"], r["completion"] = t, pf, text

    def _gather(self, rows: list[dict[str, Any]], phase_s: float) -> dict[str, torch.Tensor]:
        """The generation batch's rewards, lengths and truncation from every rank, in generation order, every
        rank's generation-phase seconds ("phase_s", one per rank) and, with rl.log_completions_every, every
        completion's prompt, text and reward ("shown", in generation order)."""
        local = {"index": torch.tensor([[r["j"], r["g"]] for r in rows], dtype=torch.long).reshape(-1, 2),
                 "total": torch.tensor([r["total"] for r in rows], dtype=torch.float32),
                 "per_func": torch.stack([r["per_func"].cpu() for r in rows]) if rows
                 else torch.zeros((0, len(self.rewards.names))),
                 "length": torch.tensor([len(r["completion_ids"]) for r in rows], dtype=torch.float32),
                 "truncated": torch.tensor([r["truncated"] for r in rows], dtype=torch.bool)}
        mine: dict[str, Any] = {**local, "phase_s": phase_s}
        if self.rl.log_completions_every:  # TRL logs the whole generation batch's completions, every rank's
            mine["shown"] = [{"prompt": r["row"]["prompt"], "completion": r["completion"], "reward": r["total"]}
                             for r in rows]
        parts = [mine]
        if is_distributed():
            import torch.distributed as tdist

            parts = [None] * tdist.get_world_size()
            tdist.all_gather_object(parts, mine)
        merged = {k: torch.cat([p[k] for p in parts]) for k in local}
        order = torch.argsort(merged["index"][:, 0] * self.cycle.num_generations + merged["index"][:, 1])
        out = {k: v[order] for k, v in merged.items()}
        out["phase_s"] = torch.tensor([p["phase_s"] for p in parts], dtype=torch.float64)
        if "shown" in mine:  # in generation order, as the advantages
            rows_shown = [row for p in parts for row in p["shown"]]
            out["shown"] = [rows_shown[i] for i in order.tolist()]
        return out

    def _generation_tokens(self, gathered: dict[str, torch.Tensor]) -> float:
        """Completion tokens the loss counts in the whole generation batch (every rank's, already gathered)."""
        counted = ~gathered["truncated"] if self.rl.mask_truncated_completions else torch.ones_like(gathered["truncated"])
        return float(gathered["length"].double()[counted].sum())

    def _reward_figures(self, gathered: dict[str, torch.Tensor]) -> dict[str, float]:
        """TRL's rewards/<name>/mean and /std over the whole generation batch (gathered: every rank alike)."""
        return reward_metrics(gathered["per_func"].cpu(), self.rewards.names)

    def _collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Prompt + completion per row, right-padded (positions are the row's own: no left padding), with the
        completion mask in label space (mask[t] is the token at t + 1), the generation's log-probs of the sampled
        tokens in the same space, and each row's advantage."""
        width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        comp = torch.zeros((len(rows), width), dtype=torch.float32)
        sampling = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, r in enumerate(rows):
            p, n = len(r["prompt_ids"]), len(r["completion_ids"])
            ids[i, :p] = r["prompt_ids"]
            ids[i, p:p + n] = r["completion_ids"]
            attn[i, :p + n] = 1
            sampling[i, p - 1:p + n - 1] = r["sampling_logps"]
            if not (self.rl.mask_truncated_completions and r["truncated"]):
                comp[i, p - 1:p + n - 1] = 1.0
        return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp, "sampling_logps": sampling,
                "advantages": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)}

    @torch.no_grad()
    def _remember(self, steps: list[list[dict[str, torch.Tensor]]]) -> None:
        """The old (sampling) policy's and the reference's per-token log-probs of every micro-batch, before any
        update of the cycle (every rank runs the same forwards: ZeRO-3 / FSDP2 gather inside)."""
        if not self.keep_old and self.reference is None:
            return
        e = self.engine
        was_training = e.module.training
        e.eval()
        try:
            for micro in steps:
                for batch in micro:
                    on = e.to_device(batch)
                    t, chunked = self.rl.temperature, self.chunked
                    if self.keep_old:
                        batch["old_logps"] = completion_logps(e, on, t, chunked=chunked)[0].cpu()
                    if self.reference is not None:
                        kind, held = self.reference
                        if kind == "copy":
                            batch["ref_logps"] = completion_logps(held, on, t, chunked=chunked)[0].cpu()
                        else:
                            with held():
                                batch["ref_logps"] = completion_logps(e, on, t, chunked=chunked)[0].cpu()
        finally:
            if was_training:
                e.train()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's rollouts (the recipe's rank_state, when a cycle spans several
        steps): the generation batch in flight with its old and reference log-probs, so a resume inside its cycle
        trains on exactly the same completions."""
        return {"cycle": self._cycle_key, "dp": self.cycle.prompts_per_step // self.cycle.prompts_per_rank,
                "generation": self.current, "dapo_tokens": self.objective.dapo_tokens}

    def _restore(self, epoch: int, generation: int, within: int) -> None:
        saved = self.saved_state
        if not saved or tuple(saved["cycle"] or ()) != (epoch, generation):
            raise UserError(f"--resume inside a generation cycle (step {within} of {self.cycle.steps}): the checkpoint "
                            "does not hold this rank's completions of that cycle (it was written on another world size "
                            "or before zerotrain kept them); resume on the world size it was written on, or from a "
                            "checkpoint at a cycle boundary")
        self.current, self.objective.dapo_tokens = saved["generation"], saved["dapo_tokens"]
        self._cycle_key = (epoch, generation)

    # what the trainer reports --------------------------------------------------------------------------------
    def step_figures(self, position: int) -> dict[str, float]:
        """The generation metrics a step's record carries: on the step that generated, its batch's."""
        return dict(self.current.figures) if position % self.cycle.steps == 0 and self.current else {}

    def completions_to_log(self, step: int) -> list[dict[str, Any]]:
        """rl.log_completions_every: the generation batch's completions (every rank's, as TRL logs them) with their
        rewards and advantages at this step (rank 0 writes them: OUTPUT/completions.jsonl and a W&B table); [] on
        the other steps."""
        every = self.rl.log_completions_every
        if not every or step % every or self.current is None:
            return []
        return list(self.current.shown)

    def close(self) -> None:
        self.objective.close(self.engine)


def _length_figures(length: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completion-length metrics of a generation batch."""
    done = length[~truncated]
    return {"completions/mean_length": float(length.mean()), "completions/min_length": float(length.min()),
            "completions/max_length": float(length.max()), "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(done.mean()) if done.numel() else 0.0}
