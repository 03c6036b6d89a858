"""Before training: validate every input and resolve model, data and run length, on every rank.

`preflight(cfg)` runs on every rank BEFORE any process group exists. It reads the same inputs on
every rank (output dir, checkpoint meta, model config, tokenizer, data), so a bad input makes every
rank fail the same way within seconds, and it writes nothing the previous run saved. The result,
`RunSetup`, is identical on every rank: its `plan` (zerotrain/plan.py) is the run plan the engine
is built from, and zerotrain/trainer.py runs it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import checkpoint as ck
from .config import RunConfig
from .data import PreparedData, prepare_data, steps_per_epoch
from .errors import UserError
from .model import ModelBuilder, ModelSource, resolve_model
from .model_info import ModelFacts, run_facts
from .plan import RunPlan, build_plan
from .run_dir import RunDir

DEMO_LR = 1e-3
"""Peak LR of the embedded demo when --lr is not given: its model starts from random weights."""



def check_output(cfg: RunConfig) -> RunDir:
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
        found = RunDir(out).previous_run()
        if found and not cfg.run.resume and not cfg.run.overwrite:
            raise UserError(f"--output {cfg.run.output} holds another run ({', '.join(found)}); pass --resume to "
                            "continue it, --overwrite to replace it, or choose a new --output")
    return RunDir(out)


def plan_training(cfg: RunConfig, n_train: int, world: int, backend: str = "deepspeed", device: str = "cpu",
                  facts: Optional[ModelFacts] = None, backend_why: str = "") -> RunPlan:
    """The run plan with its length: steps per epoch over the data-parallel replicas, total steps."""
    plan = build_plan(cfg, world, backend=backend, backend_why=backend_why, device=device, facts=facts)
    b, dp = plan.batch, plan.world.dp
    spe = steps_per_epoch(n_train, dp, b.micro_batch, b.grad_accum)
    if spe == 0:
        raise UserError(f"--data: {n_train} training samples are fewer than one optimizer step needs "
                        f"({b.global_batch} = micro-batch {b.micro_batch} x grad-accum {b.grad_accum} x {dp} ranks); "
                        "pass more data or lower --micro-batch / --grad-accum")
    total = cfg.run.max_steps or max(1, math.ceil(cfg.run.epochs * spe))
    return dataclasses.replace(plan, steps_per_epoch=spe, total_steps=total)


@dataclass
class RunSetup:
    """Everything preflight resolved; identical on every rank."""

    cfg: RunConfig
    run_dir: RunDir
    """Where the run's outputs go (one owner of the layout)."""
    source: ModelSource
    data: PreparedData
    plan: RunPlan
    """The resolved run (layout, batch, length, sharding, model facts); the engine is built from it."""
    resume_from: Optional[Path]
    rank: int

    def model_factory(self) -> ModelBuilder:
        return self.source.factory(self.data.num_labels, self.data.id2label, seed=self.cfg.run.seed)


def _check_resume(target: Path, model: torch.nn.Module, plan: RunPlan) -> None:
    """Refuse a checkpoint of another model / backend, or a layout change it cannot follow, before starting."""
    cfg = plan.cfg
    meta = ck.read_meta(target)
    ck.check_compatible(meta, model, target)
    ck.check_layout(meta, target, plan.world.world_size, plan.sharding.effective_stage,
                    nvme_optimizer=cfg.zero.offload_optimizer == "nvme", tp=plan.world.tp)
    if cfg.backend != "auto" and meta.backend != cfg.backend:
        raise UserError(f"--resume {target}: written by the {meta.backend} backend; pass --backend {meta.backend}")


def _check_model_options(cfg: RunConfig, model: torch.nn.Module) -> None:
    """Options that depend on the model: LoRA target names, packing through the model's attention mask."""
    from .lora import check_targets
    from .sft import supports_packing

    if cfg.lora.r > 0:
        check_targets(model, cfg.lora.targets)
    if cfg.data.packing != "off" and not supports_packing(type(model)):
        raise UserError(f"--packing {cfg.data.packing}: {type(model).__name__} does not build its attention mask "
                        "with transformers' masking_utils, so packed samples would attend across each other; "
                        "pass --packing off")


def preflight(cfg: RunConfig) -> RunSetup:
    """Validate every input and resolve model, data and the run plan. Raises UserError (one line)."""
    from . import dist
    from .engine import run_device, select_backend

    backend, backend_why = select_backend(cfg)
    env = dist.env()
    if cfg.model.name is None and cfg.model.from_config is None and "lr" not in cfg.optimizer.model_fields_set:
        cfg.optimizer.lr = DEMO_LR  # the embedded model starts from random weights: 5e-5 would barely move it
    run_dir = check_output(cfg)
    resume_from = ck.resolve_resume(run_dir.root, cfg.run.resume)
    source = resolve_model(cfg)
    data = prepare_data(cfg, source.tokenizer)
    # the model on the meta device (no memory): class, config hash and facts without weights
    meta_model = source.factory(data.num_labels, data.id2label, seed=cfg.run.seed).empty()
    _check_model_options(cfg, meta_model)
    plan = plan_training(cfg, len(data.train), env.world_size, backend, run_device(),
                         run_facts(meta_model, meta_model.config, cfg), backend_why)
    if resume_from is not None:
        _check_resume(resume_from, meta_model, plan)
    return RunSetup(cfg, run_dir, source, data, plan, resume_from, env.rank)
