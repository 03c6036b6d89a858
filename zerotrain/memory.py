"""Per-rank memory a run will hold, predicted from the model's facts alone (no weights loaded).

`estimate(...)` applies the formulas documented in `FORMULAS` for one configuration (`Setup`);
`setups(...)` lists the configurations `zerotrain estimate` and `compare` cover. What a run really
holds is measured by zerotrain/measure.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from .errors import UserError
from .model_info import ModelFacts

CATEGORIES = ("params", "grads", "optimizer_states", "master", "buffers")
"""params: the model's weights as the module holds them (local shard under ZeRO-3/FSDP2);
grads: gradients (param.grad, DeepSpeed's partitioned grad buffers);
optimizer_states: the inner optimizer's state (Adam exp_avg, exp_avg_sq, step);
master: fp32 copies the optimizer updates (ZeRO flat fp32 partitions), when not the params;
buffers: other tensors DeepSpeed keeps for communication (reduce/all-gather buckets, staging)."""


FORMULAS = """\
Symbols: P = parameter elements, N = ranks (data-parallel world), L = bytes of the training dtype
(4 fp32, 2 bf16/fp16), B = reduce_bucket_size elements, Pa = P rounded up to a multiple of 2N
(DeepSpeed ZeRO-1/2 pads the flat group to nccl_start_alignment_factor 2 x world size),
P3 = sum over tensors of ceil(numel/N) (ZeRO-3 partitions every tensor on its own),
Pf = sum over tensors of ceil(dim0/N) * numel/dim0 (FSDP2 pads dim 0 of every tensor to N).
The ZeRO paper counts 2P params + 2P grads + 12P optimizer (K=12: fp32 master, m, v) for mixed
precision and 16P for fp32 Adam; per rank stage 1 divides the 12P by N, stage 2 also the grads,
stage 3 everything. What DeepSpeed 0.19 really holds per rank, measured between two micro-batches
of an accumulation (after one optimizer step, so Adam's m and v exist):

DeepSpeed stage 0 fp32    params 4P + grads 4P + Adam 8P                            (no master copy)
DeepSpeed stage 0 bf16    params 2P + grads 2P + fp32 master 4P + Adam 8P (FP16_Optimizer: flat
                          bf16 params, flat fp32 master; its flat fp32 grad 4P lives during step())
DeepSpeed stage 1         flat params L*Pa + full grads L*P (param.grad, reduced only on the
                          boundary) + bucket L*B + (fp32 master 4Pa + Adam 8Pa)/N
DeepSpeed stage 2         flat params L*Pa + grad partition L*Pa/N (reduced every micro-batch;
                          bucket L*B only during backward) + (fp32 master 4Pa + Adam 8Pa)/N
DeepSpeed stage 3         params L*P3 + grad partition L*P3 + fp32 master 4*P3 + Adam 8*P3
                          + persistent bucket L*B (tensors below stage3_param_persistence_threshold
                          stay whole on every rank; zerotrain sets that threshold to 0)
offload_optimizer=cpu     master and Adam states move to host memory, plus an fp32 grad for the
                          host master (4Pa/N, 4*P3); stage 2 accumulates grads in fp32 on the host
                          (4Pa/N instead of L*Pa/N); stage 1/2 add an L*Pa/N staging copy and two
                          largest-tensor grad buffers (2*L*max numel)
offload_param=cpu         (stage 3) the L*P3 parameter partition lives on the host as well
FSDP2 stage 2/3 fp32      params 4Pf + grads 4Pf + Adam 8Pf; between micro-batches without
                          gradient sync the grads are unsharded: 4P instead of 4Pf
FSDP2 bf16                same (fp32 sharded params are the master; unsharded grads accumulate in
                          the fp32 reduce dtype; bf16 copies exist only while a block is gathered)
FSDP stage 0 (DDP)        params 4P + grads 4P + Adam 8P; DDP's bucket copy of the grads (4P) lives
                          in the C++ reducer: counted for peak RSS, invisible to the measurement
Activations (per rank, GPT-style decoder, SDPA attention, no dropout masks; Korthikanti et al.
2022 generalised to MLP width I): per layer s*b*(8h + 2I) elements of the activation dtype, plus
logits s*b*V*(L + 8) (the logits, HF's fp32 upcast and log-softmax); with gradient
checkpointing: layers*s*b*h (block inputs) + one layer recomputed. Eager attention adds
2*a*s^2*b per layer.
Peak RSS (CPU-only, all of the above in host RAM) = runtime baseline (torch + transformers +
backend import, process group, DeepSpeed's JIT ops; measured, see BASELINE_RSS) + model states +
activations + the transient fp32 model a rank builds before the engine flattens/partitions it
(4P, 4*P3 under zero.Init). Left out: allocator fragmentation and caching, data loader and
tokenizer memory, checkpoint save buffers, the DDP reducer buckets' growth, autograd temporaries
beyond one layer.
"""


@dataclass(frozen=True)
class Setup:
    """One configuration to estimate."""

    backend: str = "deepspeed"
    """deepspeed or fsdp."""
    stage: int = 2
    """ZeRO stage 0-3 (FSDP: 0 = DDP, 1/2 = reshard_after_forward False, 3 = True)."""
    offload_optimizer: str = "none"
    """none or cpu (nvme is counted as host)."""
    offload_param: str = "none"
    """none or cpu (stage 3)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16."""
    world_size: int = 1
    """Data-parallel ranks (nproc x nodes)."""

    @property
    def label(self) -> str:
        off = [n for n, v in (("opt", self.offload_optimizer), ("param", self.offload_param)) if v != "none"]
        return f"{self.backend} z{self.stage}" + (f" offload {'+'.join(off)}" if off else "")


@dataclass
class Part:
    """One block of memory in the estimate."""

    category: str
    """One of CATEGORIES."""
    nbytes: int
    where: str
    """device or host."""
    formula: str


@dataclass
class Estimate:
    """Predicted per-rank memory of one configuration, bytes."""

    setup: Setup
    parts: list[Part]
    activations: int
    transient: int
    """Memory held only for a moment (init-time fp32 model, backward-only buckets): counts for peak RSS."""
    baseline_rss: int
    notes: list[str] = field(default_factory=list)

    def by_category(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for p in self.parts:
            out[p.category] += p.nbytes
        return out

    @property
    def model_states(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device_bytes(self) -> int:
        """On the accelerator: model states not offloaded + activations."""
        return sum(p.nbytes for p in self.parts if p.where == "device") + self.activations

    @property
    def host_bytes(self) -> int:
        """Offloaded model states in host RAM (per rank)."""
        return sum(p.nbytes for p in self.parts if p.where == "host")

    @property
    def peak_rss(self) -> int:
        """Peak RSS of a CPU-only rank, where device and host are the same RAM."""
        return self.baseline_rss + self.model_states + self.activations + self.transient

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {"backend": s.backend, "stage": s.stage, "offload_optimizer": s.offload_optimizer,
                "offload_param": s.offload_param, "precision": s.precision, "world_size": s.world_size,
                **self.by_category(), "model_states": self.model_states, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "activations": self.activations, "transient": self.transient,
                "baseline_rss": self.baseline_rss, "peak_rss": self.peak_rss,
                "parts": [vars(p) for p in self.parts], "notes": list(self.notes)}


# Runtime RSS of one CPU rank before any model state: python + torch + transformers + the backend,
# the gloo process group, DeepSpeed's accelerator probing, its JIT-loaded ops and (stages 1-3) the
# ZeRO optimizer modules. Measured on this machine (x86-64, 2 CPU ranks, torch 2.13 CPU, deepspeed
# 0.19.8, transformers 5) with tests/memory_worker.py on tiny-gpt2 as peak VmHWM minus the predicted
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


def _baseline_rss(backend: str, stage: int) -> int:
    """BASELINE_RSS entry for a backend and stage."""
    if backend == "fsdp":
        return BASELINE_RSS["fsdp"]
    return BASELINE_RSS["deepspeed-stage0" if stage == 0 else "deepspeed-zero"]


_ADAM_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq per element (the 4-byte step scalars are ignored)


def _dtype_bytes(precision: str) -> int:
    if precision not in ("fp32", "bf16", "fp16"):
        raise UserError(f"precision {precision!r}: use fp32, bf16 or fp16")
    return 4 if precision == "fp32" else 2


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def _deepspeed_parts(spec: ModelFacts, s: Setup, bucket: int) -> tuple[list[Part], int, list[str]]:
    """Model-state parts, transient bytes and notes for DeepSpeed (see FORMULAS)."""
    P, N, L = spec.num_params, s.world_size, _dtype_bytes(s.precision)
    off_opt = "host" if s.offload_optimizer != "none" else "device"
    off_par = "host" if s.offload_param != "none" else "device"
    notes: list[str] = []
    parts: list[Part] = []
    transient = 4 * P  # the fp32 model a rank builds before deepspeed.initialize takes it over
    if s.stage == 0:
        if s.precision == "fp32":
            parts += [Part("params", 4 * P, "device", "4P"), Part("grads", 4 * P, "device", "4P"),
                      Part("optimizer_states", 8 * P, "device", "8P")]
        else:
            parts += [Part("params", L * P, "device", "2P flat bf16"), Part("grads", L * P, "device", "2P"),
                      Part("master", 4 * P, "device", "4P flat fp32"),
                      Part("optimizer_states", 8 * P, "device", "8P")]
            transient += 4 * P  # the flat fp32 master grad exists during step() only
        return parts, transient, notes
    if s.stage in (1, 2):
        Pa = _ceil_to(P, 2 * N)
        part = Pa // N
        parts.append(Part("params", L * Pa, "device", "L*Pa flat"))
        if s.stage == 1:
            parts.append(Part("grads", L * P, "device", "L*P full grads until the boundary"))
            parts.append(Part("buffers", L * bucket, "device", "L*B reduce bucket, kept while accumulating"))
        elif s.offload_optimizer == "none":
            parts.append(Part("grads", L * part, "device", "L*Pa/N grad partition"))
        else:
            parts.append(Part("grads", 4 * part, "host", "4Pa/N fp32 grad accumulator on host"))
        if s.stage == 2:
            transient += L * bucket  # the reduce bucket exists only during backward
        parts.append(Part("master", 4 * part, off_opt, "4Pa/N fp32 partition"))
        parts.append(Part("optimizer_states", _ADAM_STATE_BYTES * part, off_opt, "8Pa/N"))
        if s.offload_optimizer != "none":
            big = max(spec.numels)
            parts.append(Part("grads", 4 * part, "host", "4Pa/N fp32 grad of the host master"))
            parts.append(Part("buffers", L * part, "host", "L*Pa/N staging copy for the offloaded step"))
            parts.append(Part("buffers", 2 * L * big, "device", "2 largest-tensor grad buffers"))
        return parts, transient, notes
    # stage 3
    P3 = sum(-(-n // N) for n in spec.numels)
    transient = 4 * P3  # zero.Init partitions each tensor as it is created
    parts.append(Part("params", L * P3, off_par, "L*P3 partition"))
    parts.append(Part("grads", L * P3, off_opt, "L*P3 grad partition"))
    parts.append(Part("master", 4 * P3, off_opt, "4*P3 fp32 partition"))
    parts.append(Part("optimizer_states", _ADAM_STATE_BYTES * P3, off_opt, "8*P3"))
    if s.offload_optimizer != "none":
        parts.append(Part("grads", 4 * P3, "host", "4*P3 fp32 grad of the host master"))
    parts.append(Part("buffers", L * bucket, "device", "L*B reduce bucket"))
    return parts, transient, notes


def _fsdp_parts(spec: ModelFacts, s: Setup, grad_accum: int) -> tuple[list[Part], int, list[str]]:
    """Model-state parts, transient bytes and notes for zerotrain's FSDP2/DDP engine (see FORMULAS)."""
    P, N = spec.num_params, s.world_size
    notes: list[str] = []
    where = "device"
    if s.offload_optimizer != "none" or s.offload_param != "none":
        where = "host"
        notes.append("FSDP offload is CPUOffloadPolicy (params, grads and optimizer states on host); "
                     "on a CPU-only machine zerotrain warns and runs without it")
    if s.stage == 0:
        parts = [Part("params", 4 * P, where, "4P"), Part("grads", 4 * P, where, "4P"),
                 Part("optimizer_states", 8 * P, where, "8P")]
        notes.append("DDP's reducer keeps a bucket copy of the grads (4P) inside C++: counted in peak RSS, "
                     "not in model states (the measurement cannot see it)")
        return parts, 4 * P, notes
    if s.stage == 1:
        notes.append("FSDP has no optimizer-only sharding: stage 1 runs as stage 2")
    Pf = sum(-(-sh[0] // N) * (math.prod(sh) // sh[0]) if sh else 1 for sh in spec.param_shapes)
    # zerotrain's engine skips gradient sync until the boundary: unsharded grads between micro-batches.
    grads = Part("grads", 4 * P, where, "4P unsharded grads while accumulating") if grad_accum > 1 else \
        Part("grads", 4 * Pf, where, "4Pf")
    parts = [Part("params", 4 * Pf, where, "4Pf fp32 shard (the master)"), grads,
             Part("optimizer_states", 8 * Pf, where, "8Pf")]
    return parts, 4 * P, notes


def activation_bytes(spec: ModelFacts, micro_batch: int, seq_len: int, precision: str,
                     gradient_checkpointing: bool = False, eager_attention: bool = False) -> int:
    """Activations one rank keeps for backward (see FORMULAS)."""
    s, b, h, n_layers = seq_len, micro_batch, spec.hidden_size, spec.num_layers
    e = _dtype_bytes(precision)
    per_layer = s * b * (8 * h + 2 * spec.intermediate_size) * e
    if eager_attention:
        per_layer += 2 * spec.num_heads * s * s * b * e
    logits = s * b * spec.vocab_size * (e + 8)
    if gradient_checkpointing:
        return n_layers * s * b * h * e + per_layer + logits
    return n_layers * per_layer + logits


def estimate(spec: ModelFacts, setup: Setup, *, micro_batch: int = 4, seq_len: int = 128,
             gradient_checkpointing: bool = False, reduce_bucket_size: Optional[int] = None,
             grad_accum: int = 2, baseline_rss: Optional[int] = None) -> Estimate:
    """Per-rank memory of one configuration.

    reduce_bucket_size: DeepSpeed's bucket in elements; None takes zerotrain's rule
    (ds_config.bucket_sizes). grad_accum: >1 means gradients are mid-accumulation at the snapshot.
    """
    from .ds_config import bucket_sizes

    s = setup
    if s.world_size < 1:
        raise UserError(f"world size must be >= 1 (got {s.world_size})")
    if s.stage not in (0, 1, 2, 3):
        raise UserError(f"stage must be 0, 1, 2 or 3 (got {s.stage})")
    if s.offload_param != "none" and s.stage != 3:
        raise UserError(f"offload_param={s.offload_param} needs stage 3 (got stage {s.stage})")
    if s.offload_optimizer != "none" and s.stage == 0:
        raise UserError("offload_optimizer needs stage 1, 2 or 3")
    if s.backend == "deepspeed":
        bucket = reduce_bucket_size or bucket_sizes(spec).reduce_bucket_size
        parts, transient, notes = _deepspeed_parts(spec, s, bucket)
    elif s.backend == "fsdp":
        parts, transient, notes = _fsdp_parts(spec, s, grad_accum)
    else:
        raise UserError(f"backend {s.backend!r}: use deepspeed or fsdp")
    acts = activation_bytes(spec, micro_batch, seq_len, s.precision, gradient_checkpointing)
    base = _baseline_rss(s.backend, s.stage) if baseline_rss is None else baseline_rss
    return Estimate(setup=s, parts=parts, activations=acts, transient=transient, baseline_rss=base, notes=notes)


def setups(world_size: int, precision: str, backends: Iterable[str] = ("deepspeed", "fsdp")) -> list[Setup]:
    """Every stage x offload combination worth listing, per backend."""
    out: list[Setup] = []
    for be in backends:
        for stage in range(4):
            if be == "fsdp" and stage == 1:
                continue  # runs as stage 2
            offloads = [("none", "none")]
            if stage >= 1:
                offloads.append(("cpu", "none"))
            if stage == 3:
                offloads.append(("cpu", "cpu"))
            for oo, op in offloads:
                out.append(Setup(be, stage, oo, op, precision, world_size))
    return out
