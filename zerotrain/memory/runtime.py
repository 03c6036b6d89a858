"""The runtime side of a rank's memory, measured on this machine: what a CPU rank's RSS holds besides the
model states and activations zerotrain/memory/estimate.py counts (the runtime baseline, the train CLI, allocator
slack) and the transient copies a training step makes. Constants fitted to measurements
(benchmarks/PEAK_CALIBRATION.md), not a model: another torch/DeepSpeed build, CPU or GPU differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model.facts import ModelFacts
    from ..plan.run_plan import RunPlan


# Runtime RSS of one CPU rank before any model state: python + torch + transformers + the backend,
# the gloo process group, DeepSpeed's accelerator probing, its JIT-loaded ops and (stages 1-3) the
# ZeRO optimizer modules. Measured on this machine (x86-64, 2 CPU ranks, torch 2.13 CPU, deepspeed
# 0.19.8, transformers 5) with tests/support/memory_worker.py on tiny-gpt2 as peak VmHWM minus the predicted
# model states, activations and transient; fitted values per run (MiB, both ranks):
#   DeepSpeed stage 0   fp32 387.5-389.1, bf16 400.0-400.6
#   DeepSpeed stage 1-3 fp32 428.2-436.1, bf16 430.1-448.2 (incl. offload)
#   FSDP2 / DDP         fp32 368.4-373.7, bf16 (FSDP2 stage 3) 384.9
# These are constants, not a model: another torch/DeepSpeed build, CPU or GPU (CUDA context) differs.
_MIB = 2**20
BASELINE_RSS: dict[str, int] = {"deepspeed-stage0": 394 * _MIB, "deepspeed-zero": 438 * _MIB, "fsdp": 372 * _MIB}
TRAIN_CLI_EXTRA_RSS = 95 * _MIB
"""`zerotrain train` on top of the baseline: datasets + tokenizers + data pipeline, metrics, the final
checkpoint save (measured 93-96 MiB with `zerotrain compare` on tiny-gpt2, stages 0 and 3)."""


RUN_SLACK_RSS = 130 * _MIB
"""A whole `zerotrain train` run on top of baseline + CLI extra + model states + activations + transients, at any
size: glibc heap fragmentation (the mmap threshold is 32 MiB, so freed tensors stay in RSS for reuse) and the
autograd/loss temporaries the activation formula leaves out. Measured as the residual of small-gpt2 and
small-llama runs (2 ranks, fp32, micro-batch 4 x seq 128, grad-accum 1 and 2, 4 steps, save_final on;
benchmarks/PEAK_CALIBRATION.md): 75-185 MiB after the step transient below, largest on GPT-2 (whose runs the
estimate under-predicts by up to 5%; small-llama's it over-predicts by up to 10%)."""

STEP_COPIES = 1.5
"""Whole-model fp32 copies (4 bytes x trainable elements of the rank) a training step holds at its peak beyond the
model states and activations: the gradients flattened for the all-reduce/reduce bucket (one copy) and the
optimizer step's temporaries (torch Adam's foreach sqrt/denominator lists over the rank's share). Measured
1.3-1.9 copies beyond states + activations + the slack above on a 56 M-parameter Llama at DeepSpeed stage 0-2
and DDP (2 ranks, fp32, grad-accum 1); sharded stages hold more (see step_transient)."""


LORA_EXTRA_RSS = 20 * _MIB
"""A LoRA run on top of the baseline: peft's import and get_peft_model's own allocations. peft alone costs
136 MiB in a bare process, but in a rank transformers + deepspeed already hold what it pulls in
(accelerate, scipy): peak RSS with LoRA minus without, 2 ranks, tests/support/memory_worker.py: 13-22 MiB."""


FITTED_CONSTANTS = ("BASELINE_RSS", "TRAIN_CLI_EXTRA_RSS", "RUN_SLACK_RSS", "STEP_COPIES", "LORA_EXTRA_RSS")
"""The names of the constants above that were fitted to measured runs (benchmarks/PEAK_CALIBRATION.md)."""


def constants_fingerprint() -> str:
    """sha256 (first 16 hex digits) of the fitted constants' values: benchmarks/PEAK_CALIBRATION.md quotes the
    fingerprint its held-out errors were measured with, so a constant changed after that validation shows (a unit
    test compares the two) and the held-out runs must be redone, not refitted to."""
    import hashlib
    import json

    values = {name: globals()[name] for name in FITTED_CONSTANTS}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CalibratedRegion:
    """The runs the whole-run peak estimate (estimate.run_peak_rss) was measured against, in-sample or held out
    (benchmarks/PEAK_CALIBRATION.md): a plan outside them gets a prediction nobody has checked."""

    device: str
    """Where the measured ranks ran ("cpu": the constants are CPU-only RSS)."""
    world_sizes: tuple[int, ...]
    """Ranks per run that were measured."""
    max_params: int
    """The largest model measured (parameter elements)."""
    model_types: tuple[str, ...]
    """HF model_types measured."""
    dtypes: tuple[str, ...]
    """Training precisions measured."""
    max_tokens_per_micro_batch: int
    """Largest micro-batch x seq-len measured (activations scale with it)."""
    max_tp: int
    """Largest tensor-parallel size measured."""
    max_pp: int
    """Largest pipeline size measured."""
    max_sp: int
    """Largest sequence-parallel size measured."""
    lora: bool
    """Whether LoRA runs were measured."""
    offload_param: bool
    """Whether ZeRO-3 parameter offload was measured (optimizer offload was)."""
    gradient_checkpointing: bool
    """Whether runs with recomputed activations were measured."""


CALIBRATED = CalibratedRegion(device="cpu", world_sizes=(2,), max_params=56_300_000,
                              model_types=("gpt2", "llama", "qwen2", "mistral"), dtypes=("fp32", "bf16"),
                              max_tokens_per_micro_batch=4 * 128, max_tp=2, max_pp=1, max_sp=1, lora=False,
                              offload_param=True, gradient_checkpointing=True)
"""Where benchmarks/results/peak_in_sample.json (in-sample) and benchmarks/results/peak_heldout.json (held out)
measured the estimate within 15%: LoRA, pp=2, longer micro-batches, 137 M parameters (FSDP2) and the BERT encoder
were measured and missed (benchmarks/PEAK_CALIBRATION.md), so they lie outside. tests/unit/test_memory_calibration.py
checks every value against those files."""


def outside_calibration(plan: RunPlan, spec: ModelFacts, region: CalibratedRegion = CALIBRATED,
                        device: str | None = None) -> list[str]:
    """Why a plan's peak estimate lies outside the measured region (one short phrase each; empty = inside).
    device: where the figure in question is for, if not plan.device (`estimate`'s CPU-run column)."""
    why = []
    device = device or plan.device
    if device != region.device:
        why.append(f"device {device} (measured on {region.device} ranks only)")
    if plan.world.world_size not in region.world_sizes:
        why.append(f"{plan.world.world_size} ranks (measured: {', '.join(map(str, region.world_sizes))})")
    if spec.num_params > region.max_params:
        why.append(f"{spec.num_params / 1e6:,.0f} M parameters (largest measured: {region.max_params / 1e6:,.0f} M)")
    if spec.model_type and spec.model_type not in region.model_types:
        why.append(f"model type {spec.model_type} (measured: {', '.join(region.model_types)})")
    if plan.dtype not in region.dtypes:
        why.append(f"{plan.dtype} (measured: {', '.join(region.dtypes)})")
    tokens = plan.batch.micro_batch * row_tokens(plan)
    if tokens > region.max_tokens_per_micro_batch:
        why.append(f"{tokens:,} tokens per micro-batch (largest measured: {region.max_tokens_per_micro_batch:,})")
    if plan.world.tp > region.max_tp:
        why.append(f"tp {plan.world.tp} (largest measured: {region.max_tp})")
    if plan.world.pp > region.max_pp:
        why.append(f"pp {plan.world.pp} (largest measured: {region.max_pp})")
    if plan.world.sp > region.max_sp:
        why.append(f"sp {plan.world.sp} (largest measured: {region.max_sp})")
    if spec.frozen_params and not region.lora:
        why.append("LoRA (not measured)")
    if plan.sharding.offload_param != "none" and not region.offload_param:
        why.append("parameter offload (not measured)")
    if plan.cfg.model.gradient_checkpointing and not region.gradient_checkpointing:
        why.append("gradient checkpointing (not measured)")
    return why


def baseline_rss(backend: str, stage: int) -> int:
    """BASELINE_RSS entry for a backend and stage."""
    if backend == "fsdp":
        return BASELINE_RSS["fsdp"]
    return BASELINE_RSS["deepspeed-stage0" if stage == 0 else "deepspeed-zero"]


def dtype_bytes(precision: str) -> int:
    """Bytes per element of the training dtype."""
    return 4 if precision == "fp32" else 2  # bf16/fp16 (the config admits no other)


def row_tokens(plan: RunPlan) -> int:
    """Tokens of one model row: data.seq_len; online RL trains on prompt + completion rows (train/grpo.py _collate),
    at most pref.max_prompt_len (unset: data.seq_len, the estimate's stand-in: GRPO does not cut prompts then) +
    rl.max_completion_len tokens, the same bound the generation's KV cache is sized by."""
    cfg = plan.cfg
    if "generation" not in plan.task.estimate_parts:
        return cfg.data.seq_len
    return (cfg.pref.max_prompt_len or cfg.data.seq_len) + cfg.rl.max_completion_len


def step_transient(spec: ModelFacts, plan: RunPlan, prefetch: int = 0) -> int:
    """Bytes a training step holds at its peak beyond model states and activations (see FORMULAS, "Whole run"):
    STEP_COPIES x 4 bytes x the rank's trainable elements (one more copy when accumulating); where the model
    is sharded (DeepSpeed stage 3, FSDP2 stage 2/3) one gathered copy of the whole (rank-local) model plus its
    unsharded gradients; under DeepSpeed stage 3 also the `prefetch` elements fetched ahead of the blocks in use."""
    backend, stage = plan.backend, plan.sharding.effective_stage
    F = spec.frozen_params
    P, L = spec.num_params - F, dtype_bytes(plan.dtype)
    out = int(STEP_COPIES * 4 * P)
    if plan.batch.grad_accum > 1:  # a later micro-batch's fresh gradients, next to the accumulated ones
        out += 4 * P
    if (backend == "deepspeed" and stage == 3) or (backend == "fsdp" and stage >= 2):
        out += L * (P + F) + (4 if backend == "fsdp" else L) * P  # FSDP2 reduces in fp32
    if backend == "deepspeed" and stage == 3:
        out += L * min(prefetch, spec.num_params)
    return out
