"""What one rank holds of the model under tensor (tp) and pipeline (pp) parallelism, for zerotrain/memory/estimate.py.

    layout = param_layout("tiny-llama")                 # every parameter: name, shape, pipeline layer
    shapes = rank_shapes(layout, facts, tp=2, pp=2, stage=1)   # the tp-local shapes of stage 1's parameters

Tensor parallelism splits each transformer block's linear layers as the model's HF tp_plan says (FSDP:
DTensor parallelize_module, backends/fsdp/tensor_parallel.py; DeepSpeed AutoTP splits the same Llama-style
linears): "colwise" splits a weight's output features (dim 0) and its bias, "rowwise" its input
features (dim 1) and keeps the bias whole; embeddings, norms and the LM head stay whole. Pipeline stage k
holds the layers pipeline_parts.stage_bounds(num_blocks, pp)[k] of [Embed, Block x n, Head]; a tied
input-embedding / LM-head weight (GPT-2) is held by the first and by the last stage. ZeRO/FSDP then
shard what a rank holds over the data-parallel size only (memory/estimate.py's formulas with N = plan.world.dp).
Parameter names come from a meta-device build of the model (no weights, no memory), cached per model; with LoRA
the trainable parameters are the adapters (lora.apply_lora on the meta build): a colwise layer's lora_B splits its
output features, a rowwise layer's lora_A its input features, the other factor stays whole (tensor_parallel.lora_plan).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..errors import UserError
from ..model.facts import ModelFacts
from ..plan.capabilities import PIPELINE_SCHEDULE

if TYPE_CHECKING:
    from ..config.preparation import LoraPlan
    from ..tasks import TaskSpec

_BLOCK = re.compile(r"^(?:.*?\.)?(?:h|layers|layer|blocks)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamLayout:
    """Every trainable parameter of a model (tied weights once) and the pipeline layer it lives in."""

    names: tuple[str, ...]
    """HF parameter names, in ModelFacts.param_shapes order."""
    layers: tuple[int, ...]
    """Layer of each parameter in [Embed, Block 0 .. n-1, Head]: 0, 1..n, n + 1."""
    block_rel: tuple[str, ...]
    """Each block parameter's name inside its block ('self_attn.q_proj.weight'); '' outside the blocks."""
    tied: Optional[int]
    """Index of the weight the embeddings and the LM head share (held by the first and the last stage)."""
    num_blocks: int
    """Transformer blocks."""


def _layout_of(model, trainable: bool = True) -> ParamLayout:
    """ParamLayout of a (meta-device) model's trainable parameters, or of its frozen ones (a LoRA base)."""
    everything = list(model.named_parameters())
    named = [(n, p) for n, p in everything if p.requires_grad == trainable]
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied_param = emb.weight if head is not None and getattr(head, "weight", None) is emb.weight else None
    indices = [int(m.group(1)) for m in (_BLOCK.match(n) for n, _ in everything) if m]
    n_blocks = max(indices) + 1 if indices else 0  # the model's blocks, whether or not this list holds some
    first = next((i for i, (n, _) in enumerate(everything) if _BLOCK.match(n)), len(everything))
    position = {n: i for i, (n, _) in enumerate(everything)}
    layers, rel = [], []
    for n, _ in named:  # before the first block: embeddings; after the blocks: norm + head
        m = _BLOCK.match(n)
        layers.append(int(m.group(1)) + 1 if m else (0 if position[n] < first else n_blocks + 1))
        rel.append(m.group(2) if m else "")
    tied = next((i for i, (_, p) in enumerate(named) if p is tied_param), None)
    return ParamLayout(tuple(n for n, _ in named), tuple(layers), tuple(rel), tied, n_blocks)


@functools.lru_cache(maxsize=16)
def param_layout(model_ref: str, task: Optional["TaskSpec"] = None, lora: Optional["LoraPlan"] = None) -> ParamLayout:
    """ParamLayout of a hub id, model directory, config.json or tiny preset (built on the meta device; LoRA's
    adapters on it when `lora`)."""
    from ..model.facts import load_hf_config, meta_model

    model = meta_model(load_hf_config(model_ref), task)
    if lora is not None:
        from ..model.lora import apply_lora

        model = apply_lora(model, lora)
    return _layout_of(model)


@functools.lru_cache(maxsize=16)
def frozen_layout(model_ref: str, task: "TaskSpec", lora: "LoraPlan") -> ParamLayout:
    """ParamLayout of a LoRA run's frozen base (the parameters param_layout leaves out), each tensor in its layer."""
    from ..model.facts import load_hf_config, meta_model
    from ..model.lora import apply_lora

    return _layout_of(apply_lora(meta_model(load_hf_config(model_ref), task), lora), trainable=False)


def layout_for(facts: ModelFacts, model_ref: str, task: "TaskSpec", lora: Optional["LoraPlan"] = None) -> ParamLayout:
    """param_layout(model_ref), checked against the facts the plan was built with."""
    layout = param_layout(model_ref, task, lora)
    if len(layout.names) != len(facts.param_shapes):
        raise UserError(f"the model {model_ref!r} has {len(layout.names)} parameter tensors but its facts list "
                        f"{len(facts.param_shapes)}; pass the same --model to estimate")
    return layout


def tp_local_shape(shape: tuple[int, ...], rel: str, block_tp_plan: tuple[tuple[str, str], ...],
                   tp: int) -> tuple[int, ...]:
    """A block parameter's shape on one tensor-parallel rank (whole when the plan does not split it)."""
    if tp == 1 or not rel or not shape:
        return shape
    if ".lora_A." in rel or ".lora_B." in rel:  # an adapter factor: split on its base layer's split side only
        base, _, factor = rel.partition(".lora_")
        style = dict(block_tp_plan).get(base)
        dim = 0 if style == "colwise" and factor.startswith("B") else 1 if style == "rowwise" and factor.startswith("A") \
            else None
        return shape if dim is None else shape[:dim] + (-(-shape[dim] // tp),) + shape[dim + 1:]
    sub, _, kind = rel.rpartition(".")
    # a LoRA base linear is peft's base_layer of the planned module (its adapters: the branch above)
    style = dict(block_tp_plan).get(sub[:-len(".base_layer")] if sub.endswith(".base_layer") else sub)
    if style == "colwise" or (style == "rowwise" and kind == "weight" and len(shape) > 1):
        dim = 0 if style == "colwise" else 1
        return shape[:dim] + (-(-shape[dim] // tp),) + shape[dim + 1:]
    return shape  # a rowwise bias is whole on every rank (the partial sums are reduced before it)


def stage_layers(num_blocks: int, pp: int) -> list[range]:
    """The [Embed, Block x n, Head] layer indices of each pipeline stage."""
    from ..model.pipeline_parts import stage_bounds

    return [range(a, b) for a, b in stage_bounds(num_blocks, pp)]


def rank_shapes(layout: ParamLayout, facts: ModelFacts, tp: int, pp: int, stage: int,
                shapes: Optional[tuple[tuple[int, ...], ...]] = None) -> list[tuple[int, ...]]:
    """The tp-local shapes of the parameters pipeline stage `stage` holds (the tied weight on the first
    and the last stage); `shapes`: the layout's own shapes when they are not facts.param_shapes (a LoRA base's
    frozen_shapes)."""
    layers = stage_layers(layout.num_blocks, pp)[stage] if pp > 1 else None
    out = []
    full = facts.param_shapes if shapes is None else shapes
    for i, (shape, layer, rel) in enumerate(zip(full, layout.layers, layout.block_rel)):
        held = layers is None or layer in layers or (i == layout.tied and stage == pp - 1)
        if held:
            out.append(tp_local_shape(tuple(shape), rel, facts.block_tp_plan, tp))
    return out


def rank_facts(facts: ModelFacts, shapes: list[tuple[int, ...]],
               frozen: Optional[list[tuple[int, ...]]] = None) -> ModelFacts:
    """ModelFacts whose parameters are one rank's (what memory/estimate.py's per-rank formulas read); frozen: the
    rank's share of a LoRA base (None: the facts' own)."""
    import dataclasses

    extra = {} if frozen is None else {"frozen_shapes": tuple(frozen)}
    frozen_total = sum(math.prod(s) for s in (frozen if frozen is not None else facts.frozen_shapes))
    return dataclasses.replace(facts, num_params=sum(math.prod(s) for s in shapes) + frozen_total,
                               param_shapes=tuple(shapes), **extra)


def stage_blocks(num_blocks: int, pp: int, stage: int) -> int:
    """Transformer blocks on pipeline stage `stage`."""
    layers = stage_layers(num_blocks, pp)[stage]
    return sum(1 for i in layers if 1 <= i <= num_blocks)


def in_flight(backend: str, pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once (the capability table's PIPELINE_SCHEDULE)."""
    if pp == 1:
        return 1  # without a pipeline each micro-batch's backward runs before the next forward
    if PIPELINE_SCHEDULE.get(backend) == "1f1b":
        return min(pp - stage, micro_batches)
    return micro_batches


def bubble(pp: int, micro_batches: int) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (m + p - 1), m = micro-batches per step."""
    return (pp - 1) / (micro_batches + pp - 1) if pp > 1 else 0.0
