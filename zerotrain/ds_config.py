"""Run plan -> DeepSpeed config dict (a rendering of zerotrain/plan.py's RunPlan). Pure: never imports deepspeed.

Two flavours:
- resolved (default): every value concrete. Raw DeepSpeed silently drops "auto" and falls back to
  its defaults, so a config meant for `deepspeed.initialize` must hold none.
- hf_auto: "auto" exactly where HF Trainer / Accelerate fill a value from their own arguments
  (batch sizes, optimizer and scheduler params, precision switches, clipping), so
  `TrainingArguments(deepspeed=file)` works unchanged. Bucket sizes stay concrete: HF's "auto"
  rule for them (derived from hidden size) was measured slower than ours (see bucket_sizes).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from .config import RunConfig
from .model_info import ModelFacts
from .plan import RunPlan, build_plan
from .rules import AUTO


# DeepSpeed prints a line every `steps_per_print` steps; zerotrain has its own metrics.
_QUIET_STEPS = 1_000_000_000


@dataclass(frozen=True)
class Buckets:
    """Communication sizes in elements; see bucket_sizes for the rule."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int


# Without --model we do not know the size: these are safe for small models (no 2 GB buffers)
# and within 10x of DeepSpeed's defaults for large ones.
_DEFAULT_BUCKET = 50_000_000
_DS_DEFAULT_BUCKET = 500_000_000
_DS_DEFAULT_PREFETCH = 50_000_000
_DS_DEFAULT_MAX_LIVE = 1_000_000_000


def bucket_sizes(size: Optional[ModelFacts]) -> Buckets:
    """Bucket, prefetch and persistence sizes for a model (the rule was chosen by measurement).

    Rule: reduce/all-gather buckets = min(DeepSpeed's 5e8, parameter count rounded up to 2**16);
    stage-3 prefetch bucket = min(5e7, that); persistence threshold 0 (every tensor partitioned);
    max live parameters = min(1e9, max(that, 5e7)); overlap_comm on at stage 3 (build_ds_config).
    A bucket never needs to be larger than the whole model, and DeepSpeed's 5e8-element default
    allocates a 1 GB bf16 buffer for a 3.5 M-parameter model.

    Evidence (benchmarks/RESULTS.md, stage-3 sweep: small-gpt2 4x256, seq 128, micro-batch 4,
    grad-accum 2, bf16, 2 CPU ranks, 4 interleaved rounds, median [min-max] of per-round
    ratios to DeepSpeed's defaults, per-rank model-state bytes counted from engine tensors):
    this rule 1.11x [1.04-1.16] at 34 MiB vs DeepSpeed defaults (persistence 1e5, 5e8 buckets)
    at 981 MiB; persistence 10*h / 1e4 / 1e5 instead of 0: 1.01x / 1.00x / 0.99x; prefetch 0:
    0.82x; overlap_comm off: 1.08x (same, within noise); reduce bucket 1e6: 0.98x at 28.5 MiB;
    reduce bucket h*h: 0.61x; Accelerate/HF "auto" rule (bucket h*h, prefetch 0.9*h*h,
    persistence 10*h): 0.57x. Small buckets cost one gloo collective each; that dominates.

    Families measured: GPT-2 (the sweep above) and Llama (small-llama 4x256, GQA, untied head: the
    per-family leaf sweep in RESULTS.md compares DeepSpeed's defaults with this rule). It is on for
    every model: its buckets never exceed the model, and tests/test_families.py proves the same
    losses on GPT-2, Llama, Qwen2, BERT and RoBERTa.
    """
    if size is None:
        return Buckets(_DEFAULT_BUCKET, _DEFAULT_BUCKET, _DS_DEFAULT_PREFETCH, 0, _DS_DEFAULT_MAX_LIVE)
    # One bucket holds the whole model (one collective per bucket is what costs on gloo); round up
    # to 64 Ki elements so a tiny model does not get a bucket several times its own size.
    whole = -(-size.num_params // 65_536) * 65_536
    bucket = min(_DS_DEFAULT_BUCKET, whole)
    return Buckets(
        reduce_bucket_size=bucket,
        allgather_bucket_size=bucket,
        prefetch_bucket_size=min(_DS_DEFAULT_PREFETCH, whole),
        param_persistence_threshold=0,
        max_live_parameters=min(_DS_DEFAULT_MAX_LIVE, max(whole, _DS_DEFAULT_PREFETCH)),
    )


def _offload(device: str, nvme_path: Optional[str]) -> dict:
    out: dict[str, Any] = {"device": device}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    # Pinned host memory speeds up host<->GPU copies; on a CPU-only run it only costs RAM.
    out["pin_memory"] = True
    return out


def _optimizer(cfg: RunConfig, hf_auto: bool) -> dict:
    o = cfg.optimizer
    if o.name == "sgd":
        params: dict[str, Any] = {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay}
        if hf_auto:  # HF Trainer builds AdamW-style params only; keep SGD concrete except lr
            params["lr"] = AUTO
        # DeepSpeed falls back to getattr(torch.optim, type) for unknown names.
        return {"type": "SGD", "params": params}
    params = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if hf_auto:
        params = {k: AUTO for k in params}
    opt: dict[str, Any] = {"type": "AdamW" if o.name == "adamw" else "Adam", "params": params}
    if o.name == "adam":
        # DeepSpeed's "Adam" means AdamW unless adam_w_mode is false.
        opt["params"]["adam_w_mode"] = False
    return opt


def _scheduler(cfg: RunConfig, total_steps: Optional[int], hf_auto: bool) -> Optional[dict]:
    """DeepSpeed's scheduler matching the run's schedule (for raw `deepspeed.initialize` users).

    zerotrain's own engine drives the LR itself (schedule.lr_lambda) and drops this block, because
    DeepSpeed's schedulers cannot express warmup 0 (warmup_num_steps is at least 2).
    """
    s, lr = cfg.schedule, cfg.optimizer.lr
    warm = max(1, s.warmup_steps)
    if hf_auto:
        if s.name == "constant":
            return {"type": "WarmupLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                   "warmup_num_steps": AUTO}}
        return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                    "warmup_num_steps": AUTO, "total_num_steps": AUTO}}
    if s.name == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                               "warmup_num_steps": warm, "warmup_type": "linear"}}
    if total_steps is None:
        return None  # decay needs the run length; the engine supplies it
    if s.name == "linear":
        return {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                    "warmup_num_steps": warm, "warmup_type": "linear",
                                                    "total_num_steps": total_steps}}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": total_steps, "warmup_min_ratio": 0.0,
                                                 "warmup_num_steps": warm, "warmup_type": "linear",
                                                 "cos_min_ratio": s.min_lr_ratio}}


def build_ds_config(cfg: RunConfig, world_size: Optional[int] = None, model_facts: Optional[ModelFacts] = None,
                    hf_auto: bool = False, total_steps: Optional[int] = None, device: str = "cuda") -> dict:
    """The DeepSpeed config for a run config: `render` of its plan (build_plan).

    world_size: when known, train_batch_size is written and checked; otherwise DeepSpeed derives it
    from micro-batch x grad-accum x its world size. model_facts: sizes buckets (bucket_sizes).
    total_steps: needed for a decaying scheduler block. device: "cuda" (any accelerator; what
    `zerotrain config` writes for) or "cpu" (CPU ranks over gloo).
    """
    if hf_auto and world_size is None and cfg.batch.global_batch is not None:
        cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"global_batch": None})})  # all "auto"
    plan = build_plan(cfg, world_size, backend="deepspeed", device=device, facts=model_facts, total_steps=total_steps)
    return render(plan, hf_auto=hf_auto)


def render(plan: RunPlan, hf_auto: bool = False) -> dict:
    """The DeepSpeed JSON of a plan; nothing reads values back out of it (the plan owns them).

    hf_auto: the HF Trainer / Accelerate flavour ("auto" where they fill values themselves).
    """
    cfg, b, sh = plan.cfg, plan.batch, plan.sharding
    z, p = cfg.zero, cfg.precision
    ds: dict[str, Any] = {}
    if hf_auto:
        ds["train_batch_size"] = AUTO
        ds["train_micro_batch_size_per_gpu"] = AUTO
        ds["gradient_accumulation_steps"] = AUTO
        ds["gradient_clipping"] = AUTO
    else:
        if b.global_batch is not None and cfg.parallel.tp == 1:
            # Under AutoTP DeepSpeed checks this against micro x accum x ALL ranks (its config is read
            # before its tensor-parallel groups exist), so it is left for DeepSpeed to fill in.
            ds["train_batch_size"] = b.global_batch
        ds["train_micro_batch_size_per_gpu"] = b.micro_batch
        ds["gradient_accumulation_steps"] = b.grad_accum
        ds["gradient_clipping"] = cfg.optimizer.clip
    ds["steps_per_print"] = _QUIET_STEPS
    ds["wall_clock_breakdown"] = False

    ds["optimizer"] = _optimizer(cfg, hf_auto)
    sched = _scheduler(cfg, plan.total_steps, hf_auto)
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

    bk = bucket_sizes(plan.facts)
    stage = sh.effective_stage
    zo: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zo["reduce_bucket_size"] = z.reduce_bucket_size or bk.reduce_bucket_size
        zo["contiguous_gradients"] = True
        if stage <= 2:
            zo["allgather_bucket_size"] = z.allgather_bucket_size or bk.allgather_bucket_size
            zo["allgather_partitions"] = True
            # DeepSpeed's reduce-scatter path splits each bucket into per-rank slices (one reduce per
            # destination rank); gloo pays a fixed cost per collective, so on CPU one all-reduce per
            # bucket wins: 1.06x [1.00-1.10] at stage 2 and 1.03x [1.01-1.09] at stage 1, 8 rounds
            # (benchmarks/RESULTS.md, measured on GPT-2 only; a CPU-only choice that is about gloo's
            # per-collective cost, not the model). On GPUs the slices save NCCL bandwidth: DeepSpeed's default.
            zo["reduce_scatter"] = z.reduce_scatter if z.reduce_scatter is not None else plan.device != "cpu"
        zo["overlap_comm"] = z.overlap_comm if z.overlap_comm is not None else stage == 3
    if stage == 3:
        zo["stage3_prefetch_bucket_size"] = _pick(z.prefetch_bucket_size, bk.prefetch_bucket_size)
        zo["stage3_param_persistence_threshold"] = _pick(z.param_persistence_threshold,
                                                         bk.param_persistence_threshold)
        zo["stage3_max_live_parameters"] = _pick(z.max_live_parameters, bk.max_live_parameters)
        zo["stage3_max_reuse_distance"] = zo["stage3_max_live_parameters"]
        # Needed for a full HF export (engine._zero3_consolidated_16bit_state_dict / save_16bit_model).
        zo["stage3_gather_16bit_weights_on_model_save"] = True
        # One fetch/release/reduce hook per transformer block instead of per Linear/LayerNorm (the
        # unit FSDP shards by), on the families where it measured faster (plan.leaf_blocks, RESULTS.md).
        if sh.leaf_blocks:
            zo["leaf_module"] = {"classes": list(sh.leaf_blocks)}
    if z.offload_optimizer != "none":
        zo["offload_optimizer"] = _offload(z.offload_optimizer, z.nvme_path)
    if z.offload_param != "none":
        zo["offload_param"] = _offload(z.offload_param, z.nvme_path)
    ds["zero_optimization"] = zo
    if cfg.parallel.tp > 1:
        # AutoTP training: DeepSpeed splits the block linears (the model's HF tp_plan first, else its
        # AutoTP parser) over tp ranks; its data-parallel size becomes world / tp.
        ds["tensor_parallel"] = {"autotp_size": cfg.parallel.tp}
    if cfg.optimizer.name == "sgd" and stage >= 1:
        # ZeRO refuses optimizers it has not tested (torch SGD among them) unless told otherwise.
        ds["zero_allow_untested_optimizer"] = True
    if z.offload_optimizer != "none":
        # Offloaded optimizer states are stepped by DeepSpeedCPUAdam (built JIT with g++/ninja).
        ds["zero_force_ds_cpu_optimizer"] = True

    return merge_overrides(ds, cfg.ds_overrides)


def _pick(explicit: Optional[int], derived: int) -> int:
    return derived if explicit is None else explicit


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
