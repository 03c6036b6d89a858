"""Build the training engine of a resolved plan (DeepSpeed when it imports, else PyTorch FSDP2), and export
a checkpoint of any engine: both through the one table of engines (backends/registry.py).

    engine = build_engine(model_factory, cfg, total_steps=100)
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from .backends.base import Engine, ModelFactory
from .config import RunConfig
from .errors import UserError
from .model_info import ModelFacts
from .plan import RunPlan
from .resolve import engine_plan

log = logging.getLogger("zerotrain")


def build_engine(model_factory: ModelFactory, cfg: RunConfig, total_steps: int,
                 model_facts: Optional[ModelFacts] = None) -> Engine:
    """Resolve the run plan, initialise distributed (if needed), build the model through the chosen backend.

    model_facts: the model's facts (model.model_facts_for); without them a ModelBuilder's meta build gives
    them, else the engine completes the plan once from the model it builds (Engine._adopt_model)."""
    if model_facts is None and hasattr(model_factory, "empty"):  # a ModelBuilder: the model's facts on meta
        from .model_info import run_facts

        meta = model_factory.empty()
        model_facts = run_facts(meta, meta.config, cfg)
    return engine_for(engine_plan(cfg, total_steps, model_facts), model_factory)


def engine_for(plan: RunPlan, model_factory: ModelFactory) -> Engine:
    """The engine of a resolved plan (its backend chosen by resolve.select_backend)."""
    from . import dist, host_malloc

    cfg = plan.cfg
    if cfg.run.tune_malloc:
        host_malloc.tune()  # before the model and its optimizer state are allocated
    if dist.env().rank == 0:
        # A silent fallback surprises users (no ZeRO-1, no NVMe offload under FSDP): a warning is
        # printed even when nobody configured logging; an explicit choice stays at info.
        log.log(logging.WARNING if plan.backend_fallback else logging.INFO, "zerotrain backend: %s (%s)", plan.backend, plan.backend_why)
    from .backends.registry import engine_class

    return engine_class(plan.engine_kind)(model_factory, plan)


def export_checkpoint(ckpt_dir: Path, out_dir: str | Path, merge_lora: bool = False) -> Path:
    """A complete checkpoint dir of either backend -> a HF save_pretrained dir, in one process.
    A LoRA checkpoint gives peft's adapter files (+ OUT/merged, the merged model, with merge_lora)."""
    from . import checkpoint as ck

    meta = ck.read_meta(ckpt_dir)
    if "lora" in meta.extra:
        from .lora_export import export_adapter

        return export_adapter(Path(ckpt_dir), Path(out_dir), merge_lora)
    if merge_lora:
        raise UserError(f"export --merge-lora: {ckpt_dir} is a full fine-tuning checkpoint (no LoRA adapter); "
                        "drop --merge-lora")
    from .backends.registry import exporter

    return exporter(meta.format, ckpt_dir)(ckpt_dir, out_dir)
