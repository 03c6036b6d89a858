"""Choose and build the training engine: DeepSpeed when it imports, else PyTorch FSDP2.

    engine = build_engine(model_factory, cfg, total_steps=100)
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from typing import Optional

from .backends.base import Engine, ModelFactory
from .config import RunConfig
from .errors import UserError, first_line
from .model_info import ModelFacts

log = logging.getLogger("zerotrain")

DEEPSPEED_INSTALL = "pip install 'zerotrain[deepspeed]'"


@functools.cache
def _deepspeed_importable() -> tuple[bool, str]:
    """Whether `import deepspeed` works; the reason if not (import errors are one line).

    A broken install (a failed op build, a torch mismatch) is made absent for the whole process:
    transformers and accelerate only ask importlib whether the package exists, and then import it
    (accelerate's extract_model_from_parallel does, inside every save_pretrained), so `final/` was lost
    to the same ImportError after an FSDP run. With sys.modules["deepspeed"] = None, find_spec says
    "not installed" to them too, and `import deepspeed` fails at once instead of half-importing again.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed is not installed"
    try:
        import deepspeed  # noqa: F401  (a real import: a broken install must count as absent)
    except Exception as e:  # deepspeed raises many kinds at import (missing ops, torch mismatch)
        for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            del sys.modules[name]  # the half-imported package and its submodules
        sys.modules["deepspeed"] = None
        return False, f"import deepspeed failed ({type(e).__name__}: {first_line(e)})"
    return True, "deepspeed imports"


def select_backend(cfg: RunConfig) -> tuple[str, str]:
    """(backend name, why). Raises ValueError when DeepSpeed is requested but unusable."""
    ok, why = _deepspeed_importable()  # also under --backend fsdp: a broken install must count as absent
    if cfg.backend == "fsdp":
        return "fsdp", "backend=fsdp requested"
    if cfg.backend == "deepspeed":
        if not ok:
            raise UserError(f"backend=deepspeed but {why}; install it with {DEEPSPEED_INSTALL} or pass --backend fsdp")
        return "deepspeed", "backend=deepspeed requested"
    if ok:
        return "deepspeed", "backend=auto and deepspeed imports"
    return "fsdp", f"backend=auto and {why}; using PyTorch FSDP2 (install DeepSpeed with {DEEPSPEED_INSTALL})"


def build_engine(model_factory: ModelFactory, cfg: RunConfig, total_steps: int,
                 model_facts: Optional[ModelFacts] = None) -> Engine:
    """Initialise distributed (if needed), build the model through the chosen backend, return the engine."""
    from . import dist, host_malloc

    if cfg.run.tune_malloc:
        host_malloc.tune()  # before the model and its optimizer state are allocated
    name, why = select_backend(cfg)
    if dist.env().rank == 0:
        # A silent fallback surprises users (no ZeRO-1, no NVMe offload under FSDP): a warning is
        # printed even when nobody configured logging; an explicit choice stays at info.
        fallback = cfg.backend == "auto" and name == "fsdp"
        log.log(logging.WARNING if fallback else logging.INFO, "zerotrain backend: %s (%s)", name, why)
    if name == "deepspeed":
        from .backends.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model_factory, cfg, total_steps, model_facts=model_facts)
    from .backends.fsdp import FSDPEngine  # written separately; imported only when chosen

    return FSDPEngine(model_factory, cfg, total_steps, model_facts=model_facts)
