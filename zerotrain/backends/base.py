"""The engine API: one small interface over DeepSpeed and FSDP2 (imitates Lightning Fabric's Strategy).

A user loop with it is as short as a single-device PyTorch loop:

    engine = build_engine(model_factory, cfg, total_steps=100)
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()            # steps the optimizer on the accumulation boundary only
    engine.save_hf("out/final", tokenizer)
    engine.close()
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import RunConfig

ModelFactory = Callable[[], torch.nn.Module]
"""Builds the model. Called by the backend, so a ZeRO-3 backend can build it under zero.Init."""


class Engine(ABC):
    """One training engine. Every method is called on every rank (collectives inside)."""

    name: str = "base"
    """Backend name: 'deepspeed' or 'fsdp'."""

    def __init__(self, cfg: RunConfig, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.global_step = 0
        """Optimizer steps taken (restored by load_checkpoint)."""
        self.micro_step = 0
        """Backward calls since the start (the accumulation position is micro_step % grad_accum)."""
        self.last_grad_norm: Optional[float] = None
        """Global gradient norm before clipping at the last optimizer step."""
        self.tokenizer: Any = None
        """Set by the trainer: saved (with the HF config) inside every checkpoint so export is self-contained."""
        self.notes: list[str] = []
        """One-line facts about how this engine runs the model (e.g. whether ZeRO-3 leaf blocks are on
        and why), printed by `zerotrain train` in its start banner."""

    # --- identity -------------------------------------------------------------------------
    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def lr(self) -> float:
        """Learning rate the next optimizer step will use."""

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The (wrapped) model to call for forward."""

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def grad_accum(self) -> int:
        return self._grad_accum

    def is_accumulation_boundary(self) -> bool:
        """True when the next backward is the last micro-batch of an optimizer step."""
        return (self.micro_step + 1) % self.grad_accum == 0

    # --- training -------------------------------------------------------------------------
    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch loss (the mean over its samples); scaling for accumulation is inside."""

    @abstractmethod
    def step(self) -> bool:
        """After every backward: on the accumulation boundary clip, step optimizer and LR, zero grads
        and return True; otherwise return False."""

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    # --- state ----------------------------------------------------------------------------
    @abstractmethod
    def save_checkpoint(self, ckpt_root: str | Path, client_state: dict[str, Any]) -> Path:
        """Save a checkpoint under ckpt_root (tag from global_step); it becomes 'latest' only after every
        rank finished writing it. Keeps the newest cfg.run.keep_last. Returns the checkpoint dir."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load ckpt_root (its latest) or one checkpoint dir; restores model, optimizer, LR, global_step.
        Returns the client_state given at save time."""

    @abstractmethod
    def save_hf(self, out_dir: str | Path, tokenizer: Any = None) -> None:
        """HF save_pretrained directory with full consolidated weights (safetensors), written by rank 0."""

    @abstractmethod
    def close(self, barrier: bool = True) -> None:
        """Release the engine and tear down the process group (barrier + destroy; barrier=False after a
        failure, so a failed rank does not wait for peers still inside a collective)."""
