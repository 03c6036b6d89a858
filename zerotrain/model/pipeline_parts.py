"""A HF decoder-only causal LM as a flat list of pipeline layers: embeddings, each block, final norm + head.

    layers = decoder_layers(model)           # [Embed, Block x num_layers, Head]
    hidden = input_ids
    for layer in layers: hidden = layer(hidden)   # == model(input_ids).logits (no padding)

Both pipeline engines split this list into contiguous stages: DeepSpeed's PipelineModule
(backends/deepspeed/pipeline.py) and torch.distributed.pipelining (backends/fsdp/pipeline.py). Every
layer takes one tensor and returns one (what both pipeline runtimes pass between stages) and
holds the HF model's own submodules, so `hf_names` maps its parameters back to the HF state-dict
names (export reassembles one ordinary HF model from the stages).

Each block gets the mask the HF model itself builds for that block's attention type (transformers'
masking_utils: causal, or causal within a sliding window), for packed causal-LM batches, which have no
padding (plan/parallel_rules.check_parallel refuses pipeline runs whose data would pad); an attention type this
module does not build (chunked, ...) is refused before launch (pipeline_problem).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..tasks import TaskSpec

PIPELINE_FAMILIES = {
    "gpt2": "transformer",  # wte + wpe (+ dropout), blocks h.*, ln_f, lm_head tied to wte
    "llama": "model", "qwen2": "model", "mistral": "model",  # embed_tokens, rotary, layers.*, norm, lm_head
}
"""model_type -> the attribute holding the base model, for the families whose layers this module
knows how to run one by one."""


MASK_BUILDERS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}
"""Block attention type (model_info.attention_types_of) -> the transformers.masking_utils function
that builds its mask, as the HF models call them."""


def pipeline_problem(model_type: str, task: "TaskSpec", num_layers: int, pp: int,
                     attention_types: tuple[str, ...] = ()) -> Optional[str]:
    """Why this model cannot be split into pp pipeline stages (one line with the fix), or None."""
    if not task.composes("pp"):
        return f"parallel.pp={pp} needs a causal-lm model (got model.task={task.name}); pass --pp 1"
    if model_type not in PIPELINE_FAMILIES:
        return (f"parallel.pp={pp}: model type '{model_type or '?'}' has no pipeline split (supported: "
                f"{', '.join(sorted(PIPELINE_FAMILIES))}); pass --pp 1")
    if num_layers and pp > num_layers:
        return f"parallel.pp={pp} is more stages than the model's {num_layers} transformer blocks; pick --pp <= {num_layers}"
    unknown = sorted(set(attention_types) - set(MASK_BUILDERS))
    if unknown:
        return (f"parallel.pp={pp}: the model's blocks use {', '.join(unknown)}, whose mask the pipeline split does "
                f"not build (it builds {', '.join(MASK_BUILDERS)}); pass --pp 1")
    return None


class Embed(nn.Module):
    """input_ids -> hidden states (token + learned position embeddings where the model has them)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        base = getattr(model, PIPELINE_FAMILIES[model.config.model_type])
        if model.config.model_type == "gpt2":
            self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop
        else:
            self.wte, self.wpe, self.drop = base.embed_tokens, None, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids)
        if self.wpe is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            hidden = self.drop(hidden + self.wpe(positions)[None])
        return hidden


class Block(nn.Module):
    """One transformer block, hidden -> hidden; rotary models recompute their (cos, sin) here, from the
    model's rotary module (a buffer-only module every stage holds)."""

    def __init__(self, model: nn.Module, index: int):
        super().__init__()
        from .facts import attention_types_of

        base = getattr(model, PIPELINE_FAMILIES[model.config.model_type])
        self.block = (base.h if model.config.model_type == "gpt2" else base.layers)[index]
        self.rotary: Optional[nn.Module] = getattr(base, "rotary_emb", None)
        self.config = model.config
        types = attention_types_of(model.config)
        self.mask_builder = MASK_BUILDERS[types[index]] if types else MASK_BUILDERS["full_attention"]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            out = self.block(hidden)
        else:
            import transformers.masking_utils as masks

            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
            mask = getattr(masks, self.mask_builder)(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                                     cache=None, position_ids=position_ids)
            out = self.block(hidden, attention_mask=mask, position_ids=position_ids,
                             position_embeddings=self.rotary(hidden, position_ids))
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """hidden -> logits: the final norm and the LM head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        base = getattr(model, PIPELINE_FAMILIES[model.config.model_type])
        self.norm = base.ln_f if model.config.model_type == "gpt2" else base.norm
        self.lm_head = model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model as [Embed, Block 0 .. Block n-1, Head]; the layers share the model's parameters."""
    base = getattr(model, PIPELINE_FAMILIES[model.config.model_type])
    blocks = base.h if model.config.model_type == "gpt2" else base.layers
    return [Embed(model), *(Block(model, i) for i in range(len(blocks))), Head(model)]


def stage_bounds(num_blocks: int, pp: int) -> list[tuple[int, int]]:
    """[start, stop) of each stage in the decoder_layers list (num_blocks + 2 layers): blocks dealt out
    evenly (the first stages take one more when pp does not divide them), the embeddings on the first
    stage and the head on the last."""
    per, extra = divmod(num_blocks, pp)
    bounds, start = [], 0
    for s in range(pp):
        n = per + (1 if s < extra else 0) + (1 if s == 0 else 0) + (1 if s == pp - 1 else 0)
        bounds.append((start, start + n))
        start += n
    return bounds


@dataclass(frozen=True)
class TiedWeight:
    """A weight shared by the first stage (input embeddings) and the last (LM head)."""

    hf_name: str
    """Its HF state-dict name on the first stage, e.g. 'transformer.wte.weight'."""
    head_name: str
    """The name the LM head uses for it, e.g. 'lm_head.weight'."""


def tied_weight(model: nn.Module) -> Optional[TiedWeight]:
    """The input-embedding / LM-head weight when the model ties them (GPT-2), else None."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or emb.weight is not head.weight:
        return None
    names = hf_names(model, model)
    return TiedWeight(hf_name=names[emb.weight][0], head_name="lm_head.weight")


def hf_names(part: nn.Module, model: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Each parameter of `part` -> its HF state-dict names in `model` (a tied weight has two)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {p: by_id[id(p)] for p in part.parameters()}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (shift by one, mean over the tokens whose label is not -100)."""
    shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    return nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
