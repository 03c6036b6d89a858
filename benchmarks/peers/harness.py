"""What the HF Trainer-based peers share (hf_trainer, hf_trainer_lora, hf_long_context, trl_dpo, trl_grpo): the
process group HF Trainer does not start on CPU, the HF docs' DeepSpeed config, the settings the TRL peers pin to
zerotrain's run, the per-step clock and metrics file, and the teardown."""
from __future__ import annotations

import importlib
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

ZERO3 = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
         "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
         "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
         "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
"""The HF DeepSpeed docs' ZeRO-3 block ("auto" values filled by the Trainer), no offload."""


def init_gloo() -> None:
    """HF Trainer with use_cpu=True does not initialise deepspeed.comm (it does on GPUs): do it first."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))


def auto_config(zero: dict) -> dict:
    """The HF docs' DeepSpeed config around a zero_optimization block: batch, clipping, bf16 and AdamW left "auto"."""
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def zero3_config() -> dict:
    """The HF docs' ZeRO-3 config, no offload."""
    return auto_config(dict(ZERO3))


def pinned(job: dict) -> dict:
    """TrainingArguments the TRL peers set to zerotrain's run where TRL's defaults differ: fp32 on CPU, no gradient
    checkpointing, AdamW (0.9/0.999, eps 1e-8, no weight decay), constant LR, clip 1.0, a log record every step,
    nothing saved, evaluated or reported."""
    return dict(use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=job["seed"],
                data_seed=job["seed"], max_steps=job["steps"], learning_rate=job["lr"], optim="adamw_torch",
                adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
                lr_scheduler_type="constant", warmup_steps=0, logging_strategy="steps", logging_steps=1,
                logging_nan_inf_filter=False, save_strategy="no", eval_strategy="no", report_to=[],
                disable_tqdm=True, dataloader_num_workers=0)


def timed_train(trainer_class, model, **kwargs) -> tuple[Any, float, float]:
    """(trainer, seconds to build it, seconds to train): trainer_class(model=model, **kwargs) built (tokenization,
    reference model, DeepSpeed engines), its console printer dropped, and trained with the trainer holding the only
    reference to the model (the caller passes it in the call, so teardown can drop every reference)."""
    from transformers.trainer_callback import PrinterCallback

    t0 = time.perf_counter()
    trainer = trainer_class(model=model, **kwargs)
    init_s = time.perf_counter() - t0
    trainer.remove_callback(PrinterCallback)
    del model
    t0 = time.perf_counter()
    trainer.train()
    return trainer, init_s, time.perf_counter() - t0


class StepClock(TrainerCallback):
    """Seconds per optimizer step, from the trainer's batch fetch (`fetch_t0`, set by the peer's get_batch_samples)
    to on_step_end, and every log record with a loss."""

    def __init__(self):
        self.fetch_t0 = 0.0
        self.step_s: list[float] = []
        self.logs: list[dict] = []

    def on_step_end(self, args, state, control, **kw):
        self.step_s.append(time.perf_counter() - self.fetch_t0)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, **logs})


def gather(mine: dict) -> list[dict]:
    """Every rank's figures (this rank's alone without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def write_metrics(path: Path, logs: list[dict], rows: list[dict[str, Any]]) -> None:
    """metrics.jsonl: one line per optimizer step, every number the trainer logged for it, then the peer's own
    figures (`rows`, one dict per step)."""
    by_step = {rec["step"]: rec for rec in logs}
    with open(path, "w") as f:
        for k, row in enumerate(rows):
            rec = {key: v for key, v in by_step.get(k + 1, {}).items() if isinstance(v, (int, float))}
            rec.update(step=k + 1, **row)
            f.write(json.dumps(rec) + "\n")


def versions(*packages: str) -> dict[str, str]:
    return {p: importlib.import_module(p).__version__ for p in packages}


def release(trainer, *engines) -> None:
    """Destroy the trainer's DeepSpeed engine (and `engines`) and drop the trainer's references to them, so that the
    caller, after dropping its own, can tear the process group down (common.teardown)."""
    for e in (trainer.model_wrapped, *engines):
        if hasattr(e, "destroy"):
            e.destroy()
    trainer.model = trainer.model_wrapped = None
    if hasattr(trainer, "ref_model"):
        trainer.ref_model = None
