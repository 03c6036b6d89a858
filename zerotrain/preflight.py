"""Before training: validate every input and resolve model, data and run length, on every rank.

`preflight(cfg)` runs on every rank BEFORE any process group exists. It reads the same inputs on
every rank (output dir, checkpoint meta, model config, tokenizer, data), so a bad input makes every
rank fail the same way within seconds, and it writes nothing the previous run saved. The result,
`RunSetup`, is identical on every rank; zerotrain/trainer.py runs it.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint as ck
from .config import RunConfig, resolve_batch
from .data import PreparedData, prepare_data, steps_per_epoch
from .errors import UserError
from .model import ModelBuilder, ModelSource, resolve_model
from .model_info import ModelFacts, facts_of

# What a previous run leaves in its output dir; a fresh start refuses to write over any of it.
RUN_FILES = ("checkpoints", "final", "metrics.jsonl", "run_config.yaml", "ds_config.json", "tensorboard")
DEMO_LR = 1e-3
"""Peak LR of the embedded demo when --lr is not given: its model starts from random weights."""



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
class RunSetup:
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


def preflight(cfg: RunConfig) -> RunSetup:
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
    return RunSetup(cfg, output, source, data, plan, resume_from, env.rank, facts_of(meta_model, meta_model.config),
                 device_warnings)
