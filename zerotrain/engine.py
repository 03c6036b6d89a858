"""Choose and build the training engine: DeepSpeed when it imports, else PyTorch FSDP2.

    engine = build_engine(model_factory, cfg, total_steps=100)
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Iterator, Optional

from .backends.base import Engine, ModelFactory
from .config import RunConfig
from .errors import UserError, first_line
from .model_info import ModelFacts
from .plan import RunPlan, build_plan

log = logging.getLogger("zerotrain")

DEEPSPEED_INSTALL = "pip install 'zerotrain[deepspeed]'"


@contextlib.contextmanager
def _mlflow_hidden() -> Iterator[None]:
    """`import deepspeed` imports its autotuner, which imports mlflow when it is installed: +115 MiB RSS
    and ~1.5 s on every rank (measured here) for a tool zerotrain never runs. mlflow is hidden during
    that import only; zerotrain's MLflow tracker (zerotrain/trackers.py) imports it later as usual."""
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  (import raises ImportError)
    try:
        yield
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


@functools.cache
def deepspeed_importable() -> tuple[bool, str]:
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
        with _mlflow_hidden():
            import deepspeed  # noqa: F401  (a real import: a broken install must count as absent)
    except Exception as e:  # deepspeed raises many kinds at import (missing ops, torch mismatch)
        for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            del sys.modules[name]  # the half-imported package and its submodules
        sys.modules["deepspeed"] = None
        return False, f"import deepspeed failed ({type(e).__name__}: {first_line(e)})"
    return True, "deepspeed imports"


def select_backend(cfg: RunConfig) -> tuple[str, str]:
    """(backend name, why). Raises UserError when DeepSpeed is requested but unusable."""
    ok, why = deepspeed_importable()  # also under --backend fsdp: a broken install must count as absent
    if cfg.backend == "fsdp":
        return "fsdp", "backend=fsdp requested"
    if cfg.backend == "auto" and cfg.parallel.tp > 1:
        return "fsdp", f"backend=auto and parallel.tp={cfg.parallel.tp} (tensor parallelism runs on FSDP2)"
    if cfg.backend == "deepspeed":
        if not ok:
            raise UserError(f"backend=deepspeed but {why}; install it with {DEEPSPEED_INSTALL} or pass --backend fsdp")
        return "deepspeed", "backend=deepspeed requested"
    if ok:
        return "deepspeed", "backend=auto and deepspeed imports"
    return "fsdp", f"backend=auto and {why}; using PyTorch FSDP2 (install DeepSpeed with {DEEPSPEED_INSTALL})"


def run_device() -> str:
    """Where this process's ranks compute: cuda (one GPU per local rank) when there is one, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_run(cfg: RunConfig, total_steps: Optional[int], model_facts: Optional[ModelFacts] = None,
             steps_per_epoch: Optional[int] = None) -> RunPlan:
    """The run plan for this process's world (from the launcher's environment) and device."""
    from . import dist

    backend, why = select_backend(cfg)
    return build_plan(cfg, dist.env().world_size, backend=backend, backend_why=why, device=run_device(),
                      facts=model_facts,
                      total_steps=total_steps, steps_per_epoch=steps_per_epoch)


def build_engine(model_factory: ModelFactory, cfg: RunConfig, total_steps: int,
                 model_facts: Optional[ModelFacts] = None) -> Engine:
    """Resolve the run plan, initialise distributed (if needed), build the model through the chosen backend."""
    return engine_for(plan_run(cfg, total_steps, model_facts), model_factory)


def engine_for(plan: RunPlan, model_factory: ModelFactory) -> Engine:
    """The engine of a resolved plan (its backend chosen by select_backend)."""
    from . import dist, host_malloc

    cfg = plan.cfg
    if cfg.run.tune_malloc:
        host_malloc.tune()  # before the model and its optimizer state are allocated
    if dist.env().rank == 0:
        # A silent fallback surprises users (no ZeRO-1, no NVMe offload under FSDP): a warning is
        # printed even when nobody configured logging; an explicit choice stays at info.
        fallback = cfg.backend == "auto" and plan.backend == "fsdp" and cfg.parallel.tp == 1
        log.log(logging.WARNING if fallback else logging.INFO, "zerotrain backend: %s (%s)", plan.backend, plan.backend_why)
    if plan.world.pp > 1:  # a pipeline engine replaces the whole step (train_step/eval_step)
        if plan.backend == "deepspeed":
            from .backends.deepspeed_pipe import DeepSpeedPipelineEngine

            return DeepSpeedPipelineEngine(model_factory, plan)
        from .backends.fsdp_pipeline import FSDPPipelineEngine

        return FSDPPipelineEngine(model_factory, plan)
    if plan.backend == "deepspeed":
        from .backends.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model_factory, plan)
    from .backends.fsdp import FSDPEngine  # written separately; imported only when chosen

    return FSDPEngine(model_factory, plan)


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
    if meta.format == "deepspeed":
        from .backends.deepspeed import export_checkpoint as export
    elif meta.format == "deepspeed-pipe":
        from .backends.deepspeed_pipe import export_checkpoint as export
    elif meta.format == "dcp":
        from .backends.fsdp import export_checkpoint as export
    else:
        raise UserError(f"export: {ckpt_dir} has unknown checkpoint format {meta.format!r}; was it written by zerotrain?")
    return export(ckpt_dir, out_dir)
