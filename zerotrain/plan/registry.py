"""One table from (backend, pipeline or not) to the engine class, the checkpoint format it writes and the
exporters that read that format back: the engine choice, `zerotrain export` and the LoRA adapter export
all look here, so a new engine is one row.

Modules are named, not imported: a backend's module imports its library (deepspeed, torch.distributed
pipelining) only when that backend is chosen.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import UserError


@dataclass(frozen=True)
class EngineKind:
    """One engine: what builds it, what it writes, what reads its checkpoints back."""

    backend: str
    """deepspeed or fsdp (RunPlan.backend)."""
    pipeline: bool
    """True for the engine of a pipeline-parallel layout (pp > 1): it runs whole steps."""
    module: str
    """The module holding the engine class."""
    engine_class: str
    """The Engine subclass in `module`."""
    checkpoint_format: str
    """What its save_checkpoint writes (CheckpointMeta.format)."""
    exporter: str
    """`module:function` turning a checkpoint of this format into a HF directory (ckpt_dir, out_dir)."""
    adapter_reader: Optional[str] = None
    """`module:function` reading a LoRA checkpoint's trainable weights (None: not supported)."""


ENGINES: tuple[EngineKind, ...] = (
    EngineKind("deepspeed", False, "zerotrain.backends.deepspeed.engine", "DeepSpeedEngine", "deepspeed",
               "zerotrain.backends.deepspeed.checkpoint_io:export_checkpoint",
               "zerotrain.backends.deepspeed.checkpoint_io:read_adapter"),
    EngineKind("deepspeed", True, "zerotrain.backends.deepspeed.pipeline", "DeepSpeedPipelineEngine", "deepspeed-pipe",
               "zerotrain.backends.deepspeed.pipeline:export_checkpoint"),
    EngineKind("fsdp", False, "zerotrain.backends.fsdp.engine", "FSDPEngine", "dcp",
               "zerotrain.backends.fsdp.checkpoint_io:export_checkpoint", "zerotrain.backends.fsdp.checkpoint_io:load_trainable"),
    EngineKind("fsdp", True, "zerotrain.backends.fsdp.pipeline", "FSDPPipelineEngine", "dcp",
               "zerotrain.backends.fsdp.checkpoint_io:export_checkpoint"),
)
"""Every engine zerotrain builds. Both FSDP engines write torch.distributed.checkpoint files keyed by HF
parameter names, so one exporter reads both."""


def engine_kind(backend: str, pipeline: bool) -> EngineKind:
    """The engine a plan runs on (backend, layout.pp > 1)."""
    for kind in ENGINES:
        if (kind.backend, kind.pipeline) == (backend, pipeline):
            return kind
    raise ValueError(f"no engine for backend {backend!r} (pipeline={pipeline})")


def engine_class(kind: EngineKind) -> type:
    return getattr(importlib.import_module(kind.module), kind.engine_class)


def _function(ref: str) -> Callable[..., Any]:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _kind_of_format(fmt: str, ckpt_dir: Any) -> EngineKind:
    for kind in ENGINES:
        if kind.checkpoint_format == fmt:
            return kind
    raise UserError(f"export: {ckpt_dir} has unknown checkpoint format {fmt!r}; was it written by zerotrain?")


def exporter(fmt: str, ckpt_dir: Any) -> Callable[..., Any]:
    """The function exporting a checkpoint of format `fmt` to a HF directory."""
    return _function(_kind_of_format(fmt, ckpt_dir).exporter)


def adapter_reader(fmt: str, ckpt_dir: Any) -> Callable[..., Any]:
    """The function reading a LoRA checkpoint's trainable weights: (ckpt_dir, peft model) -> state dict."""
    ref = _kind_of_format(fmt, ckpt_dir).adapter_reader
    if ref is None:
        raise UserError(f"export: LoRA checkpoints of format {fmt!r} are not exported; use the run's final/")
    return _function(ref)
