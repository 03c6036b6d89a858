"""The training loop: preflight checks, accumulation, LR schedule, eval, checkpoint cadence, exact resume.

Two phases:
- `preflight(cfg)` runs on every rank BEFORE any process group exists. It reads the same inputs on
  every rank (output dir, checkpoint meta, model config, tokenizer, data), so a bad input makes every
  rank fail the same way within seconds, and it writes nothing the previous run saved.
- `Trainer(setup, engine).fit()` runs on every rank with the engine. Every branch it takes depends
  only on values that are identical on all ranks (step counters, the plan), so no rank ever enters a
  collective alone (the ZeRO-3 hang). A failure that can hit one rank only (loading its checkpoint
  shard, rank 0 writing files) goes through `agree`, which tells every rank to stop together.

Exact resume: the checkpoint's client_state holds the epoch, the optimizer steps done in that epoch
and the seed; data order is a pure function of (seed, epoch) and the RNG is reseeded from
(seed, global step, rank) before every optimizer step, so a resumed run replays the same batches and
dropout masks as an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import pickle
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch

from . import checkpoint as ck
from .config import RunConfig, resolve_batch, to_yaml
from .data import PreparedData, eval_loader, prepare_data, steps_per_epoch, train_loader
from .errors import UserError, first_line
from .metrics import MetricsWriter, Progress, StepFigures, StepTimer, reduce_max, reduce_sum
from .memory import record_model_state
from .model import ModelBuilder, ModelSource, resolve_model
from .model_info import ModelFacts, facts_of
from .util import human_bytes

T = TypeVar("T")

# What a previous run leaves in its output dir; a fresh start refuses to write over any of it.
RUN_FILES = ("checkpoints", "final", "metrics.jsonl", "run_config.yaml", "ds_config.json", "tensorboard")
DEMO_LR = 1e-3
"""Peak LR of the embedded demo when --lr is not given: its model starts from random weights."""


# ------------------------------------------------------------------------------------------------
# preflight (no process group yet)

def check_output(cfg: RunConfig) -> Path:
    """The output dir must be writable and must not hold another run unless resuming or --overwrite."""
    out = Path(cfg.run.output).expanduser()
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"--output {cfg.run.output}: {probe} is a file, not a directory; pick another --output")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--output {cfg.run.output}: {probe} is not writable; pick a writable --output")
    if out.is_dir():
        try:  # os.access says yes to root even on a read-only file system: try for real
            fd, tmp = tempfile.mkstemp(prefix=".zerotrain-probe-", dir=out)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise UserError(f"--output {cfg.run.output}: not writable ({e.strerror}); pick a writable --output") from None
        found = [name for name in RUN_FILES if (out / name).exists() and not _empty_dir(out / name)]
        if found and not cfg.run.resume and not cfg.run.overwrite:
            raise UserError(f"--output {cfg.run.output} holds another run ({', '.join(found)}); pass --resume to "
                            "continue it, --overwrite to replace it, or choose a new --output")
    return out


def _empty_dir(p: Path) -> bool:
    return p.is_dir() and not any(p.iterdir())


@dataclass
class Plan:
    """Run length, the same on every rank."""

    world_size: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    steps_per_epoch: int
    total_steps: int


def make_plan(cfg: RunConfig, n_train: int, world: int) -> Plan:
    micro, accum, global_batch = resolve_batch(cfg, world)
    spe = steps_per_epoch(n_train, world, micro, accum)
    if spe == 0:
        raise UserError(f"--data: {n_train} training samples are fewer than one optimizer step needs "
                        f"({global_batch} = micro-batch {micro} x grad-accum {accum} x {world} ranks); "
                        "pass more data or lower --micro-batch / --grad-accum")
    total = cfg.run.max_steps or max(1, math.ceil(cfg.run.epochs * spe))
    return Plan(world, micro, accum, global_batch, spe, total)


@dataclass
class Setup:
    """Everything preflight resolved; identical on every rank."""

    cfg: RunConfig
    output: Path
    source: ModelSource
    data: PreparedData
    plan: Plan
    resume_from: Optional[Path]
    rank: int
    facts: ModelFacts
    """The model's size, shapes, blocks and family (model_info.facts_of the meta-device build)."""
    warnings: list[str] = field(default_factory=list)
    """One-line warnings about settings that run, but badly, on this device (printed by rank 0)."""

    def model_factory(self) -> ModelBuilder:
        return self.source.factory(self.data.num_labels, self.data.id2label, seed=self.cfg.run.seed)


def _check_resume(target: Path, model: torch.nn.Module, cfg: RunConfig, world: int) -> None:
    """Refuse a checkpoint of another model / backend, or a layout change it cannot follow, before starting."""
    meta = ck.read_meta(target)
    ck.check_compatible(meta, model, target)
    ck.check_layout(meta, target, world, cfg.zero.stage, nvme_optimizer=cfg.zero.offload_optimizer == "nvme")
    if cfg.backend != "auto" and meta.backend != cfg.backend:
        raise UserError(f"--resume {target}: written by the {meta.backend} backend; pass --backend {meta.backend}")


def preflight(cfg: RunConfig) -> Setup:
    """Validate every input and resolve model, data and run length. Raises UserError (one line)."""
    from . import dist
    from .config import check_device
    device_warnings = check_device(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    env = dist.env()
    if cfg.model.name is None and cfg.model.from_config is None and "lr" not in cfg.optimizer.model_fields_set:
        cfg.optimizer.lr = DEMO_LR  # the embedded model starts from random weights: 5e-5 would barely move it
    output = check_output(cfg)
    resume_from = ck.resolve_resume(output, cfg.run.resume)
    source = resolve_model(cfg)
    data = prepare_data(cfg, source.tokenizer)
    plan = make_plan(cfg, len(data.train), env.world_size)
    # the model on the meta device (no memory): class, config hash and facts without weights
    meta_model = source.factory(data.num_labels, data.id2label, seed=cfg.run.seed).empty()
    if resume_from is not None:
        _check_resume(resume_from, meta_model, cfg, env.world_size)
    return Setup(cfg, output, source, data, plan, resume_from, env.rank, facts_of(meta_model, meta_model.config),
                 device_warnings)


# ------------------------------------------------------------------------------------------------
# all ranks agree

class PeerFailed(UserError):
    """Another rank failed at the same point; its own error (line or traceback) says why."""


BAD_FILE_ERRORS = (OSError, EOFError, RuntimeError, pickle.UnpicklingError)
"""What reading a damaged or foreign file raises (torch.load of a truncated shard: RuntimeError or
UnpicklingError): under `agree` a user error about that file, named in one line."""


def agree(fn: Callable[[], T], what: str, bad_input: tuple[type[BaseException], ...] = ()) -> T:
    """Run fn on every rank; if it raised on any rank, raise on every rank (no rank left waiting).

    A UserError, and an exception of a `bad_input` type (wrapped as a one-line UserError naming
    `what`), are user errors; anything else is re-raised as it is, with its traceback. Ranks that
    did not fail raise PeerFailed."""
    err: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    (failed,) = reduce_max(0.0 if err is None else 1.0)
    if isinstance(err, bad_input) and not isinstance(err, UserError):
        raise UserError(f"{what}: {type(err).__name__}: {first_line(err)}") from err
    if err is not None:
        raise err
    if failed:
        raise PeerFailed(f"{what}: another rank failed (its error is printed above); stopping this rank too")
    return result


# ------------------------------------------------------------------------------------------------
# the loop

def _reseed(seed: int, step: int, rank: int) -> None:
    # Dropout etc. depend only on (seed, step, rank), so a resumed run draws the same numbers.
    # Not torch.manual_seed: it also queues lazy seeding for every accelerator type and formats a
    # stack trace for each (0.9 ms per step, profiled); this rank only needs the CPU and its GPU.
    value = (seed * 1_000_003 + step * 7_919 + rank) % (2**63 - 1)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(value)


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The collated (host) batch on the model's device; no copy when they are the same."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class PendingRecord:
    """A training record whose cross-rank figures are still being gathered (see metrics.StepFigures)."""

    head: dict[str, Any]
    figures: StepFigures

    def record(self) -> dict[str, Any]:
        f = self.figures.result()
        h = self.head
        return {"step": h["step"], "epoch": h["epoch"], "loss": f["loss"], "lr": h["lr"], "grad_norm": h["grad_norm"],
                "tokens_per_s": f["tokens_per_s"], "samples_per_s": f["samples_per_s"],
                "step_time_s": f["step_time_s"], "peak_mem_bytes": f["peak_mem_bytes"], "tokens": int(f["tokens"]),
                **({"peak_gpu_mem_bytes": f["peak_gpu_mem_bytes"]} if torch.cuda.is_available() else {})}


class Trainer:
    """Runs the plan on an engine: train, log, evaluate, checkpoint, export."""

    def __init__(self, setup: Setup, engine: Any):
        self.s, self.engine = setup, engine
        self.cfg, self.plan = setup.cfg, setup.plan
        self.main = engine.is_main
        self.epoch = 0
        self.position = 0
        """Optimizer steps already done in the current epoch."""
        self.start_step = 0
        self.history: list[dict] = []

    # --- setup after the engine exists -------------------------------------------------------
    def start(self) -> None:
        """Load the checkpoint (if resuming), then clear an overwritten run and write the run's configs."""
        out = self.s.output
        if self.s.resume_from is not None:
            state = agree(lambda: self.engine.load_checkpoint(self.s.resume_from), f"--resume {self.s.resume_from}",
                          bad_input=BAD_FILE_ERRORS)
            self.epoch = int(state.get("epoch", 0))
            self.position = int(state.get("position", 0))
            if int(state.get("seed", self.cfg.run.seed)) != self.cfg.run.seed:
                raise UserError(f"--seed {self.cfg.run.seed}: the checkpoint was trained with --seed {state['seed']}; "
                                "resume with the same seed (data order depends on it)")
            if state.get("global_batch") not in (None, self.plan.global_batch):
                # The data position is (epoch, optimizer steps): it only means the same samples if
                # every step still takes the same number of them.
                p = self.plan
                raise UserError(f"--resume: the checkpoint was trained with a global batch of {state['global_batch']}, "
                                f"this run has {p.global_batch} (micro-batch {p.micro_batch} x grad-accum {p.grad_accum} "
                                f"x {p.world_size} ranks); pass --global-batch {state['global_batch']}")
            if state.get("steps_per_epoch") not in (None, self.plan.steps_per_epoch):
                raise UserError("--resume: the data or batch size changed since the checkpoint (steps per epoch "
                                f"{state['steps_per_epoch']} -> {self.plan.steps_per_epoch}); resume with the same "
                                "--data, --seq-len and global batch (on another world size pass --global-batch "
                                "with the old value)")
        self.start_step = self.engine.global_step

        def write() -> None:
            if not self.main:
                return
            if self.cfg.run.overwrite and self.s.resume_from is None:
                for name in RUN_FILES:
                    p = out / name
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
            (out / "run_config.yaml").write_text(to_yaml(self.cfg))
            ds = getattr(self.engine, "ds_config", None)
            if ds is not None:
                (out / "ds_config.json").write_text(json.dumps(ds, indent=2, sort_keys=True) + "\n")

        agree(write, "--output", bad_input=(OSError,))
        self.engine.tokenizer = self.s.source.tokenizer  # saved inside every checkpoint

    # --- steps ---------------------------------------------------------------------------------
    def _client_state(self) -> dict[str, Any]:
        epoch, pos = self.epoch, self.position
        if pos >= self.plan.steps_per_epoch:
            epoch, pos = epoch + 1, 0
        return {"epoch": epoch, "position": pos, "seed": self.cfg.run.seed, "global_step": self.engine.global_step,
                "steps_per_epoch": self.plan.steps_per_epoch, "global_batch": self.plan.global_batch,
                "total_steps": self.plan.total_steps,
                "rng": "reseeded from (seed, global_step, rank) before every optimizer step"}

    def save(self) -> Path:
        return self.engine.save_checkpoint(self.s.output / ck.CHECKPOINTS_DIR, self._client_state())

    def evaluate(self) -> dict[str, float]:
        """Loss (and perplexity or accuracy) over the whole eval set; every rank runs the same batches."""
        e, task = self.engine, self.cfg.model.task
        e.eval()
        loss_sum = count = correct = torch.zeros((), dtype=torch.float64, device=e.device)  # read once, at the end
        with torch.no_grad():
            for batch in eval_loader(self.s.data, e.rank, e.world_size, self.plan.micro_batch):
                batch = _to_device(batch, e.device)
                valid = batch.pop("valid")
                labels = batch.pop("labels")
                logits = e(**batch).logits.float()
                if task == "seq-cls":
                    per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
                    loss_sum = loss_sum + per[valid].sum()
                    correct = correct + (logits.argmax(-1) == labels)[valid].sum()
                    count = count + valid.sum()
                else:
                    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
                    per = torch.nn.functional.cross_entropy(shift_logits.transpose(1, 2), shift_labels,
                                                            ignore_index=-100, reduction="none")
                    tok = (shift_labels != -100) & valid[:, None]
                    loss_sum = loss_sum + per[tok].sum()
                    count = count + tok.sum()
        e.train()
        loss_sum, count, correct = reduce_sum(float(loss_sum), float(count), float(correct))
        out = {"eval_loss": loss_sum / max(count, 1.0)}
        if task == "seq-cls":
            out["eval_accuracy"] = correct / max(count, 1.0)
        else:
            out["eval_perplexity"] = math.exp(min(out["eval_loss"], 80.0))
        return out

    def fit(self) -> dict[str, Any]:
        """Train to plan.total_steps; returns the summary figures."""
        e, plan, run = self.engine, self.plan, self.cfg.run
        has_eval = self.s.data.eval is not None
        writer = MetricsWriter(self.s.output, self.main, run.tensorboard,
                               self.start_step if self.s.resume_from is not None else None)
        bar = Progress(plan.total_steps, self.start_step, self.main)
        t0 = time.perf_counter()
        e.train()
        last_eval: dict[str, float] = {}
        last_saved = self.start_step if self.s.resume_from is not None else -1
        pending: Optional[PendingRecord] = None

        def settle() -> None:
            """Log the previous step's record: its gather had a whole step to finish in the background."""
            nonlocal pending
            if pending is None:
                return
            rec, pending = pending.record(), None
            if rec["step"] % run.log_every == 0 or rec["step"] == plan.total_steps:
                writer.write(rec)
                self.history.append(rec)
            bar.update(rec["loss"], rec["lr"], rec["tokens_per_s"])

        try:
            while e.global_step < plan.total_steps:
                loader = train_loader(self.s.data, e.rank, e.world_size, plan.micro_batch, run.seed, self.epoch,
                                      skip_micro_batches=self.position * plan.grad_accum)
                batches = iter(loader)
                while self.position < plan.steps_per_epoch and e.global_step < plan.total_steps:
                    new = self._train_step(batches)
                    self.position += 1
                    settle()
                    pending = new
                    step = e.global_step
                    if has_eval and run.eval_every and step % run.eval_every == 0 and step < plan.total_steps:
                        settle()
                        last_eval = {"step": step, "epoch": new.head["epoch"], **self.evaluate()}
                        writer.write(last_eval)
                        bar.write(_fmt_eval(last_eval))
                    if run.save_every and step % run.save_every == 0 and step < plan.total_steps:
                        settle()  # metrics.jsonl holds this step before the checkpoint does
                        self.save()
                        last_saved = step
                if self.position >= plan.steps_per_epoch:
                    self.epoch, self.position = self.epoch + 1, 0
            settle()
            bar.close()
            if has_eval:
                last_eval = {"step": e.global_step, "epoch": self.epoch + self.position / plan.steps_per_epoch,
                             **self.evaluate()}
                writer.write(last_eval)
            if last_saved != e.global_step:
                self.save()
            if run.save_final:
                e.save_hf(self.s.output / "final", self.s.source.tokenizer)
        finally:
            bar.close()
            writer.close()
        return self._summary(time.perf_counter() - t0, last_eval)

    def _train_step(self, batches) -> PendingRecord:
        e, plan = self.engine, self.plan
        _reseed(self.cfg.run.seed, e.global_step, e.rank)
        lr = e.lr
        timer = StepTimer()
        stepped = False
        for i in range(plan.grad_accum):
            batch = next(batches)
            tokens, samples = int(batch["attention_mask"].sum()), int(batch["input_ids"].shape[0])  # on the host
            loss = e(**_to_device(batch, e.device)).loss
            e.backward(loss)
            if i == 0 and e.global_step == plan.total_steps - 1:
                record_model_state(e)  # only when $ZEROTRAIN_MODEL_STATE_DIR is set (zerotrain compare)
            stepped = e.step()
            timer.add(loss.detach(), tokens, samples)
        assert stepped, "the engine did not step on the accumulation boundary"
        epoch = self.epoch + (self.position + 1) / plan.steps_per_epoch
        head = {"step": e.global_step, "epoch": round(epoch, 6), "lr": lr, "grad_norm": e.last_grad_norm}
        return PendingRecord(head, timer.start_reduce(e.world_size))

    def _summary(self, seconds: float, last_eval: dict[str, float]) -> dict[str, Any]:
        h = self.history
        steps = self.engine.global_step - self.start_step
        tokens = sum(r["tokens"] for r in h)
        return {"steps": steps, "global_step": self.engine.global_step, "seconds": seconds,
                "first_loss": h[0]["loss"] if h else None, "last_loss": h[-1]["loss"] if h else None,
                "tokens_per_s": tokens / sum(r["step_time_s"] for r in h) if h else 0.0,
                "peak_mem_bytes": max((r["peak_mem_bytes"] for r in h), default=0),
                "peak_gpu_mem_bytes": max((r.get("peak_gpu_mem_bytes", 0) for r in h), default=0), **{
                    k: v for k, v in last_eval.items() if k.startswith("eval_")}}


def _fmt_eval(rec: dict[str, Any]) -> str:
    parts = [f"step {rec['step']}", f"eval_loss {rec['eval_loss']:.4f}"]
    if "eval_perplexity" in rec:
        parts.append(f"perplexity {rec['eval_perplexity']:.2f}")
    if "eval_accuracy" in rec:
        parts.append(f"accuracy {rec['eval_accuracy']:.3f}")
    return "  ".join(parts)


def format_summary(summary: dict[str, Any], setup: Setup) -> str:
    """The few lines printed at the end of a run."""
    s = summary
    lines = [f"done: {s['steps']} steps (to step {s['global_step']}) in {s['seconds']:.1f} s"]
    if s["first_loss"] is not None:
        lines.append(f"  loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}   {s['tokens_per_s']:,.0f} tokens/s   "
                     f"peak memory {human_bytes(s['peak_mem_bytes'])} (largest rank)"
                     + (f", GPU {human_bytes(s['peak_gpu_mem_bytes'])}" if s.get("peak_gpu_mem_bytes") else ""))
    if "eval_loss" in s:
        lines.append("  " + _fmt_eval({"step": s["global_step"], **s}))
    out = setup.output
    lines.append(f"  outputs: {out}/metrics.jsonl  {out}/{ck.CHECKPOINTS_DIR}/"
                 + (f"  {out}/final/" if setup.cfg.run.save_final else ""))
    return "\n".join(lines)
