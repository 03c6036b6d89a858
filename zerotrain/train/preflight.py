"""Before training: validate every input and resolve model, data and run length, on every rank.

`preflight(cfg)` runs on every rank BEFORE any process group exists. It reads the same inputs on
every rank (output dir, checkpoint meta, model config, tokenizer, data), so a bad input makes every
rank fail the same way within seconds, and it writes nothing the previous run saved. The result,
`RunSetup`, is identical on every rank: its `plan` (zerotrain/plan/run_plan.py) is the run plan the engine
is built from, and zerotrain/train/trainer.py runs it.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint import store as ck
from ..checkpoint.run_dir import RunDir
from ..config.schema import RunConfig
from ..data.datasets import TEXT_PACKING, PreparedData, prepare_data
from ..data.mixture import resume_check
from ..distributed import faults
from ..errors import UserError
from ..model.facts import facts_of
from ..model.preparation import ModelPreparation
from ..model.source import ModelBuilder, ModelSource, meta_train_model, resolve_model
from ..plan.run_plan import RunPlan


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
    clears_previous_run: bool = False
    """A fresh start replaces the previous run's outputs in --output: --overwrite, or --resume auto that found no
    complete checkpoint (an attempt that died before its first save)."""
    fault_hook: Optional[str] = None
    """The banner's warning when a test fault hook ($ZEROTRAIN_FAULT, zerotrain/distributed/faults.py) is armed."""
    rewards: Any = None
    """Online RL (--task grpo): the reward functions and reward model (zerotrain/train/rewards.py RewardSet), loaded
    here so a bad --reward-funcs fails before any process group and a reward model is built whole, never under
    ZeRO-3's zero.Init; None for the other tasks."""

    def model_factory(self) -> ModelBuilder:
        return self.source.factory(self.data.num_labels, self.data.id2label, seed=self.cfg.run.seed)


def _check_model_options(cfg: RunConfig, model: torch.nn.Module,
                         preparation: Optional[ModelPreparation] = None) -> None:
    """Options that depend on the model: what LoRA and QAT need of it (ModelPreparation.check), packing
    through the model's attention mask. preparation: the run's (None: the config's)."""
    from ..data.sft import supports_packing

    (preparation or ModelPreparation.from_config(cfg)).check(model)
    if cfg.data.packing != "off" and not supports_packing(type(model)):
        raise UserError(f"--packing {cfg.data.packing}: {type(model).__name__} does not build its attention mask "
                        "with transformers' masking_utils, so packed samples would attend across each other; "
                        "pass --packing off")


def preflight(cfg: RunConfig) -> RunSetup:
    """Validate every input and resolve model, data and the run plan. Raises UserError (one line)."""
    from ..distributed import process_group as dist
    from ..plan.resolve import plan_run

    env = dist.env()
    armed = faults.banner()  # a malformed $ZEROTRAIN_FAULT is refused here, on every rank, before step 1
    run_dir = check_output(cfg)
    resume_from = ck.resolve_resume(run_dir.root, cfg.run.resume)
    source = resolve_model(cfg)
    task = source.task  # resolved on the model once (and checked there): the plan's from here on (RunPlan.task)
    ref = task.reference(cfg)
    if ref is not None and ref.path is not None:  # a reference of the policy's vocabulary
        from .reference import RefModelBuilder

        RefModelBuilder(ref.path, source.hf_config).check()
    rewards = None
    if task.online_rl is not None:
        from .rewards import load_reward_funcs

        rl = cfg.rl
        rewards = load_reward_funcs(rl.reward_funcs, rl.reward_weights, rl.reward_model)  # on the CPU until the engine
    record = ck.data_record(resume_from) if resume_from is not None else {}  # what the checkpoint's data was
    if cfg.data.streaming:  # read as it trains: nothing is tokenized here (zerotrain/data/streaming.py)
        from ..data.streaming import prepare_stream

        data = prepare_stream(cfg, source.tokenizer)
    else:
        data = prepare_data(cfg, source.tokenizer, record.get("text_packing", TEXT_PACKING), source.processor, task)
    if resume_from is not None:
        resume_check(record.get("mixture"), data.mixture)
    # the model on the meta device (no memory): class, config hash and options checked without weights
    meta_model = meta_train_model(cfg, source, labels=(data.num_labels, data.id2label))
    preparation = ModelPreparation.from_config(cfg, task)  # the plan's (RunPlan.preparation), made once
    _check_model_options(cfg, meta_model, preparation)
    facts = facts_of(preparation.for_sizing(meta_model), meta_model.config)  # as run_facts sizes it
    kept = record.get("global_batch")
    plan = plan_run(cfg, None if cfg.data.streaming else data.epoch_rows, facts,
                    resumed_batch=(str(resume_from), kept) if kept else None, task=task, preparation=preparation)
    if resume_from is not None:  # the same check and identity the engine applies when it loads
        ck.check_resume(ck.read_meta(resume_from), resume_from,
                        ck.identity_of(plan, ck.config_hash(meta_model), lora_base=source.weights))
    clears = resume_from is None and (cfg.run.overwrite or (cfg.run.resume == "auto" and bool(run_dir.previous_run())))
    return RunSetup(plan.cfg, run_dir, source, data, plan, resume_from, env.rank, clears_previous_run=clears,
                    fault_hook=armed, rewards=rewards)
