"""The training loop: accumulation, LR schedule, eval, checkpoint cadence, exact resume.

`Trainer(setup, engine).fit()` runs on every rank with the engine, on the RunSetup that
zerotrain/train/preflight.py resolved. Every branch it takes depends only on values that are identical on
all ranks (step counters, the plan), so no rank ever enters a collective alone (the ZeRO-3 hang). A
failure that can hit one rank only (loading its checkpoint shard, rank 0 writing files) goes through
`agree` (zerotrain/distributed/agree.py), which tells every rank to stop together.

Exact resume: the checkpoint's client_state holds the epoch, the optimizer steps done in that epoch
and the seed; data order is a pure function of (seed, epoch) and the RNG is reseeded from
(seed, global step, rank) before every optimizer step, so a resumed run replays the same batches and
dropout masks as an uninterrupted one. A --streaming run's data position is each rank's stream position instead
(client_state "stream", zerotrain/data/streaming.py).

The loop is the same for every kind: what differs (the micro-batch source, the objective, the evaluation, the step
figures, the checkpoint state, the teardown) is the task's recipe's (zerotrain/train/recipes/, RunPlan.task.recipe).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..backends.base import Engine
from ..backends.checkpointing import CheckpointExtras, Loaded
from ..checkpoint import store as ck
from ..checkpoint.async_save import PendingSave
from ..config.load import to_yaml
from ..config.rules import report_targets
from ..data.datasets import real_tokens
from ..data.mixture import SOURCE_COUNTS, share_figures, shares_line
from ..distributed import faults
from ..distributed.agree import BAD_FILE_ERRORS, agree, mark_agreed
from ..distributed.preemption import Agreed, Preempted, StopSignal
from ..distributed.watchdog import HangWatchdog
from ..errors import UserError
from ..memory.measure import record_model_state
from ..model import lora
from ..model.compile import CompileWatch
from ..util import human_bytes
from .metrics import MetricsWriter, Progress, StepFigures, StepTimer
from .preflight import RunSetup
from .recipes.base import Recipe, build_recipe
from .restarts import Resumption, resumption
from .trackers import flat_params


def _reseed(seed: int, step: int, rank: int) -> None:
    # Dropout etc. depend only on (seed, step, rank), so a resumed run draws the same numbers.
    # Not torch.manual_seed: it also queues lazy seeding for every accelerator type and formats a
    # stack trace for each (0.9 ms per step, profiled); this rank only needs the CPU and its GPU.
    value = (seed * 1_000_003 + step * 7_919 + rank) % (2**63 - 1)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(value)


PREEMPTION_SAVE = "the preemption checkpoint"
"""Trainer._failed_saves: the save a preempted run stops with (lost: the run stops non-zero, not PREEMPTED_EXIT)."""


@dataclass
class PendingRecord:
    """A logged step's record whose cross-rank figures are gathered at the next step boundary (metrics.StepFigures)."""

    head: dict[str, Any]
    figures: StepFigures

    def record(self) -> dict[str, Any]:
        f = self.figures.result()
        h = self.head
        router = {}
        if "router_aux_loss" in f:  # loss is what trained: the LM loss + coef x the router loss
            router = {"lm_loss": f["loss"] - h["router_aux_coef"] * f["router_aux_loss"],
                      "router_aux_loss": f["router_aux_loss"]}
        if "expert_tokens" in f:
            router.update(expert_tokens=f["expert_tokens"], expert_imbalance=f["expert_imbalance"])
        router.update(h.get("objective_figures", {}))  # the recipe's (Recipe.step_figures): online RL's generation
        router.update({k: f[k] for k in h.get("objective_names", ()) if k in f})  # the objective's metrics
        router.update({k: f[k] for k in f if k.startswith(("source_tokens/", "source_samples/"))})  # a mixture's
        norm = h["grad_norm"]  # read here, one step after it was computed (Engine.grad_norm_unread)
        return {"step": h["step"], "epoch": h["epoch"], "loss": f["loss"], "lr": h["lr"],
                "grad_norm": None if norm is None else float(norm),
                "tokens_per_s": f["tokens_per_s"], "samples_per_s": f["samples_per_s"],
                "step_time_s": f["step_time_s"], "peak_mem_bytes": f["peak_mem_bytes"], "tokens": int(f["tokens"]),
                **({"peak_gpu_mem_bytes": f["peak_gpu_mem_bytes"]} if self.figures.device == "cuda" else {}), **router}


class Trainer:
    """Runs the plan on an engine: train, log, evaluate, checkpoint, export."""

    def __init__(self, setup: RunSetup, engine: Engine):
        self.s, self.engine = setup, engine
        self.cfg, self.plan = setup.cfg, setup.plan
        self.main = engine.is_main
        self.epoch = 0
        self.position = 0
        """Optimizer steps already done in the current epoch."""
        self.start_step = 0
        self.history: list[dict] = []
        self.compile_watch: Optional[CompileWatch] = None
        """--compile: graphs compiled and compile time, step by step (set by fit)."""
        self.resumption: Optional[Resumption] = None
        """What this run continues (set when resuming): the banner line and metrics.jsonl's resume record."""
        self.last_saved = -1
        """The step of the newest checkpoint committed or being written (-1: none this run; set by fit)."""
        self.recipe: Optional[Recipe] = None
        """The task's recipe (RunPlan.task.recipe): micro-batch source, objective, evaluation, step figures (set by
        start)."""
        self.extras = CheckpointExtras()
        """What every checkpoint holds beside the backend's state and the client state (the tokenizer, the data
        record, the recipe's rank state; set by start)."""
        self.last_eval: dict[str, float] = {}
        """The newest evaluation's record (set by fit)."""
        self.pending: Optional[PendingRecord] = None
        """A logged step's record whose figures ride on the next step boundary (set by fit)."""

    # --- setup after the engine exists -------------------------------------------------------
    def start(self) -> None:
        """Load the checkpoint (if resuming), then clear an overwritten run, write the run's configs, and build the
        task's recipe and its objective (on every rank)."""
        run_dir, e = self.s.run_dir, self.engine
        self.recipe = build_recipe(self.s, e)
        loaded = self._resume() if self.s.resume_from is not None else Loaded({}, None)
        state = loaded.client_state
        self.start_step = e.global_step
        self.epoch = self.recipe.source.start(state, self.epoch)

        def write() -> None:
            if not self.main:
                return
            if self.s.clears_previous_run:
                run_dir.clear()
            run_dir.root.mkdir(parents=True, exist_ok=True)
            run_dir.run_config.write_text(to_yaml(self.cfg))
            backend_config = e.backend_config()
            if backend_config is not None:
                run_dir.backend_config.write_text(json.dumps(backend_config, indent=2, sort_keys=True) + "\n")

        agree(write, "--output", bad_input=(OSError,))
        self.recipe.objective = self.recipe.make_objective()  # the task's loss (and its reference); None: the model's
        self.recipe.restore_rank_state(loaded.rank_state)
        # a resume packs the same way and keeps the global batch (zerotrain/plan/resolve.py keep_global_batch)
        data_record = {"text_packing": self.s.data.text_packing, "global_batch": self.plan.batch.global_batch}
        if self.s.data.mixture is not None:  # a resume mixes the same rows the same way (train/preflight.py)
            data_record["mixture"] = self.s.data.mixture.record()
        self.extras = CheckpointExtras(tokenizer=self.s.source.preprocessor, data_record=data_record,
                                       rank_state=self.recipe.rank_state())

    def _resume(self) -> Loaded:
        """Load the checkpoint (every rank agrees) and check it continues this run; its client_state and this
        rank's state."""
        loaded = agree(lambda: self.engine.load_checkpoint(self.s.resume_from), f"--resume {self.s.resume_from}",
                       bad_input=BAD_FILE_ERRORS)
        state = loaded.client_state
        self.recipe.source.check_resume(state)  # a stream position is no (epoch, step) and back
        self.epoch = int(state.get("epoch", 0))
        self.position = int(state.get("position", 0))
        if int(state.get("seed", self.cfg.run.seed)) != self.cfg.run.seed:
            raise UserError(f"--seed {self.cfg.run.seed}: the checkpoint was trained with --seed {state['seed']}; "
                            "resume with the same seed (data order depends on it)")
        b = self.plan.batch
        if state.get("global_batch") not in (None, b.global_batch):
            # The data position is (epoch, optimizer steps): it only means the same samples if
            # every step still takes the same number of them.
            raise UserError(f"--resume: the checkpoint was trained with a global batch of {state['global_batch']}, "
                            f"this run has {b.global_batch} (micro-batch {b.micro_batch} x grad-accum {b.grad_accum} "
                            f"x {self.plan.world.dp} ranks); pass --global-batch {state['global_batch']}")
        if state.get("steps_per_epoch") not in (None, self.plan.steps_per_epoch):
            raise UserError("--resume: the data or batch size changed since the checkpoint (steps per epoch "
                            f"{state['steps_per_epoch']} -> {self.plan.steps_per_epoch}); resume with the same "
                            "--data, --seq-len and global batch (on another world size pass --global-batch "
                            "with the old value)")
        self.resumption = resumption(self.s.resume_from, ck.read_meta(self.s.resume_from).world_size,
                                     self.plan.world.world_size, self.engine.global_step, b.global_batch,
                                     b.grad_accum, self.s.run_dir.metrics)
        if self.main:
            print(self.resumption.line(), flush=True)
        return loaded

    # --- steps ---------------------------------------------------------------------------------
    def _client_state(self) -> dict[str, Any]:
        epoch, pos = self.epoch, self.position
        if self.plan.steps_per_epoch is not None and pos >= self.plan.steps_per_epoch:
            epoch, pos = epoch + 1, 0
        return {"epoch": epoch, "position": pos, "seed": self.cfg.run.seed, "global_step": self.engine.global_step,
                "steps_per_epoch": self.plan.steps_per_epoch, "global_batch": self.plan.batch.global_batch,
                "total_steps": self.plan.total_steps,
                "rng": "reseeded from (seed, global_step, rank) before every optimizer step",
                **self.recipe.source.checkpoint_state()}  # collective (a stream's position after the last step)

    def save(self) -> Path:
        return self.engine.save_checkpoint(self.s.run_dir.checkpoints, self._client_state(), self.extras)

    def evaluate(self) -> dict[str, float]:
        """The task's eval figures (tasks.TaskSpec.eval_metrics, in that order) over the whole eval set (the recipe's
        evaluation); every replica runs the same number of batches."""
        out, names = self.recipe.evaluate(self), self.plan.task.eval_metrics
        assert set(out) <= set(names), f"{sorted(set(out) - set(names))} are no eval metric of the task"
        return {k: out[k] for k in names if k in out}

    def fit(self) -> dict[str, Any]:
        """Train to plan.total_steps; returns the summary figures."""
        e, plan, run, source = self.engine, self.plan, self.cfg.run, self.recipe.source
        self._open()
        t0 = time.perf_counter()
        e.train()
        self.last_saved = self.start_step if self.s.resume_from is not None else -1
        micro: Optional[list[dict[str, torch.Tensor]]] = None
        label_tokens: Optional[float] = None
        fetched_at = 0.0
        try:
            if e.global_step < plan.total_steps:
                self.watchdog.arm(e.global_step)  # the first fetch and exchange are watched too
                micro, fetched_at = self._fetch()
                if source.ahead:  # a SIGTERM before the first step is acted on at the boundary after it
                    label_tokens = self._boundary(micro)[1]
            while e.global_step < plan.total_steps:
                self.epoch = source.begin_step(self.epoch)  # the step's data: its epoch (a stream's own)
                new = self._train_step(micro, label_tokens, fetched_at)
                self.watchdog.arm(e.global_step)  # the step finished: its number is what a dump names
                self._compiled("train")
                self.recipe.after_step(self.writer, e.global_step)
                self.position += 1
                self._settle()
                if new is None:  # a step --log-every does not log: counted, nothing read from the device
                    self.bar.update()
                self.pending = new
                step = e.global_step
                if self.s.data.eval is not None and _due(run.eval_every, step, plan.total_steps):
                    self._evaluate_at(step)
                if _due(run.save_every, step, plan.total_steps):
                    self._save_at(step)
                self._failed_saves(self.writer, self.bar)
                faults.after_step(e.rank, step)  # only under a test's $ZEROTRAIN_FAULT
                more = step < plan.total_steps
                micro, fetched_at = self._fetch() if more and source.ahead else (None, 0.0)
                label_tokens = self._step_boundary(micro, step)
                if more and not source.ahead:
                    micro, fetched_at = self._fetch()
            self._finish()
        finally:
            self.watchdog.close()
            self.stop.close()
            self.bar.close()
            self.writer.close()
        return self._summary(time.perf_counter() - t0, self.last_eval)

    # --- fit's parts ---------------------------------------------------------------------------
    def _open(self) -> None:
        """The run's metrics writer, progress bar, SIGTERM agreement, hang watchdog and compile watch."""
        e, plan, run = self.engine, self.plan, self.cfg.run
        trackers = report_targets(run.report_to) + (["tensorboard"] if run.tensorboard else [])
        self.writer = MetricsWriter(self.s.run_dir, self.main, trackers,
                                    self.start_step if self.s.resume_from is not None else None,
                                    params=flat_params(self.cfg.model_dump(mode="json")))
        if self.resumption is not None:
            self.writer.write(self.resumption.record())
        for record in self.recipe.start_records(self.start_step):  # e.g. how grpo's rollouts generate
            self.writer.write(record)
        self.bar = Progress(plan.total_steps, self.start_step, self.main)
        self.stop = StopSignal(e.rank, self.cfg.dist_timeout_s)  # SIGTERM: a checkpoint at the next step boundary
        self.watchdog = HangWatchdog(self.s.run_dir.root, e.rank, self.cfg.hang_timeout_s)
        self.compile_watch = CompileWatch() if plan.preparation.compile is not None else None

    def _compiled(self, during: str) -> None:
        """--compile: what compiled during the last step or evaluation (a record and a line)."""
        e = self.engine
        rec = self.compile_watch.after(e.global_step, during) if self.compile_watch is not None else None
        if rec is not None:
            self.writer.write(rec)
            self.bar.write(CompileWatch.line(rec, getattr(lora.unwrapped(e.hf_model), "_zt_compiled_blocks", 0)))

    def _settle(self) -> None:
        """Log the logged step's record: its figures ride on the step boundary's exchange, or, when the record must
        be written before that boundary (a checkpoint or an evaluation at its step), are gathered now."""
        pending = self.pending
        if pending is None:
            return
        if pending.figures.rows is None:
            pending.figures.take(self.stop.gather(pending.figures.local))
        rec, self.pending = pending.record(), None  # a step --log-every logs (_train_step)
        self.writer.write(rec)
        self.history.append(rec)
        self.bar.update(rec["loss"], rec["lr"], rec["tokens_per_s"], rec.get("reward"))

    def _fetch(self) -> tuple[list[dict[str, torch.Tensor]], float]:
        """The next optimizer step's micro-batches (the recipe's source; a new epoch when this one is used up),
        fetched before the step boundary where the source fetches ahead; and when fetching began."""
        started = time.perf_counter()
        if self.position >= (self.plan.steps_per_epoch or math.inf):  # a stream's epochs end where it does
            self.epoch, self.position = self.epoch + 1, 0
            self.recipe.source.new_epoch()
        _reseed(self.cfg.run.seed, self.engine.global_step, self.engine.rank)  # before: online RL samples inside it
        return self.recipe.source.next_step(self.epoch, self.position), started

    def _boundary(self, micro: Optional[list[dict[str, torch.Tensor]]], writing: bool = False,
                  failed: bool = False) -> tuple[Agreed, Optional[float]]:
        """The one collective between two steps (every rank decides alike): SIGTERM anywhere, a rank still writing
        an async checkpoint, a write failed; the next step's label tokens summed over ranks (None: its loss is not
        token-weighted) and the logged step's figures (the pending record's) ride on it."""
        local = self.engine.local_label_tokens(micro) if micro is not None else None
        pending = self.pending
        figures = pending.figures if pending is not None and pending.figures.rows is None else None
        agreed = self.stop.agree(writing, failed, [local or 0.0], figures.local if figures is not None else ())
        if figures is not None:
            figures.take(agreed.rows)
        return agreed, agreed.sums[0] if local is not None else None

    def _evaluate_at(self, step: int) -> None:
        """An evaluation at a step --eval-every names (not the last: _finish evaluates that one)."""
        self._settle()
        with self.watchdog.paused():  # evaluation and saves are bounded by --dist-timeout
            spe = self.plan.steps_per_epoch or math.inf
            self.last_eval = {"step": step, "epoch": round(self.epoch + self.position / spe, 6), **self.evaluate()}
        self._compiled("eval")
        self.writer.write(self.last_eval)
        self.bar.write(_fmt_eval(self.last_eval))

    def _committed(self, done: Optional[PendingSave], step: int) -> None:
        """The event of an --async-save committed at this step (done: None when none was, or it failed)."""
        if done is not None:
            self.writer.write({"event": "checkpoint_committed", "step": done.meta.global_step, "at_step": step,
                               "write_s": round(time.monotonic() - done.started_s, 4)})

    def _finish_pending(self) -> None:
        """Every rank: the --async-save in flight waited for and settled (a save commits the one before it)."""
        self._committed(self.engine.finish_pending_save(), self.engine.global_step)

    def _save_at(self, step: int) -> None:
        """A checkpoint at a step --save-every names (not the last: _finish saves that one)."""
        self._settle()  # metrics.jsonl holds this step before the checkpoint does
        with self.watchdog.paused():
            started = time.perf_counter()
            self._finish_pending()  # logged as committed before the next one begins
            self.save()
        # how long training stood still for it (--async-save: the copy to host memory only)
        self.writer.write({"event": "checkpoint", "step": step, "async": self.cfg.run.async_save,
                           "stall_s": round(time.perf_counter() - started, 4)})
        self.last_saved = step

    def _step_boundary(self, micro: Optional[list[dict[str, torch.Tensor]]], step: int) -> Optional[float]:
        """The boundary after a step: an --async-save every rank has written is committed; a SIGTERM on any rank
        saves this step on every rank and stops (Preempted). Returns the next step's label tokens."""
        e = self.engine
        ticket = e.pending_save.ticket if e.pending_save is not None else None
        agreed, label_tokens = self._boundary(micro, ticket is not None and not ticket.done(),
                                              ticket is not None and ticket.failed())
        if e.pending_save is not None and not agreed.still_writing:  # --async-save: every rank's written
            self._committed(e.commit_pending_save(agreed.write_failed), step)
            self._failed_saves(self.writer, self.bar)
        if agreed.stopping:  # SIGTERM on some rank: a checkpoint at this same step on every rank, then exit
            self._settle()
            with self.watchdog.paused():
                if self.last_saved != step:
                    self._finish_pending()
                    self.save()
                self._finish_pending()
            self._failed_saves(self.writer, self.bar, at_end=PREEMPTION_SAVE)
            raise Preempted(step, True, f"preempted (SIGTERM) after step {step}: checkpoint "
                                        f"{self.s.run_dir.checkpoints}/{ck.tag_for(step)} committed; "
                                        "continue with --resume auto")
        return label_tokens

    def _finish(self) -> None:
        """The end of the run: the final evaluation and checkpoint, the recipe's teardown, then final/."""
        e, run = self.engine, self.cfg.run
        self.watchdog.disarm()  # the final evaluation, save and export: bounded by --dist-timeout
        self._settle()
        self.bar.close()
        if self.s.data.eval is not None:
            spe = self.plan.steps_per_epoch or math.inf
            self.last_eval = {"step": e.global_step, "epoch": self.epoch + self.position / spe, **self.evaluate()}
            self._compiled("eval")
            self.writer.write(self.last_eval)
        if self.last_saved != e.global_step:
            self._finish_pending()
            self.save()
        self._finish_pending()  # --async-save: the last checkpoint is 'latest' before export and exit
        final_lost = self._failed_saves(self.writer, self.bar, at_end="the final checkpoint")
        self.recipe.close()  # the reference model, before the export gathers the policy
        if run.save_final:  # also when the last checkpoint was lost: the trained weights are in memory
            last = ck.newest_complete(self.s.run_dir.checkpoints)
            current = final_lost is None and last is not None and ck.step_of(last.name) == e.global_step
            e.save_hf(self.s.run_dir.final, self.s.source.preprocessor,
                      kept=f"every checkpoint; the latest, {last}, "
                           f"{'holds these weights' if current else 'is older than these weights'}; no partial final/",
                      fix=f"`zerotrain export {last} {self.s.run_dir.final}` writes it" if current
                      else "rerun with --resume auto")
        if final_lost is not None:
            written = f"; {self.s.run_dir.final}/ was written from memory" if run.save_final else ""
            self._stop_on_lost_save(final_lost, f"the final checkpoint of step {e.global_step},", written)

    def _failed_saves(self, writer: MetricsWriter, bar: Progress,
                      at_end: Optional[str] = None) -> Optional[ck.SaveFailure]:
        """Report the checkpoint saves that failed since the last call (Engine.save_failures, the same on every
        rank): a metrics.jsonl record and one warning line each (rank 0), and the run goes on from memory; the
        ck.MAX_FAILED_SAVES-th in a row stops the run. at_end ("the preemption checkpoint", "the final
        checkpoint"): a failure of this step's save is one the run cannot end without: the preemption one stops
        the run here, the final one is returned (final/ is exported before the run stops)."""
        e = self.engine
        failures, e.save_failures = e.save_failures, []
        lost: Optional[ck.SaveFailure] = None
        for f in failures:
            writer.write(f.record())
            if self.last_saved == f.step:  # lost: a preemption or the end saves this step again
                self.last_saved = -1
            if at_end is not None and f.step == e.global_step:
                lost = f
            elif f.in_a_row >= ck.MAX_FAILED_SAVES:
                self._stop_on_lost_save(f, f"{ck.MAX_FAILED_SAVES} checkpoint saves in a row failed; the last,")
            elif self.main:
                bar.write(f"zerotrain train: warning: {f.warning()}")
        if lost is not None and at_end == PREEMPTION_SAVE:
            self._stop_on_lost_save(lost, f"{at_end} of step {e.global_step},")
        return lost

    def _stop_on_lost_save(self, f: ck.SaveFailure, what: str, after: str = "") -> None:
        """Stop every rank with one line (rank 0 prints it; agreed: every rank raises it at the same point)."""
        kept = (f"the last complete checkpoint is {f.last_complete} (continue with --resume auto)"
                if f.last_complete else "no complete checkpoint was written")
        err = UserError(f"{what} {f.path}, was not saved ({f.line}); {kept}{after}; free space there or pass "
                        "another --output")
        mark_agreed(err)  # every rank learnt it from the same broadcast
        if not self.main:
            err.zerotrain_printed = True  # type: ignore[attr-defined]  # rank 0's line is the one
        raise err

    def _train_step(self, micro_batches: list[dict[str, torch.Tensor]], label_tokens: Optional[float],
                    fetched_at: float) -> Optional[PendingRecord]:
        """One optimizer step on micro-batches fetched (and the RNG reseeded) at the step boundary before it.
        label_tokens: their label tokens summed over ranks (that boundary's exchange; None: not token-weighted).
        Returns the step's record being gathered when --log-every logs this step, else None: then nothing of the
        step is read from the device (its loss and grad norm stay device tensors) and no figure is gathered."""
        e, plan = self.engine, self.plan
        lr = e.lr
        timer = StepTimer(plan.device, started=fetched_at)
        tokens = [real_tokens(b) for b in micro_batches]  # before the engine sees them
        sources = [b.pop(SOURCE_COUNTS) for b in micro_batches if SOURCE_COUNTS in b]  # a mixture's, likewise
        last_step = e.global_step == plan.total_steps - 1

        def after_backward(i: int) -> None:
            if i == 0 and last_step:
                record_model_state(e)  # only when $ZEROTRAIN_MODEL_STATE_DIR is set (zerotrain compare)

        losses = e.train_step(micro_batches, after_backward, label_tokens, self.recipe.objective)
        for batch, loss, n_tokens in zip(micro_batches, losses, tokens):
            rows = batch["pair_index"] if "pair_index" in batch else batch["input_ids"]  # a pair is one sample
            timer.add(loss, n_tokens, int(rows.shape[0]))  # host tensors
        timer.pair_sums = losses.objective_sums
        if sources:  # each source's tokens and rows, summed over ranks (zerotrain/data/mixture.py)
            timer.sums = share_figures(self.s.data.mixture.names, sum(sources).reshape(-1).tolist())
        extra = self.recipe.step_figures(timer, self.position)  # the objective's metrics (and online RL's generation)
        if e.expert_load is not None:  # a mixture of experts: its router loss and tokens per expert
            timer.router_aux = e.router_aux
            # every rank routes its own tokens (sp: its cut of the sequence) except tp ranks, which repeat them
            timer.expert_counts = e.expert_load.take() * (1.0 if plan.world.coordinate(e.rank, "tp") == 0 else 0.0)
        step = e.global_step
        if step % self.cfg.run.log_every and step != plan.total_steps:
            return None
        epoch = self.epoch + (self.position + 1) / (plan.steps_per_epoch or math.inf)
        head = {"step": step, "epoch": round(epoch, 6), "lr": lr, "grad_norm": e.grad_norm_unread(),
                "router_aux_coef": e.router_aux_coef or 0.0, **extra}
        return PendingRecord(head, timer.figures(plan.world.dp, plan.world.counts_for_data(e.rank)))

    def _summary(self, seconds: float, last_eval: dict[str, float]) -> dict[str, Any]:
        h = self.history
        steps = self.engine.global_step - self.start_step
        tokens = sum(r["tokens"] for r in h)
        return {"steps": steps, "global_step": self.engine.global_step, "seconds": seconds,
                "first_loss": h[0]["loss"] if h else None, "last_loss": h[-1]["loss"] if h else None,
                "tokens_per_s": tokens / sum(r["step_time_s"] for r in h) if h else 0.0,
                "peak_mem_bytes": max((r["peak_mem_bytes"] for r in h), default=0),
                "peak_gpu_mem_bytes": max((r.get("peak_gpu_mem_bytes", 0) for r in h), default=0),
                "sources": {k: sum(r.get(k, 0.0) for r in h) for k in (h[-1] if h else {}) if k.startswith("source_")},
                **(self.compile_watch.summary() if self.compile_watch is not None else {}), **{
                    k: v for k, v in last_eval.items() if k.startswith("eval_")}}


def _due(every: int, step: int, total: int) -> bool:
    """A cadence (--eval-every, --save-every; 0: never) names this step, and it is not the last (the end's own)."""
    return bool(every) and step % every == 0 and step < total


def _fmt_eval(rec: dict[str, Any]) -> str:
    parts = [f"step {rec['step']}", f"eval_loss {rec['eval_loss']:.4f}"]
    if "eval_perplexity" in rec:
        parts.append(f"perplexity {rec['eval_perplexity']:.2f}")
    if "eval_accuracy" in rec:
        parts.append(f"accuracy {rec['eval_accuracy']:.3f}")
    return "  ".join(parts)


def format_summary(summary: dict[str, Any], setup: RunSetup) -> str:
    """The few lines printed at the end of a run."""
    s = summary
    lines = [f"done: {s['steps']} steps (to step {s['global_step']}) in {s['seconds']:.1f} s"]
    if s["first_loss"] is not None:
        lines.append(f"  loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}   {s['tokens_per_s']:,.0f} tokens/s   "
                     f"peak memory {human_bytes(s['peak_mem_bytes'])} (largest rank)"
                     + (f", GPU {human_bytes(s['peak_gpu_mem_bytes'])}" if s.get("peak_gpu_mem_bytes") else ""))
    if s.get("sources"):  # a mixture: each source's share of the logged steps' tokens and rows
        lines.append("  " + shares_line(s["sources"]))
    if "compile_s" in s:
        lines.append(f"  compile: {s['compiled_graphs']} graph(s) in {s['compile_s']:.1f} s, {s['recompiles']} "
                     "recompile(s) after the first step")
    if "eval_loss" in s:
        lines.append("  " + _fmt_eval({"step": s["global_step"], **s}))
    d = setup.run_dir
    lines.append(f"  outputs: {d.metrics}  {d.checkpoints}/" + (f"  {d.final}/" if setup.cfg.run.save_final else ""))
    return "\n".join(lines)
