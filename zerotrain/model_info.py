"""Model shape facts from a HF config alone (no weights loaded): parameter count, hidden size,
the transformer-block classes.

Used to size DeepSpeed buckets and pick ZeRO-3 leaf blocks (`zerotrain config --model`, the
trainer), by the FSDP backend (one shard unit per block) and by the memory estimator.
The count is exact: the model is built on the meta device, which allocates no memory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConfigError
from .errors import first_line

if TYPE_CHECKING:
    from torch import nn

# Named tiny architectures for offline tests, benchmarks and the embedded demo (HF config keys of model_type).
TINY_PRESETS: dict[str, dict] = {
    "tiny-gpt2": dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=1024,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "small-gpt2": dict(model_type="gpt2", n_layer=4, n_head=4, n_embd=256, n_positions=512, vocab_size=4096,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # Llama family (RMSNorm, rotary, GQA: 2 key/value heads for 4 query heads, untied head), the
    # same widths as the GPT-2 presets so benchmarks compare families at one size.
    "tiny-llama": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       hidden_size=64, intermediate_size=176, max_position_embeddings=256, vocab_size=1024,
                       tie_word_embeddings=False),
    "small-llama": dict(model_type="llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        hidden_size=256, intermediate_size=688, max_position_embeddings=512, vocab_size=4096,
                        tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a model read from its config."""

    num_params: int
    """Parameter elements (tied weights counted once)."""
    hidden_size: int
    """Residual width."""
    num_layers: int
    """Transformer blocks."""
    vocab_size: int
    """Vocabulary size."""
    max_positions: int | None
    """Longest sequence the position embeddings allow (None if unbounded, e.g. rotary)."""
    num_heads: int
    """Attention heads."""
    intermediate_size: int
    """MLP inner width."""
    block_classes: tuple[str, ...] = ()
    """Class names of the repeated transformer blocks (transformer_blocks), e.g. ("GPT2Block",)."""
    model_type: str = ""
    """The HF config's model_type, e.g. 'gpt2', 'llama', 'bert'."""


def load_hf_config(name_or_path: str):
    """AutoConfig for a hub id, a model directory, a config.json file or a tiny preset name."""
    from transformers import AutoConfig, CONFIG_MAPPING

    if name_or_path in TINY_PRESETS:
        kw = dict(TINY_PRESETS[name_or_path])
        # GPT-2's default special ids (50256) lie outside a tiny vocabulary.
        kw.setdefault("bos_token_id", 0)
        kw.setdefault("eos_token_id", 0)
        return CONFIG_MAPPING[kw.pop("model_type")](**kw)
    p = Path(name_or_path)
    if p.is_file():
        try:
            kw = json.loads(p.read_text())
            return CONFIG_MAPPING[kw.pop("model_type")](**kw)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"--model {name_or_path}: not a HF config.json with a model_type ({e})") from None
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {name_or_path}: cannot read its config ({first_line(e)}); pass a local model "
                          f"directory, a config.json, a preset ({', '.join(TINY_PRESETS)}), or go online") from None


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def model_shape(name_or_path: str, task: str = "causal-lm") -> ModelShape:
    """Exact parameter count and main sizes, built on the meta device (no weights, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    hf = load_hf_config(name_or_path)
    auto = AutoModelForSequenceClassification if task == "seq-cls" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf)
    num_params = sum(p.numel() for p in model.parameters())  # parameters() dedupes tied weights
    hidden = _first(hf, "hidden_size", "n_embd", "d_model")
    return ModelShape(
        num_params=num_params,
        hidden_size=hidden,
        num_layers=_first(hf, "num_hidden_layers", "n_layer", "num_layers"),
        vocab_size=hf.vocab_size,
        max_positions=_first(hf, "max_position_embeddings", "n_positions"),
        num_heads=_first(hf, "num_attention_heads", "n_head"),
        intermediate_size=_first(hf, "intermediate_size", "n_inner", default=None) or 4 * hidden,
        block_classes=block_classes(model),
        model_type=getattr(hf, "model_type", "") or "",
    )


def transformer_blocks(model: "nn.Module") -> list["nn.Module"]:
    """The repeated blocks of the layer stack: members of an nn.ModuleList whose class is one of the
    model's HF `_no_split_modules`; where the model names none, the first ModuleList's children.

    The unit of sharding: the FSDP backend shards each block on its own (one block's full
    parameters live at a time), and ZeRO-3 gathers each as one leaf module (block_classes).
    Only stack members count, not every `_no_split_modules` class: BERT-family models also list
    their embeddings module (BertEmbeddings), whose inputs are token ids that carry no gradient.
    DeepSpeed reduces a leaf's gradients in a full backward hook, and PyTorch fires that hook as
    soon as the gradient of the module's OUTPUT exists when no input requires grad, i.e. before the
    module's own parameter gradients: ZeRO-3 then crashed in the first backward ("size of tensor a
    (0) must match ... (384)"). A stack member is fed the previous block's hidden state.
    """
    from torch import nn

    names = set(getattr(model, "_no_split_modules", None) or [])
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    blocks = [b for stack in stacks for b in stack if type(b).__name__ in names]
    if not blocks:
        base = getattr(model, "base_model", model)
        for m in base.modules():
            if isinstance(m, nn.ModuleList):
                blocks.extend(m)
                break  # the first ModuleList of the base model is the layer stack
    return blocks


def block_classes(model: "nn.Module") -> tuple[str, ...]:
    """Distinct class names of transformer_blocks(model), in model order."""
    return tuple(dict.fromkeys(type(b).__name__ for b in transformer_blocks(model)))
