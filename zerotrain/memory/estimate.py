"""Per-rank memory a run will hold, predicted from the model's facts alone (no weights loaded).

`estimate(plan)` applies the formulas documented in `FORMULAS` to one run plan (zerotrain/plan/run_plan.py,
the plan `zerotrain train` runs); `setups(...)` lists the stage x offload rows `zerotrain estimate`
and `compare` cover and `setup_plan(...)` plans one of them. Under tensor/pipeline parallelism the
formulas see one rank's share of the model (zerotrain/memory/parallel.py) and shard it over the
data-parallel size; what one micro-batch adds (activations, images, all-to-alls) is zerotrain/memory/activations.py's.
What a run really holds is measured by zerotrain/memory/measure.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Optional

from ..config.rules import check_config, offload_problem
from ..config.schema import RunConfig
from ..errors import UserError
from ..model.facts import ModelFacts
from ..model.vision_roles import ImageTextSize
from ..plan.capabilities import BACKENDS, effective_stage
from ..plan.run_plan import RunPlan, build_plan
from ..util import human_bytes
from . import parallel as par
from .activations import activation_bytes, all_to_all_bytes, expert_all_to_all_bytes, image_bytes, image_text_for
from .runtime import (LORA_EXTRA_RSS, RUN_SLACK_RSS, TRAIN_CLI_EXTRA_RSS, baseline_rss, dtype_bytes, outside_calibration,
                      row_tokens, step_transient)

CATEGORIES = ("params", "grads", "optimizer_states", "master", "buffers", "reference")
"""params: the model's weights as the module holds them (local shard under ZeRO-3/FSDP2);
grads: gradients (param.grad, DeepSpeed's partitioned grad buffers);
optimizer_states: the inner optimizer's state (Adam exp_avg, exp_avg_sq, step);
master: fp32 copies the optimizer updates (ZeRO flat fp32 partitions), when not the params;
buffers: other tensors DeepSpeed keeps for communication (reduce/all-gather buckets, staging);
reference: a preference run's frozen reference model (its parameters, partitioned like the policy's)."""


FORMULAS = """\
Symbols: P = parameter elements (the rank's share, see below), N = data-parallel ranks (x sequence-parallel
ranks under --sp, which ZeRO and FSDP2 shard over too), L = bytes of the training dtype
(4 fp32, 2 bf16/fp16), B = reduce_bucket_size elements, Pa = P rounded up to a multiple of 2N
(DeepSpeed ZeRO-1/2 pads the flat group to nccl_start_alignment_factor 2 x world size),
P3 = sum over tensors of ceil(numel/N) (ZeRO-3 partitions every tensor on its own),
Pf = sum over tensors of ceil(dim0/N) * numel/dim0 (FSDP2 pads dim 0 of every tensor to N). Under expert
parallelism ep (FSDP2) each routed-expert tensor holds dim0/ep experts per rank, sharded over the N/ep ranks with
the same experts: its share is ceil(dim0/ep / (N/ep)) * numel/dim0.
The ZeRO paper counts 2P params + 2P grads + 12P optimizer (K=12: fp32 master, m, v) for mixed
precision and 16P for fp32 Adam; per rank stage 1 divides the 12P by N, stage 2 also the grads,
stage 3 everything. What DeepSpeed 0.19 really holds per rank, measured between two micro-batches
of an accumulation (after one optimizer step, so Adam's m and v exist):

DeepSpeed stage 0 fp32    params 4P + grads 4P + Adam 8P                            (no master copy)
DeepSpeed stage 0 bf16    params 2P + grads 2P + fp32 master 4P + Adam 8P (FP16_Optimizer: flat
                          bf16 params, flat fp32 master; its flat fp32 grad 4P lives during step())
DeepSpeed stage 1         flat params L*Pa + full grads L*P (param.grad, reduced only on the
                          boundary) + bucket L*B + (fp32 master 4Pa + Adam 8Pa)/N; with grad_accum 1
                          the snapshot is the boundary: as stage 2
DeepSpeed stage 2         flat params L*Pa + grad partition L*Pa/N (reduced every micro-batch;
                          bucket L*B only during backward) + (fp32 master 4Pa + Adam 8Pa)/N
DeepSpeed stage 3         params L*P3 + grad partition L*P3 + fp32 master 4*P3 + Adam 8*P3
                          + persistent bucket L*B (tensors below stage3_param_persistence_threshold
                          stay whole on every rank; zerotrain sets that threshold to 0)
offload_optimizer=cpu     master and Adam states move to host memory, plus an fp32 grad for the
                          host master (4Pa/N, 4*P3); stage 2 accumulates grads in fp32 on the host
                          (4Pa/N instead of L*Pa/N; none at the boundary, grad_accum 1); stage 1/2
                          add an L*Pa/N staging copy and two largest-tensor grad buffers (2*L*max numel)
offload_param=cpu         (stage 3) the L*P3 parameter partition lives on the host as well
FSDP2 stage 2/3 fp32      params 4Pf + grads 4Pf + Adam 8Pf; between micro-batches without
                          gradient sync the grads are unsharded: 4P instead of 4Pf
FSDP2 bf16                same (fp32 sharded params are the master; unsharded grads accumulate in
                          the fp32 reduce dtype; bf16 copies exist only while a block is gathered)
FSDP stage 0 (DDP)        params 4P + grads 4P + Adam 8P; DDP's bucket copy of the grads (4P) lives
                          in the C++ reducer: counted for peak RSS, invisible to the measurement
SGD                       "Adam 8" above is 4 with momentum (one fp32 buffer), 0 without (optimizer_state_bytes)
LoRA                      P counts only the trainable tensors (adapters, a fresh head) and F the
                          frozen base: the base adds params L*F (stage 0-2, every rank), L*F3
                          (stage 3, partitioned) or 4Ff (FSDP2), and no grads, master or optimizer state
--freeze (image-text)     the frozen parts (vision tower, projector, language model) are F likewise
Tensor parallel t, pipeline p (N = world / (t*p)): a rank holds its pipeline stage's layers of
[Embed, Block x n, Head] (stage_bounds; a tied embedding/head weight on the first AND the last
stage), with every block linear the HF tp_plan splits cut to 1/t (colwise: weight rows and bias,
rowwise: weight columns; embeddings, norms, head whole); P, Pa, P3, Pf above are over those
tp-local tensors. The figures are the largest stage's (the one that decides whether it fits). The dimensions
compose where the capability table lists them (tp x pp x dp: FSDP2; sp x tp: both): a tp x pp rank holds its stage's
tp-local tensors sharded over dp; an sp x tp rank the whole model's tp-local tensors sharded over dp x sp.
Activations (per rank, GPT-style decoder, SDPA attention, no dropout masks; Korthikanti et al.
2022 generalised to MLP width I): per layer s*b*(4h + (4h + 2I)/t) elements of the activation dtype
(q, k, v, attention output and the MLP inner width split by tp; norm inputs and block inputs whole),
plus logits s*b*V*(L + 8) (the logits, HF's fp32 upcast and log-softmax, last stage only); with
gradient checkpointing: layers*s*b*h (block inputs) + one layer recomputed. Online RL (grpo): s is a row's prompt +
completion bound, (pref.max_prompt_len or seq_len) + rl.max_completion_len (runtime.row_tokens). Eager attention adds
2*a*s^2*b/t per layer. A pipeline stage keeps its blocks' activations for the micro-batches in
flight: all m = grad_accum under GPipe (FSDP pipeline), min(p - k, m) on stage k under 1F1B
(DeepSpeed's pipeline engine). Pipeline bubble (idle fraction of a step): (p-1)/(m+p-1). Under
sequence parallelism s is a rank's shard, ceil(s/sp): the all-to-all gives attention the whole sequence of
h/sp heads, the same number of elements; it sends 2*layers*b*(s/sp)*d*(2a + 2*max(kv, sp))*L*(sp-1)/sp bytes
per rank and micro-batch (d head width, a heads, kv key/value heads). Memory reducers: the tiled MLP (tiles
of T tokens) keeps one tile's 2I inner width instead of the whole sequence's, b*T*2I/t; the chunked loss
(chunks of C tokens) keeps one chunk's logits, min(C, s*b)*V*(L + 8), and the fused loss (on by default for
causal-LM training) an fp32 head gradient buffer 4*V*h besides; --offload-activations (GPU) moves what
backward keeps to host memory but one block's working set. Under sp a sliding window or packed documents add
the rebuilt whole-sequence mask, b*s^2 bytes (bool) per window kind. Under expert parallelism the tokens'
all-to-alls send 4*moe_blocks*b*s*k*h*L*(ep-1)/ep bytes per rank and micro-batch (top-k copies of each token,
dispatch and combine, forward and backward, even routing).
Image-text models (one image per sample assumed): the processor's pixel tensors for one image (its own resize
target; a dynamic-resolution processor's largest image, max_pixels) x micro-batch, and, when a tower parameter
trains, the tower's activations: blocks x patches x (the inputs and outputs of a tower block's Linears) x L per
image; the image tokens sit inside seq_len, so the language model's activations above already count them.
Peak RSS (CPU-only, all of the above in host RAM) = runtime baseline (torch + transformers +
backend import, process group, DeepSpeed's JIT ops; measured, see BASELINE_RSS) + model states +
activations + the transient fp32 model a rank builds before the engine flattens/partitions it
(4P, 4*P3 under zero.Init). Left out: allocator fragmentation and caching, data loader and
tokenizer memory, checkpoint save buffers, the DDP reducer buckets' growth, autograd temporaries
beyond one layer. (What a bare training loop peaks at: tests/support/memory_worker.py.)
Whole run (run_peak_rss: `zerotrain train` on a CPU-only machine, save_final on, largest rank) = runtime
baseline + train CLI extra (datasets, tokenizer, data pipeline, metrics: TRAIN_CLI_EXTRA_RSS) + allocator
slack (RUN_SLACK_RSS: glibc keeps freed heap blocks below its 32 MiB mmap threshold, plus the autograd and
loss temporaries the activation formula leaves out) + model states + activations + the larger of two
transients: the init-time model above, or a training step's: 1.5 x 4P (the gradients flattened for the
all-reduce/reduce bucket, the optimizer step's temporaries; P trainable, rank-local) + 4P when
grad_accum > 1 (a later micro-batch's fresh gradients next to the accumulated ones) + under DeepSpeed
stage 3 and FSDP2 stage 2/3 the gathered model L*(P+F) and its unsharded grads (L*P; 4P under FSDP2,
which reduces in fp32) + under DeepSpeed stage 3 the prefetch bucket L*min(stage3_prefetch_bucket_size, P).
Measured here (2 CPU ranks, fp32, 4 steps): the whole-run peak falls inside the training steps, growing
over the first steps; the load (from_pretrained, zero.Init), the checkpoint save and the final HF save
(ZeRO-3's consolidated 16-bit state dict, FSDP's full state dict on rank 0) reuse freed heap and did not
raise it, up to 56 M parameters (benchmarks/PEAK_CALIBRATION.md).
"""


class Setup(NamedTuple):
    """One row of an estimate/compare sweep: what the sweep varies; the rest is the run config's."""

    backend: str
    """deepspeed or fsdp."""
    stage: int
    """ZeRO stage 0-3 (FSDP: 0 = DDP, 1/2 = reshard_after_forward False, 3 = True)."""
    offload_optimizer: str = "none"
    """none or cpu (nvme is counted as host)."""
    offload_param: str = "none"
    """none or cpu (stage 3)."""

    @classmethod
    def of(cls, plan: RunPlan) -> Setup:
        """The row of a plan, at the stage the backend really runs."""
        s = plan.sharding
        return cls(plan.backend, s.effective_stage, s.offload_optimizer, s.offload_param)

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
    """Predicted per-rank memory of one planned run, bytes."""

    plan: RunPlan
    parts: list[Part]
    activations: int
    """Activations kept for backward on the accelerator (all of them on a CPU-only rank)."""
    transient: int
    """Memory held only for a moment (init-time fp32 model, backward-only buckets): counts for peak RSS."""
    baseline_rss: int
    notes: list[str] = field(default_factory=list)
    pp_stage: int = 0
    """The pipeline stage these figures are for: under pp the one with the most device bytes."""
    stages: tuple[tuple[int, int], ...] = ()
    """(model-state bytes, activation bytes) of every pipeline stage when pp > 1, else ()."""
    host_activations: int = 0
    """Saved activations moved to host memory by --offload-activations (GPU runs)."""
    step_transient: int = 0
    """What a training step holds beyond model states and activations at its peak (whole-model gradient and
    optimizer copies, the gathered model under ZeRO-3/FSDP2): counts for run_peak_rss, not peak_rss."""
    generation: int = 0
    """Online RL: what the generation phase holds beyond model states (the gathered weights where they are
    sharded, the KV cache of the largest rollout call's rows, their logits); not at the same time as the activations."""
    image_text: Optional[ImageTextSize] = None
    """An image-text model's tower, projector, image tokens and pixel tensors (image_text_for); None for text."""

    @property
    def working(self) -> int:
        """The larger of the step's activations and the generation phase's bytes (they are never held together)."""
        return max(self.activations, self.generation)

    @property
    def setup(self) -> Setup:
        return Setup.of(self.plan)

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
        return sum(p.nbytes for p in self.parts if p.where == "device") + self.working

    @property
    def host_bytes(self) -> int:
        """Offloaded model states and activations in host RAM (per rank)."""
        return sum(p.nbytes for p in self.parts if p.where == "host") + self.host_activations

    @property
    def bubble(self) -> float:
        """Idle fraction of a pipeline step, (p-1)/(m+p-1); 0 without a pipeline."""
        return par.bubble(self.plan.world.pp, self.plan.batch.grad_accum)

    @property
    def largest_stage_model_states(self) -> int:
        """Model-state bytes of the pipeline stage holding the most (what a per-rank maximum measures)."""
        return max(m for m, _ in self.stages) if self.stages else self.model_states

    @property
    def peak_rss(self) -> int:
        """Peak RSS of a CPU-only rank, where device and host are the same RAM."""
        return self.baseline_rss + self.model_states + self.working + self.host_activations + self.transient

    @property
    def run_peak_rss(self) -> int:
        """Peak RSS (VmHWM, largest rank) of a whole `zerotrain train` run on a CPU-only machine, save_final on:
        the runtime baseline + the train CLI's extra + allocator slack + model states + activations + the
        largest transient (init-time model build or a training step's copies; see FORMULAS, "Whole run")."""
        return (self.baseline_rss + TRAIN_CLI_EXTRA_RSS + RUN_SLACK_RSS + self.model_states + self.working
                + max(self.transient, self.step_transient))

    @property
    def outside_calibration(self) -> list[str]:
        """Why run_peak_rss is an unchecked extrapolation for this plan (runtime.CALIBRATED; empty = measured
        region)."""
        return outside_calibration(self.plan, self.plan.facts)

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {"backend": s.backend, "stage": s.stage, "offload_optimizer": s.offload_optimizer,
                "offload_param": s.offload_param, "precision": self.plan.dtype,
                "world_size": self.plan.world.world_size, "tp": self.plan.world.tp, "pp": self.plan.world.pp,
                "dp": self.plan.world.dp, "pp_stage": self.pp_stage, "bubble": self.bubble,
                "stages": [{"model_states": m, "activations": a} for m, a in self.stages],
                **self.by_category(), "model_states": self.model_states, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "activations": self.activations, "generation": self.generation,
                "transient": self.transient,
                "baseline_rss": self.baseline_rss, "peak_rss": self.peak_rss, "step_transient": self.step_transient,
                "run_peak_rss": self.run_peak_rss, "outside_calibration": self.outside_calibration,
                "parts": [vars(p) for p in self.parts], "notes": list(self.notes),
                "image_text": vars(self.image_text) if self.image_text is not None else None}


def optimizer_state_bytes(plan: RunPlan) -> tuple[int, str]:
    """(bytes of optimizer state per trained element, its symbol in the formulas): Adam/AdamW's fp32
    exp_avg + exp_avg_sq (8; the 4-byte step scalars are ignored), SGD's fp32 momentum buffer (4), or
    nothing for SGD without momentum. Muon's AdamW half is Adam's 8; its matrices hold 4 less (optimizer_part)."""
    o = plan.cfg.optimizer
    if o.name == "sgd":
        return (4, "4") if o.momentum else (0, "0")
    return 8, "8"


def optimizer_part(plan: RunPlan, K: int, k: str, elems: int, sym: str, matrix_elems: int, where: str) -> Part:
    """The optimizer-state part of `elems` trained elements (sym: their symbol); under --optimizer muon its block
    matrices (matrix_elems of them, ModelFacts.block_matrix_shapes as this layout holds them) keep Muon's one fp32
    momentum buffer instead of AdamW's two: 4 bytes less each."""
    if plan.cfg.optimizer.name != "muon":
        return Part("optimizer_states", K * elems, where, f"{k}{sym}")
    return Part("optimizer_states", K * elems - 4 * matrix_elems, where, f"{k}{sym} - 4M{sym[1:]} (Muon's block "
                                                                         "matrices M: one buffer)")


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def _deepspeed_parts(spec: ModelFacts, plan: RunPlan, bucket: int) -> tuple[list[Part], int, list[str]]:
    """Model-state parts, transient bytes and notes for DeepSpeed (see FORMULAS). Under LoRA, P counts
    the trainable tensors (adapters, heads) and F the frozen base, which is held only as parameters."""
    s = Setup.of(plan)
    F = spec.frozen_params
    P, N, L = spec.num_params - F, plan.world.shard_ranks, dtype_bytes(plan.dtype)  # ZeRO over dp x sp
    off_opt = "host" if s.offload_optimizer != "none" else "device"
    off_par = "host" if s.offload_param != "none" else "device"
    K, k = optimizer_state_bytes(plan)
    notes: list[str] = []
    parts: list[Part] = []
    transient = 4 * (P + F)  # the fp32 model a rank builds before deepspeed.initialize takes it over
    E = copies = 0  # AutoEP (--ep): this rank's 1/ep of the experts, ZeRO-partitioned over their copies only
    if plan.world.ep > 1:
        E, copies = spec.expert_params // plan.world.ep, plan.world.expert_dp
        P -= spec.expert_params
        notes.append(f"expert parallel {plan.world.ep} (AutoEP): {human_bytes(4 * E)} of fp32 expert weights per "
                     f"rank (1/{plan.world.ep}), partitioned over the {copies} rank(s) holding the same experts")
    if s.stage == 0:
        P += E
        if F:
            parts.append(Part("params", L * F, "device", "L*F frozen (LoRA base, --freeze)"))
        if plan.dtype == "fp32":
            parts += [Part("params", 4 * P, "device", "4P"), Part("grads", 4 * P, "device", "4P"),
                      Part("optimizer_states", K * P, "device", f"{k}P")]
        else:
            parts += [Part("params", L * P, "device", "2P flat bf16"), Part("grads", L * P, "device", "2P"),
                      Part("master", 4 * P, "device", "4P flat fp32"),
                      Part("optimizer_states", K * P, "device", f"{k}P")]
            transient += 4 * P  # the flat fp32 master grad exists during step() only
        return parts, transient, notes
    if s.stage in (1, 2):
        Ea = _ceil_to(E, 2 * copies) if E else 0  # the experts' own flat group
        Pa = _ceil_to(P, 2 * N) + Ea
        part = _ceil_to(P, 2 * N) // N + (Ea // copies if E else 0)
        P += E
        if F:
            parts.append(Part("params", L * F, "device", "L*F frozen (LoRA base, --freeze), whole on every rank"))
        parts.append(Part("params", L * Pa, "device", "L*Pa flat"))
        # grad_accum 1, or a pipeline engine (its only hook point is before the optimizer step): the
        # snapshot is at the boundary, the grads just reduced into their partition
        accumulating = plan.batch.grad_accum > 1 and plan.world.pp == 1
        if s.stage == 1 and accumulating:
            parts.append(Part("grads", L * P, "device", "L*P full grads until the boundary"))
            parts.append(Part("buffers", L * bucket, "device", "L*B reduce bucket, kept while accumulating"))
        else:
            transient += L * bucket  # the reduce bucket exists only during backward
            if s.offload_optimizer == "none":
                parts.append(Part("grads", L * part, "device", "L*Pa/N grad partition"))
            elif accumulating:
                parts.append(Part("grads", 4 * part, "host", "4Pa/N fp32 grad accumulator on host"))
        parts.append(Part("master", 4 * part, off_opt, "4Pa/N fp32 partition"))
        parts.append(Part("optimizer_states", K * part, off_opt, f"{k}Pa/N"))
        if s.offload_optimizer != "none":
            big = max(spec.numels)
            parts.append(Part("grads", 4 * part, "host", "4Pa/N fp32 grad of the host master"))
            parts.append(Part("buffers", L * part, "host", "L*Pa/N staging copy for the offloaded step"))
            parts.append(Part("buffers", 2 * L * big, "device", "2 largest-tensor grad buffers"))
        return parts, transient, notes
    # stage 3
    P3 = sum(-(-n // N) for n in spec.numels)
    F3 = sum(-(-math.prod(sh) // N) for sh in spec.frozen_shapes)
    transient = 4 * (P3 + F3)  # zero.Init partitions each tensor as it is created
    if F:
        parts.append(Part("params", L * F3, off_par, "L*F3 frozen partition (LoRA base, --freeze)"))
    parts.append(Part("params", L * P3, off_par, "L*P3 partition"))
    parts.append(Part("grads", L * P3, off_opt, "L*P3 grad partition"))
    parts.append(Part("master", 4 * P3, off_opt, "4*P3 fp32 partition"))
    parts.append(Part("optimizer_states", K * P3, off_opt, f"{k}*P3"))
    if s.offload_optimizer != "none":
        parts.append(Part("grads", 4 * P3, "host", "4*P3 fp32 grad of the host master"))
    parts.append(Part("buffers", L * bucket, "device", "L*B reduce bucket"))
    return parts, transient, notes


def _reference_parts(spec: ModelFacts, plan: RunPlan) -> list[Part]:
    """A dpo run's frozen reference (Engine.auxiliary): the base model's tensors (every one without LoRA,
    the frozen base under LoRA with --ref-model), held without gradients or optimizer states: DeepSpeed ZeRO-3
    partitions them (L*R3, where the policy's parameters live), DeepSpeed stages 0-2 hold them whole in the
    training dtype (L*R), FSDP2 shards them over dim 0 in fp32 (4*Rf; DDP: 4*R)."""
    task = plan.task
    if "reference" not in task.estimate_parts or not task.holds_reference(plan.cfg):
        return []
    shapes = list(spec.frozen_shapes) if spec.frozen_params else list(spec.param_shapes)
    numels = [math.prod(sh) for sh in shapes]
    N, L, stage = plan.world.shard_ranks, dtype_bytes(plan.dtype), plan.sharding.effective_stage
    if plan.backend == "deepspeed":
        if stage == 3:
            where = "host" if plan.sharding.offload_param != "none" else "device"
            return [Part("reference", L * sum(-(-n // N) for n in numels), where, "L*R3 frozen reference partition")]
        return [Part("reference", L * sum(numels), "device", "L*R frozen reference, whole on every rank")]
    if stage == 0:
        return [Part("reference", 4 * sum(numels), "device", "4R frozen reference, whole on every rank")]
    padded = sum(-(-sh[0] // N) * (math.prod(sh) // sh[0]) if sh else 1 for sh in shapes)
    return [Part("reference", 4 * padded, "device", "4Rf frozen reference shard")]


def generation_bytes(spec: ModelFacts, plan: RunPlan) -> tuple[int, str]:
    """Online RL's generation phase per rank, beyond the model states (Estimate.generation) and its note: the
    weights gathered once for the phase where they are sharded (rl.generation_gather phase: the whole model in the
    training dtype, minus this rank's partition), the KV cache of one generate call's rows (2 x layers x kv heads x
    head dim x rows x (prompt + completion) tokens) and their last-position logits. A call's rows: one prompt's
    num_generations completions (rl.rollout_engine exact), else the rank's prompts of a generation batch in groups of
    num_generations, at most rl.rollout_rows a call (0: all of them; zerotrain/backends/generation.py
    generate_batch)."""
    cfg = plan.cfg
    if "generation" not in plan.task.estimate_parts:
        return 0, ""
    rl, L = cfg.rl, dtype_bytes(plan.dtype)
    from ..plan.rl_cycle import cycle_of

    # the rank's largest rollout call (the run's banner names the same figure)
    rows = cycle_of(cfg, plan.batch.global_batch, plan.batch.grad_accum, plan.world.dp).rows_per_call(
        rl.rollout_engine, rl.rollout_rows)
    sharded = plan.sharding.effective_stage == 3 or (plan.backend == "fsdp" and plan.sharding.effective_stage > 0)
    total = spec.num_params  # the frozen LoRA base included
    gathered = L * (total - total // plan.world.shard_ranks) if sharded and rl.generation_gather == "phase" else 0
    heads = spec.num_heads or 1
    head_dim = spec.hidden_size // heads
    tokens = row_tokens(plan)
    kv = 2 * spec.num_layers * (spec.num_kv_heads or heads) * head_dim * rows * tokens * L
    logits = 4 * rows * spec.vocab_size
    note = (f"generation phase: {human_bytes(gathered)} gathered weights" if gathered else "generation phase: ") + \
        f"{', ' if gathered else ''}{human_bytes(kv)} KV cache ({rows} completions a generate call x {tokens} tokens)"
    return gathered + kv + logits, note


def _fsdp_parts(spec: ModelFacts, plan: RunPlan) -> tuple[list[Part], int, list[str]]:
    """Model-state parts, transient bytes and notes for zerotrain's FSDP2/DDP engine (see FORMULAS)."""
    s = Setup.of(plan)  # FSDP stage 1 runs (and is estimated) as stage 2
    F = spec.frozen_params  # LoRA: the frozen base, held as (sharded) parameters only
    P, N = spec.num_params - F, plan.world.shard_ranks  # FSDP2 shards over the sequence-parallel ranks too
    K, k = optimizer_state_bytes(plan)
    notes: list[str] = []
    where = "device"
    if s.offload_optimizer != "none" or s.offload_param != "none":
        where = "host"
        notes.append("FSDP offload is CPUOffloadPolicy (params, grads and optimizer states on host); "
                     "on a CPU-only machine zerotrain warns and runs without it")
    if s.stage == 0:
        parts = [Part("params", 4 * P, where, "4P"), Part("grads", 4 * P, where, "4P"),
                 optimizer_part(plan, K, k, P, "P", sum(map(math.prod, spec.block_matrix_shapes)), where)]
        if F:
            parts.insert(0, Part("params", 4 * F, where, "4F frozen (LoRA base, --freeze)"))
        notes.append("DDP's reducer keeps a bucket copy of the grads (4P) inside C++: counted in peak RSS, "
                     "not in model states (the measurement cannot see it)")
        return parts, 4 * (P + F), notes

    def padded(shapes: Iterable[tuple[int, ...]], n: int = N) -> int:
        return sum(-(-sh[0] // n) * (math.prod(sh) // sh[0]) if sh else 1 for sh in shapes)

    Pf, Ff = padded(spec.param_shapes), padded(spec.frozen_shapes)
    ep = plan.world.ep
    if ep > 1:  # experts: 1/ep of each tensor's experts per rank, FSDP-sharded over the world / ep copies
        experts = [(sh[0] // ep, *sh[1:]) for sh in spec.expert_shapes]
        local = sum(math.prod(sh) for sh in experts)
        copies = plan.world.expert_dp  # ep runs with data parallelism only: dp x sp = dp
        Pf += padded(experts, copies) - padded(spec.expert_shapes)
        P -= spec.expert_params - local  # what this rank's unsharded grads span
        notes.append(f"expert parallel {ep}: {human_bytes(4 * local)} of fp32 "
                     f"expert weights per rank (1/{ep}), sharded over {copies} rank(s) holding the same experts")
    # zerotrain's engine skips gradient sync until the boundary: unsharded grads between micro-batches.
    accumulating = plan.batch.grad_accum > 1 and plan.world.pp == 1  # a pipeline engine measures at the boundary
    grads = Part("grads", 4 * P, where, "4P unsharded grads while accumulating") if accumulating else \
        Part("grads", 4 * Pf, where, "4Pf")
    parts = [Part("params", 4 * Pf, where, "4Pf fp32 shard (the master)"), grads,
             optimizer_part(plan, K, k, Pf, "Pf", padded(spec.block_matrix_shapes), where)]
    if F:
        parts.insert(0, Part("params", 4 * Ff, where, "4Ff frozen shard (LoRA base, --freeze)"))
    return parts, 4 * (P + F), notes


def _rank_estimate(plan: RunPlan, spec: ModelFacts, stage: int = 0,
                   layout: Optional[par.ParamLayout] = None, frozen: Optional[par.ParamLayout] = None) -> Estimate:
    """The estimate of one rank on pipeline stage `stage` (its tp-local share of that stage's layers; frozen: a
    LoRA base's layout, whose tensors the rank holds likewise)."""
    cfg, world = plan.cfg, plan.world
    local, blocks, flight, logits = spec, None, 1, 1
    if layout is not None:
        base = None if frozen is None else \
            par.rank_shapes(frozen, spec, world.tp, world.pp, stage, shapes=spec.frozen_shapes)
        local = par.rank_facts(spec, par.rank_shapes(layout, spec, world.tp, world.pp, stage), base)
        if world.pp > 1:
            m = plan.batch.grad_accum
            blocks = par.stage_blocks(layout.num_blocks, world.pp, stage)
            flight = par.in_flight(plan.backend, world.pp, stage, m)
            logits = flight if stage == world.pp - 1 else 0
    prefetch = 0
    if plan.backend == "deepspeed":  # the bucket is sized from the whole model, as ds_config sizes it
        bucket, prefetch = plan.comm.reduce_bucket_size, plan.comm.prefetch_bucket_size
        parts, transient, notes = _deepspeed_parts(local, plan, bucket)
    else:
        parts, transient, notes = _fsdp_parts(local, plan)
    parts += _reference_parts(local, plan)
    transient += 4 * (spec.num_params - local.num_params)  # every rank builds the whole model, then splits it
    notes += [plan.stage_note()] if plan.stage_note() else []
    if layout is not None and world.tp > 1 and not spec.block_tp_plan:
        notes.append(f"the model has no HF tp_plan: its block linears are estimated whole on each of the {world.tp} "
                     "tensor-parallel ranks")
    seq_per_rank = -(-row_tokens(plan) // world.sp)  # sequence parallelism: each rank holds its shard's tokens
    reducers = plan.preparation
    loss_chunk = reducers.sized_loss_chunk(spec.vocab_size, mixture_of_experts=spec.moe_blocks > 0)
    rows = plan.batch.micro_batch * plan.task.rows_per_sample  # a pair is two rows
    acts = activation_bytes(spec, rows, seq_per_rank, plan.dtype,
                            cfg.model.gradient_checkpointing, cfg.model.attn_implementation == "eager",
                            tp=world.tp, blocks=blocks, in_flight=flight,
                            logits=logits, mlp_tile=reducers.tiled_mlp, loss_chunk=loss_chunk,
                            fused_loss=reducers.fused_loss_on)
    if world.sp > 1:
        windows = len({t for t in spec.attention_types if t == "sliding_attention"} | (
            {"full_attention"} if cfg.data.packing != "off" and "full_attention" in spec.attention_types else set()))
        if windows:  # the whole-sequence masks the attention rebuilds (bool [b, S, S] per window kind)
            acts += windows * plan.batch.micro_batch * cfg.data.seq_len ** 2
            notes.append(f"sequence parallel: {windows} rebuilt whole-sequence mask(s) of "
                         f"{human_bytes(plan.batch.micro_batch * cfg.data.seq_len ** 2)} per micro-batch "
                         "(sliding windows / packed documents)")
        sent = all_to_all_bytes(spec, plan.batch.micro_batch, cfg.data.seq_len, plan.dtype, world.sp, world.tp)
        notes.append(f"sequence parallel: {seq_per_rank} of {cfg.data.seq_len} tokens per rank; the attention "
                     f"all-to-alls send {human_bytes(sent)} per rank per micro-batch")
    if world.ep > 1:
        sent = expert_all_to_all_bytes(spec, plan.batch.micro_batch, cfg.data.seq_len, plan.dtype, world.ep)
        notes.append(f"expert parallel: the tokens' all-to-alls (dispatch and combine, forward and backward) send "
                     f"{human_bytes(sent)} per rank per micro-batch")
    host_acts = 0
    if cfg.model.offload_activations:  # save_on_cpu: what backward keeps goes to host; one block works on device
        working = activation_bytes(spec, rows, seq_per_rank, plan.dtype, False, tp=world.tp,
                                   blocks=1, logits=logits, mlp_tile=reducers.tiled_mlp,
                                   loss_chunk=loss_chunk, fused_loss=reducers.fused_loss_on)
        host_acts, acts = max(acts - working, 0), min(acts, working)
        notes.append(f"--offload-activations: {human_bytes(host_acts)} of saved activations in pinned host memory")
    generation, generation_note = generation_bytes(local, plan)
    if generation_note:
        notes.append(generation_note)
    images = image_text_for(cfg)
    if images is not None:  # `zerotrain estimate` prints image_text_line once, not per row
        acts += image_bytes(images, plan.batch.micro_batch, plan.dtype)
    return Estimate(plan=plan, parts=parts, activations=acts, host_activations=host_acts, transient=transient,
                    generation=generation, image_text=images,
                    baseline_rss=baseline_rss(plan.backend, plan.sharding.effective_stage)
                    + (LORA_EXTRA_RSS if plan.preparation.uses_lora else 0), notes=notes,
                    pp_stage=stage, step_transient=step_transient(local, plan, prefetch))


def estimate(plan: RunPlan) -> Estimate:
    """Per-rank memory of one planned run; the plan must know the model (plan.facts). Under pipeline
    parallelism: the stage with the most device bytes, every stage's figures in Estimate.stages."""
    spec, cfg = plan.facts, plan.cfg
    if spec is None:
        raise UserError("a memory estimate needs the model; pass --model or --model-config")
    world = plan.world
    if world.tp == 1 and world.pp == 1:
        return _rank_estimate(plan, spec)
    from ..assets.demo import DEMO_PRESET

    model_ref = cfg.model.name or cfg.model.from_config or DEMO_PRESET
    layout = par.layout_for(spec, model_ref, plan.task, plan.preparation.lora)
    frozen = None
    if spec.frozen_params and plan.preparation.lora is not None:  # LoRA's base: each tensor where its layer lives
        frozen = par.frozen_layout(model_ref, plan.task, plan.preparation.lora)
        if len(frozen.names) != len(spec.frozen_shapes):
            raise UserError(f"the LoRA model has {len(frozen.names)} frozen tensors but its facts list "
                            f"{len(spec.frozen_shapes)}; pass the same --model and --lora-* flags to estimate")
    ests = [_rank_estimate(plan, spec, k, layout, frozen) for k in range(world.pp)]
    worst = max(ests, key=lambda e: (e.device_bytes + e.host_bytes, -e.pp_stage))
    if world.pp > 1:
        worst.stages = tuple((e.model_states, e.activations) for e in ests)
    return worst


OFFLOADS = ("none", "cpu")
"""Offload devices a sweep covers (nvme is host memory too: it is estimated as cpu)."""


def setups(backends: Iterable[str] = BACKENDS, stages: Iterable[int] = (0, 1, 2, 3),
           offload_optimizer: Iterable[str] = OFFLOADS, offload_param: Iterable[str] = OFFLOADS,
           distinct: bool = True) -> list[Setup]:
    """Every backend x stage x offload row that rules.offload_problem allows (what `train` accepts), in
    report order; distinct leaves out a stage a backend runs as another (FSDP 1 is FSDP 2's row again)."""
    return [Setup(be, st, oo, op) for be in backends for st in stages for op in offload_param
            for oo in offload_optimizer
            if offload_problem(st, oo, op) is None and not (distinct and effective_stage(be, st) != st)]


def setup_plan(cfg: RunConfig, s: Setup, world_size: int, *, facts: ModelFacts, device: str = "cuda") -> RunPlan:
    """The plan `zerotrain train` builds for cfg run as row s. Raises ConfigError (one line) for a row
    the rules refuse (e.g. optimizer.name=sgd with an optimizer offload, fp16 under FSDP)."""
    zero = cfg.zero.model_copy(update={"stage": s.stage, "offload_optimizer": s.offload_optimizer,
                                       "offload_param": s.offload_param})
    variant = cfg.model_copy(update={"backend": s.backend, "zero": zero})
    check_config(variant)
    return build_plan(variant, world_size, backend=s.backend, device=device, facts=facts)
