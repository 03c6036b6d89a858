"""Build the training engine of a resolved plan (DeepSpeed when it imports, else PyTorch FSDP2), through the
one table of engines (zerotrain/plan/registry.py). Exporting a checkpoint is zerotrain/export/to_hf.py.

    engine = build_engine(model_factory, cfg, total_steps=100)
"""
from __future__ import annotations

import logging
from typing import Optional

from .backends.base import Engine, ModelFactory
from .config.schema import RunConfig
from .model.facts import ModelFacts
from .plan.resolve import engine_plan
from .plan.run_plan import RunPlan

log = logging.getLogger("zerotrain")


def build_engine(model_factory: ModelFactory, cfg: RunConfig, total_steps: int,
                 model_facts: Optional[ModelFacts] = None) -> Engine:
    """Resolve the run plan, initialise distributed (if needed), build the model through the chosen backend.

    model_facts: the model's facts (model.model_facts_for); without them a ModelBuilder's meta build gives
    them, else the engine completes the plan once from the model it builds (Engine._adopt_model)."""
    if model_facts is None and hasattr(model_factory, "empty"):  # a ModelBuilder: the model's facts on meta
        from .model.facts import run_facts

        meta = model_factory.empty()
        model_facts = run_facts(meta, meta.config, cfg)
    return engine_for(engine_plan(cfg, total_steps, model_facts), model_factory)


def engine_for(plan: RunPlan, model_factory: ModelFactory) -> Engine:
    """The engine of a resolved plan (its backend chosen by resolve.select_backend)."""
    from .distributed import host_malloc
    from .distributed import process_group as dist

    cfg = plan.cfg
    if cfg.run.tune_malloc:
        host_malloc.tune()  # before the model and its optimizer state are allocated
    if dist.env().rank == 0:
        # A silent fallback surprises users (no ZeRO-1, no NVMe offload under FSDP): a warning is
        # printed even when nobody configured logging; an explicit choice stays at info.
        log.log(logging.WARNING if plan.backend_fallback else logging.INFO, "zerotrain backend: %s (%s)", plan.backend, plan.backend_why)
    if plan.backend == "fsdp":
        from .plan.resolve import hide_deepspeed

        hide_deepspeed()
    from .plan.registry import engine_class

    return engine_class(plan.engine_kind)(model_factory, plan)
