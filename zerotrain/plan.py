"""The resolved run plan: every fact of a run worked out once, from the RunConfig and the world.

    plan = build_plan(cfg, world_size=2, backend="deepspeed", device="cpu", facts=facts, total_steps=100)
    plan.layout.dp, plan.batch.grad_accum, plan.sharding.effective_stage, plan.dtype

`zerotrain train`, `config`, `estimate` and `compare` all build RunPlans, so they cannot disagree.
The DeepSpeed JSON (ds_config.render) and FSDP's `fully_shard` arguments (backends/fsdp.py) are
renderings of the plan, and nothing reads a value back out of them. The validity rules it applies
live in zerotrain/rules.py.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from .config import RunConfig
from .errors import ConfigError
from .model_info import ModelFacts
from .rules import check_backend, check_parallel, offload_problem, resolve_batch, resolve_stage

BACKENDS = ("deepspeed", "fsdp")

LEAF_BLOCKS_MEASURED = frozenset({"gpt2", "llama"})
"""Model types on which ZeRO-3 leaf blocks were measured faster than per-submodule hooks with the
same losses (benchmarks/RESULTS.md, "ZeRO-3 speed defaults per model family": fp32, 2 CPU ranks,
seq 128, micro-batch 4, grad-accum 2, 5 rounds; step time without / with leaf blocks, paired per
round): Llama (small-llama 4x256, GQA) 1.10x [0.96-1.14]; GPT-2 (small-gpt2 4x256) 1.08x in
session 6 (0.571 -> 0.530 s/step), 1.32x [0.67-1.93] on a noisier machine in session 8.
zero.leaf_blocks None (auto) turns them on for these only; correctness is proven wider
(tests/test_families.py runs BERT, RoBERTa and Qwen2 with them forced on), but a speed default is
on only where it was measured."""


@dataclass(frozen=True)
class WorldLayout:
    """How the ranks are arranged (after torchtitan's ParallelDims): world = pp x dp x tp.

    Ranks are ordered with tensor parallelism innermost (neighbouring ranks share a layer), then data
    parallelism, then pipeline stages."""

    world_size: int
    """Every rank of the job (nodes x ranks per node)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer and read the same batch."""
    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a slice of the layer stack."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1 (got {self.world_size})")
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ConfigError(f"{self.world_size} ranks cannot be split into tensor-parallel {self.tp} x pipeline "
                              f"{self.pp} groups; pick tp x pp dividing the world size")

    @property
    def dp(self) -> int:
        """Data-parallel size: model replicas that each read their own batches."""
        return self.world_size // (self.tp * self.pp)

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica a global rank belongs to (keys its sampler and metrics)."""
        return (rank // self.tp) % self.dp

    def pp_stage(self, rank: int) -> int:
        """Which pipeline stage a global rank runs (0 = the embeddings' stage)."""
        return rank // (self.tp * self.dp)

    def counts_for_data(self, rank: int) -> bool:
        """Whether this rank's batch figures count once for its replica (its first tensor-parallel
        rank on the last pipeline stage; every rank when there is data parallelism only)."""
        return rank % self.tp == 0 and rank // (self.tp * self.dp) == self.pp - 1

    def describe(self) -> str:
        parts = [f"data-parallel {self.dp}"]
        if self.tp > 1:
            parts.append(f"tensor-parallel {self.tp}")
        if self.pp > 1:
            parts.append(f"pipeline {self.pp}")
        return f"{self.world_size} ranks = " + " x ".join(parts)


@dataclass(frozen=True)
class BatchPlan:
    """Samples per forward, per optimizer step, and the accumulation between them."""

    micro_batch: int
    """Samples per data-parallel replica per forward/backward."""
    grad_accum: int
    """Micro-batches per optimizer step (pipeline micro-batches under pipeline parallelism)."""
    global_batch: Optional[int]
    """Samples per optimizer step over all replicas; None when the world size is not known."""


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
class RunPlan:
    """One run, resolved: the single owner of every derived run fact."""

    cfg: RunConfig
    """The validated run config the plan was resolved from."""
    backend: str
    """deepspeed or fsdp (engine.select_backend decides for backend=auto)."""
    backend_why: str
    """Why this backend (logged when the engine starts), e.g. "backend=auto and deepspeed imports"."""
    device: str
    """cuda (any accelerator) or cpu: where the ranks compute."""
    layout: Optional[WorldLayout]
    """The world's arrangement; None when the world size is not known (`zerotrain config`)."""
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
        return (f"zero.stage={s.stage} under FSDP runs as stage {s.effective_stage}: FSDP has no optimizer-only "
                "sharding (gradients are sharded too); use --backend deepspeed for a true stage 1")

    def describe(self) -> str:
        """The start banner's run line: layout, batch arithmetic, sharding, dtype."""
        b, s = self.batch, self.sharding
        off = []
        if self.layout and self.layout.tp > 1:
            how = "the model's tp_plan" if self.backend == "fsdp" else "DeepSpeed AutoTP"
            off.append(f"tensor-parallel {self.layout.tp} (blocks split by {how})")
        if self.layout and self.layout.pp > 1:
            p, m = self.layout.pp, b.grad_accum
            off.append(f"pipeline {p} stages x {m} micro-batches (bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.2f})")
        off += [f"{what} offload {dev}" for what, dev in (("optimizer", s.offload_optimizer), ("param", s.offload_param))
               if dev != "none"]
        world = self.world
        return (f"{world.describe()}; global batch {b.global_batch} = micro {b.micro_batch} x accum {b.grad_accum} x "
                f"{world.dp} data-parallel; {self.backend} ZeRO stage {s.stage}"
                + (f" (runs as {s.effective_stage})" if s.effective_stage != s.stage else "")
                + "".join(f", {o}" for o in off) + f", {self.dtype}")

    def with_model_blocks(self, block_classes: tuple[str, ...], model_type: str) -> RunPlan:
        """The plan once the built model's blocks are known (an engine built without ModelFacts)."""
        if self.facts is not None and self.facts.block_classes:
            return self
        facts = ModelFacts(0, 1, block_classes=block_classes, model_type=model_type)
        sharding = _sharding(self.cfg, self.backend, facts)
        return dataclasses.replace(self, sharding=sharding)

    def with_model_facts(self, facts: ModelFacts) -> RunPlan:
        """The plan once the built model is known (an engine built without ModelFacts): the parallel
        rules that need the model run now."""
        if self.layout is not None:
            check_parallel(self.cfg, self.backend, self.layout.world_size, facts)
        return dataclasses.replace(self, facts=facts, sharding=_sharding(self.cfg, self.backend, facts))


def effective_stage(backend: str, stage: int) -> int:
    """The ZeRO stage a backend really runs for the asked one."""
    return 2 if backend == "fsdp" and stage == 1 else stage


def leaf_blocks(setting: Optional[bool], facts: Optional[ModelFacts]) -> tuple[tuple[str, ...], str]:
    """(classes to make ZeRO-3 leaf modules, why) for a stage-3 DeepSpeed run; no classes = off.

    The reason is one phrase for the start banner ("on (GPT2Block): measured faster for gpt2")."""
    if setting is False:
        return (), "off (zero.leaf_blocks: false)"
    if facts is None or not facts.block_classes:
        return (), "off (the model and its transformer blocks are not known here)"
    names = ", ".join(facts.block_classes)
    if setting:
        return facts.block_classes, f"on ({names}): zero.leaf_blocks: true"
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
        classes, why = leaf_blocks(z.leaf_blocks, facts)
        named = cfg.ds_overrides.get("zero_optimization", {}).get("leaf_module")
        if named is not None:  # the user's raw DeepSpeed key wins over the typed setting
            classes, why = (), f"{json.dumps(named)} from ds_overrides.zero_optimization.leaf_module"
    return ShardingPlan(stage=stage, effective_stage=effective_stage(backend, stage),
                        offload_optimizer=z.offload_optimizer, offload_param=z.offload_param,
                        leaf_blocks=classes, leaf_blocks_why=why, stage_why=stage_why)


def build_plan(cfg: RunConfig, world_size: Optional[int], *, backend: str = "deepspeed", backend_why: str = "",
               device: str = "cuda",
               facts: Optional[ModelFacts] = None, total_steps: Optional[int] = None,
               steps_per_epoch: Optional[int] = None, native_cpu_bf16: Optional[bool] = None) -> RunPlan:
    """Resolve a run: refuses (ConfigError, one line) what the backend or device cannot run.

    world_size None: the plan of a config without a world (`zerotrain config`): no global batch.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r}: use deepspeed or fsdp")
    warnings = check_backend(cfg, backend, device, native_cpu_bf16)
    if world_size is not None:
        check_parallel(cfg, backend, world_size, facts)
    layout = WorldLayout(world_size, tp=cfg.parallel.tp, pp=cfg.parallel.pp) if world_size is not None else None
    if layout is not None:
        micro, accum, global_batch = resolve_batch(cfg, layout.dp)
    elif cfg.batch.global_batch is not None:
        raise ConfigError("batch.global_batch needs the world size to derive grad_accum; "
                          "pass --world-size N or set --grad-accum instead")
    else:
        micro, accum, global_batch = cfg.batch.micro_batch, cfg.batch.grad_accum, None
    return RunPlan(cfg=cfg, backend=backend, backend_why=backend_why or f"backend={backend}", device=device,
                   layout=layout,
                   batch=BatchPlan(micro, accum, global_batch), dtype=cfg.precision.dtype,
                   sharding=_sharding(cfg, backend, facts), facts=facts, total_steps=total_steps,
                   steps_per_epoch=steps_per_epoch, warnings=tuple(warnings))
