"""The resolved run plan: every fact of a run worked out once, from the RunConfig and the world.

    plan = build_plan(cfg, world_size=2, backend="deepspeed", device="cpu", facts=facts, total_steps=100)
    plan.layout.dp, plan.batch.grad_accum, plan.sharding.effective_stage, plan.dtype

`zerotrain train`, `config`, `estimate` and `compare` all build RunPlans, so they cannot disagree.
The DeepSpeed JSON (ds_config.render) and FSDP's `fully_shard` arguments (backends/fsdp/engine.py fsdp_arguments) are
renderings of the plan, and nothing reads a value back out of them. The validity rules it applies
live in zerotrain/config/rules.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..config.schema import RunConfig
from ..distributed.layout import MESH_DIMS, ParallelDegrees, WorldLayout  # noqa: F401  (MESH_DIMS: re-exported)
from ..errors import ConfigError
from ..model.facts import ModelFacts
from ..model.preparation import ModelPreparation
from ..tasks import TaskSpec, task_spec

if TYPE_CHECKING:
    from .registry import EngineKind

from ..config.rules import offload_problem, unused_settings
from .capabilities import BACKENDS, NAMES, SPLIT_BY, auto_backend, effective_stage, runs_as_why
from .parallel_rules import (check_backend, check_optimizer, check_parallel, resolve_batch, resolve_stage,
                             router_warnings)


LEAF_BLOCKS_MEASURED = frozenset({"gpt2", "llama", "qwen3_moe"})
"""Model types on which ZeRO-3 leaf blocks were measured faster than per-submodule hooks with the
same losses (benchmarks/RESULTS.md, "ZeRO-3 speed defaults per model family": fp32, 2 CPU ranks,
seq 128, micro-batch 4, grad-accum 2, 5 rounds; step time without / with leaf blocks, paired per
round): Llama (small-llama 4x256, GQA) 1.10x [0.96-1.14]; GPT-2 (small-gpt2 4x256) 1.08x in
session 6 (0.571 -> 0.530 s/step), 1.32x [0.67-1.93] on a noisier machine in session 8; Qwen3-MoE (4x256, 8 experts
top-2; benchmarks/results/moe.md: seq 256, micro-batch 4, grad-accum 1, 5 rounds) 1.03x [1.01-1.05] tokens/s with
the decoder block as leaf, while the sparse MoE block alone as leaf (DeepSpeed's MoE fix) measured 1.00x
[0.94-1.01]; the block leaf fetches each block's experts together whatever the routing too.
zero.leaf_blocks None (auto) turns them on for these only; correctness is proven wider
(tests/multirank/test_families.py runs BERT, RoBERTa and Qwen2 with them forced on), but a speed default is
on only where it was measured."""


@dataclass(frozen=True)
class BatchPlan:
    """Samples per forward, per optimizer step, and the accumulation between them."""

    micro_batch: int
    """Samples per data-parallel replica per forward/backward."""
    grad_accum: int
    """Micro-batches per optimizer step (pipeline micro-batches under pipeline parallelism)."""
    global_batch: Optional[int]
    """Samples per optimizer step over all replicas; None when the world size is not known."""

    @property
    def step_micro_batches(self) -> int:
        """Micro-batches of one optimizer step over every data-parallel replica (grad_accum x dp = global batch /
        micro-batch): what a loss summed over a whole step's tokens is scaled by."""
        if self.global_batch is None:
            raise ConfigError("this needs the world size; pass --world-size N")
        return self.global_batch // self.micro_batch


@dataclass(frozen=True)
class ShardingPlan:
    """What is sharded and where it lives."""

    stage: int
    """The ZeRO stage asked for: zero.stage, or the stage the parallel layout resolved it to (stage_why)."""
    effective_stage: int
    """The stage the backend really runs: FSDP has no optimizer-only sharding, so 1 runs as 2."""
    offload_optimizer: str
    """none, cpu or nvme."""
    offload_param: str
    """none, cpu or nvme (stage 3)."""
    leaf_blocks: tuple[str, ...] = ()
    """DeepSpeed ZeRO-3: block classes made leaf modules (empty = per-submodule hooks)."""
    leaf_blocks_why: str = ""
    """Why leaf blocks are on or off (DeepSpeed stage 3 only; for the start banner)."""
    stage_why: str = ""
    """Why `stage` is not zero.stage (a default the tensor/pipeline layout does not support), else ""."""

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP: free gathered parameters after each block's forward (stage 3) or keep them to backward."""
        return self.effective_stage == 3

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_param != "none"


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

    Evidence (benchmarks/results/sweep_stage3.md and its .json, rerun 2026-11-26: small-gpt2 4x256, seq
    128, micro-batch 4, grad-accum 2, bf16, 2 CPU ranks, 4 interleaved rounds, median [min-max] of per-round
    ratios to DeepSpeed's defaults, per-rank model-state bytes counted from engine tensors): this rule
    1.01x [0.97-1.06] (the same speed) at 33 MiB vs DeepSpeed defaults (persistence 1e5, 5e8 buckets) at
    981 MiB; persistence 10*h / 1e4 / 1e5 instead of 0: 1.01x / 1.01x / 1.00x; prefetch 0: 0.94x;
    reduce bucket 1e6: 0.95x at 28.5 MiB; reduce bucket h*h: 0.86x; Accelerate/HF "auto" rule (bucket h*h,
    prefetch 0.9*h*h, persistence 10*h): 0.84x. Small buckets cost one gloo collective each.

    Families measured: GPT-2 (the sweep above) and Llama (small-llama 4x256, GQA, untied head: the
    per-family leaf sweep in RESULTS.md compares DeepSpeed's defaults with this rule). It is on for
    every model: its buckets never exceed the model, and tests/multirank/test_families.py proves the same
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


@dataclass(frozen=True)
class CommPlan:
    """DeepSpeed's communication sizes (elements) and switches, resolved: an explicit zero.* value, else
    the measured rule (bucket_sizes). ds_config.render writes them and memory/estimate.py sizes its buffers by them."""

    reduce_bucket_size: int
    """Gradient reduce bucket (stages 1-3)."""
    allgather_bucket_size: int
    """Parameter all-gather bucket (stages 1-2)."""
    prefetch_bucket_size: int
    """ZeRO-3 parameter prefetch."""
    param_persistence_threshold: int
    """ZeRO-3: tensors smaller than this stay unpartitioned."""
    max_live_parameters: int
    """ZeRO-3: parameters gathered at once."""
    reduce_scatter: bool
    """Stages 1-2: reduce-scatter slices (GPU) or one all-reduce per bucket (CPU; see ds_config.render)."""
    overlap_comm: bool
    """Overlap reduction with backward (on at stage 3)."""


@dataclass(frozen=True)
class RunPlan:
    """One run, resolved: the single owner of every derived run fact."""

    cfg: RunConfig
    """The validated run config the plan was resolved from."""
    task: TaskSpec
    """The task the run trains, resolved once (zerotrain/tasks.py): model.task's entry, or the one it becomes on the
    model (task_for_model: causal-lm on an image-text model trains image-text); every reader after the plan reads it
    here, and model.task keeps the asked task."""
    backend: str
    """deepspeed or fsdp (resolve.select_backend decides for backend=auto)."""
    backend_why: str
    """Why this backend (logged when the engine starts), e.g. "backend=auto and deepspeed imports"."""
    device: str
    """cuda (any accelerator) or cpu: where the ranks compute."""
    parallel: ParallelDegrees
    """The model-parallel degrees (parallel.tp / pp / sp / ep), stored once: `layout.parallel` is this object."""
    layout: Optional[WorldLayout]
    """The world's arrangement of `parallel`; None when the world size is not known (`zerotrain config`)."""
    batch: BatchPlan
    """Micro-batch, grad-accum and global batch over the data-parallel replicas."""
    dtype: str
    """Training precision: fp32, bf16 or fp16 (master weights stay fp32)."""
    sharding: ShardingPlan
    """What the backend shards and offloads (stage as run, leaf blocks)."""
    facts: Optional[ModelFacts] = None
    """The model's size and shape when known (sizes DeepSpeed's buckets, picks the leaf blocks)."""
    total_steps: Optional[int] = None
    """Optimizer steps the run trains for, when known."""
    steps_per_epoch: Optional[int] = None
    """Optimizer steps per pass over the training data, when the data is known."""
    warnings: tuple[str, ...] = ()
    """One-line warnings about settings that run, but badly, on this device."""
    lr: float = 0.0
    """Peak learning rate: optimizer.lr, or the embedded demo's DEMO_LR when --lr is not given."""
    comm: Optional[CommPlan] = None
    """DeepSpeed's bucket sizes and communication switches (None for FSDP)."""
    backend_fallback: bool = False
    """backend=auto fell back to FSDP because DeepSpeed does not import (the engine warns)."""
    preparation: ModelPreparation = field(default_factory=ModelPreparation)
    """What the engine does to the built model before training: LoRA, then QAT (zerotrain/model/preparation.py);
    the one answer to "is LoRA / QAT on?" for the engines, the checkpoint identity and the banner."""

    @property
    def engine_kind(self) -> "EngineKind":
        """The engine this plan runs on and the checkpoint format it writes (plan/registry.py)."""
        from .registry import engine_kind

        return engine_kind(self.backend, self.parallel.pp > 1)

    @property
    def checkpoint_format(self) -> str:
        """What the run's checkpoints are written as: deepspeed, deepspeed-pipe or dcp."""
        return self.engine_kind.checkpoint_format

    @property
    def world(self) -> WorldLayout:
        """The layout, for code that needs the world size (a run, an estimate)."""
        if self.layout is None:
            raise ConfigError("this needs the world size; pass --world-size N")
        return self.layout

    def notes(self) -> list[str]:
        """One-line facts about how the run is sharded, for the start banner."""
        s = self.sharding
        out = [s.stage_why] if s.stage_why else []
        out += [self.stage_note()] if self.stage_note() else []
        if s.leaf_blocks_why:
            out.append(f"ZeRO-3 leaf blocks: {s.leaf_blocks_why}")
        return out

    def stage_note(self) -> str:
        """Why the stage that runs is not the one asked for ("" when it is)."""
        s = self.sharding
        if s.effective_stage == s.stage:
            return ""
        return (f"zero.stage={s.stage} under {NAMES[self.backend]} runs as stage {s.effective_stage}: "
                f"{runs_as_why(self.backend, s.stage)}")

    def describe(self) -> str:
        """The start banner's run line: layout, batch arithmetic, sharding, dtype."""
        b, s = self.batch, self.sharding
        off, par = [], self.parallel
        if par.tp > 1:
            off.append(f"tensor-parallel {par.tp} (blocks split by {SPLIT_BY[(self.backend, 'tp')]})")
        if par.pp > 1:
            p, m = par.pp, b.grad_accum
            off.append(f"pipeline {p} stages x {m} micro-batches (bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.2f})")
        if par.sp > 1:
            off.append(f"sequence-parallel {par.sp} (each sequence cut in {par.sp}, Ulysses all-to-all "
                       "attention)")
        off += [f"{what} offload {dev}" for what, dev in (("optimizer", s.offload_optimizer), ("param", s.offload_param))
               if dev != "none"]
        world = self.world
        return (f"{world.describe()}; global batch {b.global_batch} = micro {b.micro_batch} x accum {b.grad_accum} x "
                f"{world.dp} data-parallel; {self.backend} ZeRO stage {s.stage}"
                + (f" (runs as {s.effective_stage})" if s.effective_stage != s.stage else "")
                + "".join(f", {o}" for o in off) + f", {self.dtype}")


def leaf_blocks(setting: Optional[bool], facts: Optional[ModelFacts],
                split_forward: bool = False, compiled: bool = False) -> tuple[tuple[str, ...], str]:
    """(classes to make ZeRO-3 leaf modules, why) for a stage-3 DeepSpeed run; no classes = off.

    The reason is one phrase for the start banner ("on (GPT2Block): measured faster for gpt2").
    split_forward (--dpo-split-forward): two forwards before one backward, which a leaf module's gradient hook
    cannot take (DeepSpeed 0.19 asserts in stage3.__reduce_and_partition_ipg_grads): off, refused if asked for.
    compiled (--compile): on whatever the model type, so no ZeRO-3 hook sits inside a compiled block."""
    if compiled and (setting is False or split_forward):
        why = "zero.leaf_blocks: false" if setting is False else "--dpo-split-forward (no leaf blocks)"
        raise ConfigError(f"compile.enabled with {why} at ZeRO-3: compiled blocks must be ZeRO-3 leaf modules, "
                          "so DeepSpeed's per-layer hooks stay outside the compiled code; drop one")
    if setting is False:
        return (), "off (zero.leaf_blocks: false)"
    if split_forward:
        if setting:
            raise ConfigError("zero.leaf_blocks: true with --dpo-split-forward: DeepSpeed's leaf modules reduce their "
                              "gradients once per forward, and the split runs two forwards per backward; drop one")
        return (), "off: --dpo-split-forward runs two forwards per backward, which leaf modules cannot take"
    if facts is None or not facts.block_classes:
        return (), "off (the model and its transformer blocks are not known here)"
    names = ", ".join(facts.block_classes)
    if setting:
        return facts.block_classes, f"on ({names}): zero.leaf_blocks: true"
    if compiled:
        return facts.block_classes, f"on ({names}): --compile compiles each block (no ZeRO-3 hook inside one)"
    if facts.model_type not in LEAF_BLOCKS_MEASURED:
        return (), (f"off: not measured for model type '{facts.model_type or '?'}' (measured: "
                    f"{', '.join(sorted(LEAF_BLOCKS_MEASURED))}); zero: {{leaf_blocks: true}} in --config turns it on")
    return facts.block_classes, f"on ({names}): measured faster for {facts.model_type} (benchmarks/RESULTS.md)"


def _sharding(cfg: RunConfig, backend: str, facts: Optional[ModelFacts]) -> ShardingPlan:
    z = cfg.zero
    stage, stage_why = resolve_stage(cfg, backend)
    problem = offload_problem(stage, z.offload_optimizer, z.offload_param) if stage_why else None
    if problem:
        raise ConfigError(f"{stage_why}, and {problem}")
    classes: tuple[str, ...] = ()
    why = ""
    if backend == "deepspeed" and stage == 3:
        classes, why = leaf_blocks(z.leaf_blocks, facts, cfg.pref.split_forward, cfg.compile.enabled)
        named = cfg.ds_overrides.get("zero_optimization", {}).get("leaf_module")
        if named is not None:  # the user's raw DeepSpeed key wins over the typed setting
            classes, why = (), f"{json.dumps(named)} from ds_overrides.zero_optimization.leaf_module"
    return ShardingPlan(stage=stage, effective_stage=effective_stage(backend, stage),
                        offload_optimizer=z.offload_optimizer, offload_param=z.offload_param,
                        leaf_blocks=classes, leaf_blocks_why=why, stage_why=stage_why)


def _comm(cfg: RunConfig, backend: str, device: str, stage: int, facts: Optional[ModelFacts]) -> Optional[CommPlan]:
    """DeepSpeed's communication plan: explicit zero.* values win over the measured rule."""
    if backend != "deepspeed":
        return None
    z, bk = cfg.zero, bucket_sizes(facts)

    def pick(explicit: Optional[int], derived: int) -> int:
        return derived if explicit is None else explicit

    return CommPlan(
        reduce_bucket_size=z.reduce_bucket_size or bk.reduce_bucket_size,
        allgather_bucket_size=z.allgather_bucket_size or bk.allgather_bucket_size,
        prefetch_bucket_size=pick(z.prefetch_bucket_size, bk.prefetch_bucket_size),
        param_persistence_threshold=pick(z.param_persistence_threshold, bk.param_persistence_threshold),
        max_live_parameters=pick(z.max_live_parameters, bk.max_live_parameters),
        # DeepSpeed's reduce-scatter path splits each bucket into per-rank slices (one reduce per
        # destination rank); gloo pays a fixed cost per collective, so on CPU one all-reduce per
        # bucket is 1.01x [1.00-1.01] of reduce-scatter on this machine's 0.87 s bf16 step, never slower
        # (benchmarks/results/sweep_stage{1,2}.md.json, 8 rounds, GPT-2; a CPU-only choice about gloo's
        # per-collective cost, not the model). On GPUs the slices save NCCL bandwidth: DeepSpeed's default.
        # DeepSpeed's ZeRO 1-2 asserts reduce-scatter for MoE parameter groups (AutoEP's experts under --ep).
        reduce_scatter=z.reduce_scatter if z.reduce_scatter is not None else device != "cpu" or cfg.parallel.ep > 1,
        overlap_comm=z.overlap_comm if z.overlap_comm is not None else stage == 3)


def degrees(cfg: RunConfig) -> ParallelDegrees:
    """The model-parallel degrees a config asks for (parallel.tp / pp / sp / ep): the one reader of them; the
    plan stores the result (RunPlan.parallel) and everyone else reads it there."""
    par = cfg.parallel
    return ParallelDegrees(tp=par.tp, pp=par.pp, sp=par.sp, ep=par.ep)


def check_rollout_cache(cfg: RunConfig, task: TaskSpec, facts: Optional[ModelFacts]) -> None:
    """rl.cache_implementation static on a model transformers builds no static KV cache for: refused here, before
    launch, in the model facts' one line (ModelFacts.static_cache_refusal), not at the first generation phase."""
    if task.online_rl is not None and cfg.rl.cache_implementation == "static" and facts is not None \
            and facts.static_cache_refusal:
        raise ConfigError(facts.static_cache_refusal)


def build_plan(cfg: RunConfig, world_size: Optional[int], *, backend: str = "deepspeed", backend_why: str = "",
               device: str = "cuda",
               facts: Optional[ModelFacts] = None, total_steps: Optional[int] = None,
               steps_per_epoch: Optional[int] = None, native_cpu_bf16: Optional[bool] = None,
               lr: Optional[float] = None, batch_from_hf: bool = False, task: Optional[TaskSpec] = None,
               preparation: Optional[ModelPreparation] = None) -> RunPlan:
    """Resolve a run: refuses (ConfigError, one line) what the backend or device cannot run.

    world_size None: the plan of a config without a world (`zerotrain config`): no global batch.
    lr: the peak LR when it is not optimizer.lr (the embedded demo's, resolve.plan_run).
    batch_from_hf: HF Trainer / Accelerate fill the batch sizes ("auto"): a global batch without a
    world size is left to them instead of refused.
    task: the task as the model resolved it (ModelSource.task: train's preflight); None: model.task's entry.
    preparation: the ModelPreparation already made for this config and task (train's preflight); None: made here.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r}: use deepspeed or fsdp")
    task = task or task_spec(cfg.model.task)
    warnings = check_backend(cfg, backend, device, native_cpu_bf16)
    check_rollout_cache(cfg, task, facts)
    parallel = degrees(cfg)
    if world_size is not None:
        check_parallel(cfg, backend, parallel, world_size, facts, task)
    layout = parallel.layout(world_size) if world_size is not None else None
    if layout is not None:
        micro, accum, global_batch = resolve_batch(cfg, layout.dp)
    elif cfg.batch.global_batch is not None and not batch_from_hf:
        raise ConfigError("batch.global_batch needs the world size to derive grad_accum; "
                          "pass --world-size N or set --grad-accum instead")
    else:
        micro, accum, global_batch = cfg.batch.micro_batch, cfg.batch.grad_accum, None
    sharding = _sharding(cfg, backend, facts)
    check_optimizer(cfg, backend, parallel)
    fallback = cfg.backend == "auto" and backend == "fsdp" and auto_backend(parallel.asked) is None
    warnings += unused_settings(cfg, backend, sharding.effective_stage, device, backend_fallback=fallback, task=task)
    warnings += router_warnings(cfg, facts)
    return RunPlan(cfg=cfg, task=task, backend=backend, backend_why=backend_why or f"backend={backend}", device=device,
                   parallel=parallel, layout=layout,
                   batch=BatchPlan(micro, accum, global_batch), dtype=cfg.precision.dtype,
                   sharding=sharding, facts=facts, total_steps=total_steps,
                   steps_per_epoch=steps_per_epoch, warnings=tuple(warnings),
                   lr=cfg.optimizer.lr if lr is None else lr,
                   comm=_comm(cfg, backend, device, sharding.effective_stage, facts),
                   preparation=preparation or ModelPreparation.from_config(cfg, task),
                   backend_fallback=fallback)


def with_model(plan: RunPlan, facts: ModelFacts) -> RunPlan:
    """The plan of a run whose model was not known when it was resolved (build_engine called with a
    plain model factory): the rules and defaults that need the model (parallel splits, ZeRO-3 leaf
    blocks, bucket sizes) resolved now, once, before the engine is built (resolve.engine_plan)."""
    if plan.facts is not None:
        return plan
    return build_plan(plan.cfg, plan.layout.world_size if plan.layout else None, backend=plan.backend,
                      backend_why=plan.backend_why, device=plan.device, facts=facts, total_steps=plan.total_steps,
                      steps_per_epoch=plan.steps_per_epoch, lr=plan.lr, task=plan.task)
