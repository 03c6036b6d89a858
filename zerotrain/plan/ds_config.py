"""Run plan -> DeepSpeed config dict (a rendering of zerotrain/plan/run_plan.py's RunPlan). Pure: never imports deepspeed.

Two flavours:
- resolved (default): every value concrete. Raw DeepSpeed silently drops "auto" and falls back to
  its defaults, so a config meant for `deepspeed.initialize` must hold none.
- hf_auto: "auto" exactly where HF Trainer / Accelerate fill a value from their own arguments
  (batch sizes, optimizer and scheduler params, precision switches, clipping), so
  `TrainingArguments(deepspeed=file)` works unchanged. Bucket sizes stay concrete: HF's "auto"
  rule for them (derived from hidden size) was measured slower than ours (see plan.bucket_sizes).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from ..config.rules import AUTO
from ..config.schema import RunConfig
from ..model.facts import ModelFacts
from .capabilities import AUTOEP_PRESETS
from .run_plan import RunPlan, build_plan

# DeepSpeed prints a line every `steps_per_print` steps; zerotrain has its own metrics.
_QUIET_STEPS = 1_000_000_000


def _offload(device: str, nvme_path: Optional[str]) -> dict:
    out: dict[str, Any] = {"device": device}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    # Pinned host memory speeds up host<->GPU copies; on a CPU-only run it only costs RAM.
    out["pin_memory"] = True
    return out


def _optimizer(cfg: RunConfig, lr: float, hf_auto: bool) -> dict:
    o = cfg.optimizer
    if o.name == "sgd":
        params: dict[str, Any] = {"lr": lr, "momentum": o.momentum, "weight_decay": o.weight_decay}
        if hf_auto:  # HF Trainer builds AdamW-style params only; keep SGD concrete except lr
            params["lr"] = AUTO
        # DeepSpeed falls back to getattr(torch.optim, type) for unknown names.
        return {"type": "SGD", "params": params}
    params = {"lr": lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if hf_auto:
        params = {k: AUTO for k in params}
    opt: dict[str, Any] = {"type": "AdamW" if o.name == "adamw" else "Adam", "params": params}
    if o.name == "adam":
        # DeepSpeed's "Adam" means AdamW unless adam_w_mode is false.
        opt["params"]["adam_w_mode"] = False
    return opt


def _scheduler(cfg: RunConfig, lr: float, total_steps: Optional[int], hf_auto: bool) -> Optional[dict]:
    """DeepSpeed's scheduler matching the run's schedule (for raw `deepspeed.initialize` users), or None
    where DeepSpeed has none that matches (schedule_note says so and what to do).

    zerotrain's own engine drives the LR itself (schedule.lr_lambda, which equals transformers'
    get_scheduler) and drops this block: DeepSpeed's schedulers warm up over at least 2 steps and one
    step behind (its lr of step k is the warmup value of step k - 1); after warmup WarmupCosineLR and
    WarmupLR give the same values, WarmupDecayLR stays one step behind (tests/unit/test_schedule.py steps them).
    """
    s = cfg.schedule
    warm = max(1, s.warmup_steps)
    if hf_auto:  # HF fills the values from its own args; it has no "auto" cosine for DeepSpeed's block
        if s.name == "constant":
            return {"type": "WarmupLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                   "warmup_num_steps": AUTO}}
        if s.name == "linear" and s.min_lr_ratio == 0:
            return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                        "warmup_num_steps": AUTO, "total_num_steps": AUTO}}
        return None
    if s.name == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                               "warmup_num_steps": warm, "warmup_type": "linear"}}
    if total_steps is None:
        return None  # decay needs the run length; the engine supplies it
    if s.name == "linear":
        if s.min_lr_ratio:
            return None  # WarmupDecayLR decays to its warmup start (0), not to a floor
        return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                    "warmup_num_steps": warm, "warmup_type": "linear",
                                                    "total_num_steps": total_steps}}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": total_steps, "warmup_min_ratio": 0.0,
                                                 "warmup_num_steps": warm, "warmup_type": "linear",
                                                 "cos_min_ratio": s.min_lr_ratio}}


def schedule_note(cfg: RunConfig, total_steps: Optional[int], hf_auto: bool) -> Optional[str]:
    """One line for whoever uses the JSON outside zerotrain when it carries no scheduler for the
    schedule that was asked (`zerotrain config` prints it on stderr, ds_configs/README.md holds it)."""
    s = cfg.schedule
    if _scheduler(cfg, 1.0, total_steps, hf_auto) is not None or s.name == "constant":
        return None
    asked = f"schedule.name={s.name}" + (f" with min_lr_ratio {s.min_lr_ratio:g}" if s.min_lr_ratio else "")
    if hf_auto:
        hf = (f"--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs '{{\"min_lr_rate\": {s.min_lr_ratio:g}}}'"
              if s.min_lr_ratio else f"--lr_scheduler_type {s.name}")
        return (f"{asked}: DeepSpeed has no \"auto\" scheduler for it, so the JSON has no scheduler block and HF "
                f"Trainer / Accelerate use their own: pass {hf} (and --warmup_steps {s.warmup_steps})")
    if s.name == "linear" and total_steps is not None:
        return (f"{asked}: DeepSpeed's WarmupDecayLR cannot stop at a floor, so the JSON has no scheduler block and "
                "a raw DeepSpeed run keeps the LR constant; pass --min-lr-ratio 0 or --schedule cosine")
    return (f"{asked}: a decay needs the run length, so the JSON has no scheduler block and a raw DeepSpeed run "
            "keeps the LR constant; pass --max-steps N")


def build_ds_config(cfg: RunConfig, world_size: Optional[int] = None, model_facts: Optional[ModelFacts] = None,
                    hf_auto: bool = False, total_steps: Optional[int] = None, device: str = "cuda") -> dict:
    """The DeepSpeed config for a run config: `render` of its plan (build_plan).

    world_size: when known, train_batch_size is written and checked; otherwise DeepSpeed derives it
    from micro-batch x grad-accum x its world size. model_facts: sizes buckets (plan.bucket_sizes).
    total_steps: needed for a decaying scheduler block. device: "cuda" (any accelerator; what
    `zerotrain config` writes for) or "cpu" (CPU ranks over gloo).
    """
    plan = build_plan(cfg, world_size, backend="deepspeed", device=device, facts=model_facts, total_steps=total_steps,
                      batch_from_hf=hf_auto)
    return render(plan, hf_auto=hf_auto)


def render(plan: RunPlan, hf_auto: bool = False) -> dict:
    """The DeepSpeed JSON of a plan; nothing reads values back out of it (the plan owns them).

    hf_auto: the HF Trainer / Accelerate flavour ("auto" where they fill values themselves).
    """
    cfg, b, sh, comm = plan.cfg, plan.batch, plan.sharding, plan.comm
    assert comm is not None, "a DeepSpeed plan resolves its communication sizes (plan._comm)"
    p = cfg.precision
    ds: dict[str, Any] = {}
    if hf_auto:
        ds["train_batch_size"] = AUTO
        ds["train_micro_batch_size_per_gpu"] = AUTO
        ds["gradient_accumulation_steps"] = AUTO
        ds["gradient_clipping"] = AUTO
    else:
        if b.global_batch is not None and plan.parallel.tp == 1 and plan.parallel.sp == 1:
            # Under AutoTP DeepSpeed checks this against micro x accum x ALL ranks (its config is read
            # before its tensor-parallel groups exist), so it is left for DeepSpeed to fill in; likewise
            # under sp, where ZeRO's data-parallel world is dp x sp (no mpu: gradients averaged over both).
            ds["train_batch_size"] = b.global_batch
        ds["train_micro_batch_size_per_gpu"] = b.micro_batch
        ds["gradient_accumulation_steps"] = b.grad_accum
        ds["gradient_clipping"] = cfg.optimizer.clip
    ds["steps_per_print"] = _QUIET_STEPS
    ds["wall_clock_breakdown"] = False

    ds["optimizer"] = _optimizer(cfg, plan.lr, hf_auto)
    sched = _scheduler(cfg, plan.lr, plan.total_steps, hf_auto)
    if sched is not None:
        ds["scheduler"] = sched

    if plan.dtype == "bf16":
        ds["bf16"] = {"enabled": AUTO if hf_auto else True}
    elif plan.dtype == "fp16":
        ds["fp16"] = {"enabled": AUTO if hf_auto else True, "loss_scale": p.loss_scale,
                      "initial_scale_power": p.initial_scale_power, "loss_scale_window": p.loss_scale_window,
                      "hysteresis": p.hysteresis, "min_loss_scale": p.min_loss_scale}
    elif hf_auto:
        # Keep both blocks so HF can switch them on from --bf16/--fp16.
        ds["bf16"] = {"enabled": AUTO}
        ds["fp16"] = {"enabled": AUTO}

    stage = sh.effective_stage
    zo: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zo["reduce_bucket_size"] = comm.reduce_bucket_size
        zo["contiguous_gradients"] = True
        if stage <= 2:
            zo["allgather_bucket_size"] = comm.allgather_bucket_size
            zo["allgather_partitions"] = True
            zo["reduce_scatter"] = comm.reduce_scatter
        zo["overlap_comm"] = comm.overlap_comm
    if stage == 3:
        zo["stage3_prefetch_bucket_size"] = comm.prefetch_bucket_size
        zo["stage3_param_persistence_threshold"] = comm.param_persistence_threshold
        zo["stage3_max_live_parameters"] = comm.max_live_parameters
        zo["stage3_max_reuse_distance"] = comm.max_live_parameters
        # Needed for a full HF export (engine._zero3_consolidated_16bit_state_dict / save_16bit_model).
        zo["stage3_gather_16bit_weights_on_model_save"] = True
        # One fetch/release/reduce hook per transformer block instead of per Linear/LayerNorm (the
        # unit FSDP shards by), on the families where it measured faster (plan.leaf_blocks, RESULTS.md).
        if sh.leaf_blocks:
            zo["leaf_module"] = {"classes": list(sh.leaf_blocks)}
    if sh.offload_optimizer != "none":
        zo["offload_optimizer"] = _offload(sh.offload_optimizer, cfg.zero.nvme_path)
    if sh.offload_param != "none":
        zo["offload_param"] = _offload(sh.offload_param, cfg.zero.nvme_path)
    ds["zero_optimization"] = zo
    if plan.parallel.tp > 1:
        # AutoTP training: DeepSpeed splits the block linears (the model's HF tp_plan first, else its
        # AutoTP parser) over tp ranks; its data-parallel size becomes world / tp.
        ds["tensor_parallel"] = {"autotp_size": plan.parallel.tp}
    if plan.parallel.ep > 1 and plan.facts is not None:
        # AutoEP: DeepSpeed splits each MoE block's experts over ep ranks (backends/deepspeed/expert_parallel.py)
        # use_grouped_mm (DeepSpeed's default) on accelerators only: on CPU torch._grouped_mm refuses row strides
        # that are not multiples of 16 bytes (odd widths); the per-expert loop gives the same results
        # (benchmarks/results/autoep_probe/REPORT.md).
        ds["expert_parallel"] = {"enabled": True, "autoep_size": plan.parallel.ep,
                                 "preset_model": AUTOEP_PRESETS[plan.facts.model_type],
                                 "use_grouped_mm": plan.device != "cpu"}
    if cfg.optimizer.name == "sgd" and stage >= 1:
        # ZeRO refuses optimizers it has not tested (torch SGD among them) unless told otherwise.
        ds["zero_allow_untested_optimizer"] = True
    if sh.offload_optimizer != "none":
        # Offloaded optimizer states are stepped by DeepSpeedCPUAdam (built JIT with g++/ninja).
        ds["zero_force_ds_cpu_optimizer"] = True

    return merge_overrides(ds, cfg.ds_overrides)


def merge_overrides(ds: dict, overrides: dict) -> dict:
    """Deep-merge raw DeepSpeed keys last (conflicts were refused by check_overrides)."""
    out = copy.deepcopy(ds)

    def merge(dst: dict, src: dict) -> None:
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = copy.deepcopy(v)

    merge(out, overrides)
    return out
