"""Learning-rate schedule as a LambdaLR multiplier, shared by both backends.

DeepSpeed's own schedulers cannot express warmup 0 (warmup_num_steps >= 2 in practice), so the
DeepSpeed engine hands this LambdaLR to `deepspeed.initialize(lr_scheduler=...)` and drops the
"scheduler" block from its config; FSDP uses the same LambdaLR, so both backends (and the
single-process test reference) follow exactly the same LR curve.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..config.schema import RunConfig


def lr_lambda(cfg: RunConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of cfg.optimizer.lr for the optimizer step that follows `step` completed steps.

    Warmup: linear from 0 (step 0 uses lr 0, as HF's get_*_schedule_with_warmup), reaching the peak
    at step `warmup_steps`. Then cosine or linear decay to `min_lr_ratio` at `total_steps`, or constant.
    """
    s = cfg.schedule
    warm, floor, name = s.warmup_steps, s.min_lr_ratio, s.name
    total = max(int(total_steps), 1)

    def f(step: int) -> float:
        if step < warm:
            return step / warm
        if name == "constant":
            return 1.0
        progress = min(max((step - warm) / max(total - warm, 1), 0.0), 1.0)
        if name == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR both backends (and tests/support/reference.py) step once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
