"""The resolver of a run in this process: which backend and device it runs on, how long it trains, its LR,
and the plan (zerotrain/plan/run_plan.py) built from them. Every fact a run needs is decided here or in build_plan,
before any engine exists; engines read the plan only.

    plan = plan_run(cfg, n_train=len(data.train), facts=facts)     # zerotrain train (preflight)
    plan = engine_plan(cfg, total_steps=100, facts=None)           # build_engine (the engine API)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import sys
from typing import Iterator, Optional

from ..config.schema import RunConfig
from ..errors import UserError, first_line
from ..model.facts import ModelFacts
from ..model.preparation import ModelPreparation
from ..tasks import TaskSpec
from .capabilities import FEATURES, auto_backend
from .run_plan import RunPlan, build_plan, degrees

log = logging.getLogger("zerotrain")

DEEPSPEED_INSTALL = "pip install 'zerotrain[deepspeed]'"

DEMO_LR = 1e-3
"""Peak LR of the embedded demo when --lr is not given: its model starts from random weights, and 5e-5
would barely move it."""


@contextlib.contextmanager
def _mlflow_hidden() -> Iterator[None]:
    """`import deepspeed` imports its autotuner, which imports mlflow when it is installed: +115 MiB RSS
    and ~1.5 s on every rank (measured here) for a tool zerotrain never runs. mlflow is hidden during
    that import only; zerotrain's MLflow tracker (zerotrain/train/trackers.py) imports it later as usual."""
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


def hide_deepspeed() -> None:
    """For an FSDP run's process: deepspeed made absent (sys.modules["deepspeed"] = None) unless it is imported
    already. accelerate imports it inside every save_pretrained when its package is installed (to recognise a
    DeepSpeedEngine): seconds per rank for a library the run never calls, and a broken install (a failed op build, a
    torch mismatch) would lose final/ to its ImportError (deepspeed_importable's docstring)."""
    if "deepspeed" not in sys.modules:
        sys.modules["deepspeed"] = None  # type: ignore[assignment]  (import raises ImportError, find_spec None)


def quantizes_nothing(cfg: RunConfig) -> bool:
    """Whether a run of cfg never uses torchao: no QAT, and neither its model, nor the preference reference, nor
    the GRPO reward model was saved torchao-quantized (model.quant.transformers_without_torchao)."""
    from ..model.quant import torchao_quantized

    if ModelPreparation.from_config(cfg).uses_qat:
        return False
    return not any(torchao_quantized(m) for m in (cfg.model.name, cfg.pref.ref_model, cfg.rl.reward_model) if m)


def select_backend(cfg: RunConfig) -> tuple[str, str]:
    """(backend name, why). Raises UserError when DeepSpeed is requested but unusable."""
    # An FSDP run does not import deepspeed (seconds per rank): engine_for hides it from the libraries instead
    # (hide_deepspeed), so a broken install cannot reach the run either
    if cfg.backend == "fsdp":
        return "fsdp", "backend=fsdp requested"
    forced = auto_backend(degrees(cfg).asked, features_on(cfg)) if cfg.backend == "auto" else None
    if forced is not None:  # a dimension one backend runs, or runs natively (plan/capabilities.py)
        return forced
    ok, why = deepspeed_importable()
    if cfg.backend == "deepspeed":
        if not ok:
            raise UserError(f"backend=deepspeed but {why}; install it with {DEEPSPEED_INSTALL} or pass --backend fsdp")
        return "deepspeed", "backend=deepspeed requested"
    if ok:
        return "deepspeed", "backend=auto and deepspeed imports"
    return "fsdp", f"backend=auto and {why}; using PyTorch FSDP2 (install DeepSpeed with {DEEPSPEED_INSTALL})"


def features_on(cfg: RunConfig) -> tuple[str, ...]:
    """The capability table's FEATURES settings (dotted config paths) this config turns on."""
    def value(path: str) -> object:
        section, name = path.split(".")
        return getattr(getattr(cfg, section), name)

    return tuple(k for k in FEATURES if value(k))


def run_device() -> str:
    """Where this process's ranks compute: cuda (one GPU per local rank) when there is one, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a config asks for before a world and a backend resolve it: what compare/tune/estimate echo in
    their reports and what tune sizes its global batch from (a RunPlan resolves the same fields per run)."""

    dtype: str
    micro_batch: int
    grad_accum: int
    global_batch: Optional[int]
    max_steps: Optional[int]
    """The run length when the config fixes it (run.max_steps); None: epochs over the data decide."""


def asked(cfg: RunConfig) -> Asked:
    b = cfg.batch
    return Asked(cfg.precision.dtype, b.micro_batch, b.grad_accum, b.global_batch, cfg.run.max_steps)


def peak_lr(cfg: RunConfig) -> float:
    """optimizer.lr, or DEMO_LR for the embedded demo model when --lr was not given."""
    demo = cfg.model.name is None and cfg.model.from_config is None
    return DEMO_LR if demo and "lr" not in cfg.optimizer.model_fields_set else cfg.optimizer.lr


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: run.max_steps, else run.epochs passes over the data."""
    return cfg.run.max_steps or max(1, math.ceil(cfg.run.epochs * steps_per_epoch))


def keep_global_batch(cfg: RunConfig, dp: int, checkpoint: str, saved: int) -> RunConfig:
    """A resume keeps the checkpoint's global batch (its data position counts optimizer steps of that many
    samples): unless --global-batch is given, grad-accum is derived from it on this world's data-parallel size
    (an elastic restart on fewer ranks; a --grad-accum given too is recomputed, and the resume line says so).
    A batch the new world cannot split is refused in one line naming a --micro-batch that can."""
    if cfg.batch.global_batch is not None:
        return cfg
    micro = cfg.batch.micro_batch
    if saved % (micro * dp):
        fits = [m for m in range(micro, 0, -1) if saved % (m * dp) == 0]
        fix = (f"pass --micro-batch {fits[0]} (grad-accum becomes {saved // (fits[0] * dp)})" if fits else
               f"resume on a world whose data-parallel size divides {saved}")
        raise UserError(f"--resume {checkpoint}: the checkpoint's global batch {saved} cannot be kept on {dp} "
                        f"data-parallel ranks at --micro-batch {micro} ({saved} is not a multiple of {micro * dp}); "
                        f"{fix}, or pass --global-batch to train on with another batch")
    return cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"global_batch": saved})})


def plan_run(cfg: RunConfig, n_train: Optional[int], facts: Optional[ModelFacts], world: Optional[int] = None,
             backend: Optional[str] = None, device: Optional[str] = None,
             resumed_batch: Optional[tuple[str, int]] = None, task: Optional[TaskSpec] = None,
             preparation: Optional[ModelPreparation] = None) -> RunPlan:
    """The plan of a `zerotrain train` run: this process's world, backend and device (unless given),
    steps per epoch over the data-parallel replicas (None for a stream, n_train None: its epochs end where the stream
    does; the run is --max-steps long), total steps and the peak LR. resumed_batch: (checkpoint,
    its global batch) of a resume, kept (keep_global_batch). task: the task the model resolved (ModelSource.task;
    None: model.task's), the plan's from here on (RunPlan.task); preparation: the ModelPreparation preflight made
    for it (None: build_plan makes it)."""
    from ..data.datasets import steps_per_epoch
    from ..distributed import process_group as dist

    why = ""
    if backend is None:
        backend, why = select_backend(cfg)
    lr = peak_lr(cfg)
    if lr != cfg.optimizer.lr:  # the plan's config says what ran (run_config.yaml is written from it)
        cfg = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"lr": lr})})
    world_size = dist.env().world_size if world is None else world
    plan = build_plan(cfg, world_size, backend=backend, backend_why=why, device=device or run_device(), facts=facts,
                      lr=lr, task=task, preparation=preparation)
    if resumed_batch is not None:
        kept = keep_global_batch(cfg, plan.world.dp, *resumed_batch)
        if kept is not cfg:
            cfg = kept
            plan = build_plan(cfg, world_size, backend=backend, backend_why=why, device=device or run_device(),
                              facts=facts, lr=lr, task=task, preparation=preparation)
    b, dp = plan.batch, plan.world.dp
    if n_train is None:  # --streaming: config/rules.py check_streaming asked for --max-steps
        return dataclasses.replace(plan, steps_per_epoch=None, total_steps=cfg.run.max_steps)
    if plan.task.online_rl is not None:  # n_train counts prompts; a step takes whole groups of them
        from .rl_cycle import cycle_of

        cycle = cycle_of(cfg, b.global_batch, b.grad_accum, dp)
        spe = cycle.steps_per_epoch(n_train)
        if spe == 0:
            raise UserError(f"--data: {n_train} prompts are fewer than one generation batch samples "
                            f"({cycle.prompts_per_generation} prompts x {cycle.num_generations} completions); pass more "
                            "prompts or lower --global-batch / --steps-per-generation")
    else:
        spe = steps_per_epoch(n_train, dp, b.micro_batch, b.grad_accum)
    floor = plan.task.min_global_batch
    if b.global_batch < floor:
        raise UserError(f"--task {plan.task.name} with a global batch of {b.global_batch}: "
                        f"{plan.task.min_global_batch_why}; pass --global-batch {floor} or more")
    if spe == 0:
        raise UserError(f"--data: {n_train} training samples are fewer than one optimizer step needs "
                        f"({b.global_batch} = micro-batch {b.micro_batch} x grad-accum {b.grad_accum} x {dp} ranks); "
                        "pass more data or lower --micro-batch / --grad-accum")
    return dataclasses.replace(plan, steps_per_epoch=spe, total_steps=total_steps(cfg, spe))


def engine_plan(cfg: RunConfig, total_steps: Optional[int], facts: Optional[ModelFacts] = None,
                steps_per_epoch: Optional[int] = None) -> RunPlan:
    """The plan of an engine built through the engine API (build_engine): this process's world, backend
    and device; the caller gives the run length."""
    from ..distributed import process_group as dist

    backend, why = select_backend(cfg)
    return build_plan(cfg, dist.env().world_size, backend=backend, backend_why=why, device=run_device(),
                      facts=facts, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
