"""Model facts from a HF config alone (no weights loaded): one record (ModelFacts) of parameter
count and shapes, sizes, the transformer-block classes and the family, from one meta-device model
builder (meta_model) of the task's Auto class (TaskSpec.model_class).

Read by the DeepSpeed config (buckets, ZeRO-3 leaf blocks), `zerotrain train`, the FSDP backend
(one shard unit per block) and the memory estimator (`estimate`, `compare`). The count is exact:
the model is built on the meta device, which allocates no memory.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..assets.demo import TINY_PRESETS
from ..errors import ConfigError, first_line

if TYPE_CHECKING:
    from torch import nn

    from ..tasks import TaskSpec

@dataclass(frozen=True)
class ModelFacts:
    """What zerotrain needs to know about a model, read from its config and a meta-device build."""

    num_params: int
    """Parameter elements (tied weights counted once)."""
    hidden_size: int
    """Residual width."""
    num_layers: int = 0
    """Transformer blocks."""
    vocab_size: int = 0
    """Vocabulary size."""
    max_positions: int | None = None
    """Longest sequence the position embeddings allow (None if unbounded, e.g. rotary)."""
    num_heads: int = 0
    """Attention heads."""
    intermediate_size: int = 0
    """MLP inner width."""
    block_classes: tuple[str, ...] = ()
    """Class names of the repeated transformer blocks (transformer_blocks), e.g. ("GPT2Block",)."""
    model_type: str = ""
    """The HF config's model_type, e.g. 'gpt2', 'llama', 'bert' (speed defaults are measured per family)."""
    param_shapes: tuple[tuple[int, ...], ...] = ()
    """Shape of every trainable parameter tensor (tied weights once): the memory formulas' input."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention; = num_heads without it)."""
    block_tp_plan: tuple[tuple[str, str], ...] = ()
    """The HF config's tensor-parallel plan inside one block: (submodule, style), e.g.
    ("self_attn.q_proj", "colwise"); empty when the model ships none (GPT-2, BERT)."""
    attention_types: tuple[str, ...] = ()
    """The attention of each block as transformers names it ("full_attention", "sliding_attention",
    "chunked_attention", ...): the config's layer_types, else every block sliding where the config has a
    sliding_window, else full (attention_types_of)."""
    attention_extras: tuple[str, ...] = ()
    """What the model's attention computes beyond a masked softmax (attention_extras_of), e.g.
    "attn_logit_softcapping" (Gemma 2): an attention function that does plain softmax attention refuses it."""
    num_experts: int = 0
    """Routed experts per mixture-of-experts block (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k) in a mixture-of-experts block."""
    expert_params: int = 0
    """Parameter elements of the routed experts (the modules the expert-parallel plan dispatches to,
    zerotrain/model/router.py moe_blocks), all blocks; 0 where a model declares no such plan."""
    expert_shapes: tuple[tuple[int, ...], ...] = ()
    """Shape of every trainable routed-expert tensor (also in param_shapes): what --ep splits along dim 0."""
    moe_blocks: int = 0
    """Blocks holding a mixture of experts (DeepSeek-V3's first blocks are dense)."""
    expert_parallel_plan: bool = False
    """Whether the HF config ships an expert-parallel plan transformers dispatches tokens with
    (base_model_ep_plan with an "ep_dispatch_experts" rule): what --ep needs."""
    adapted_experts: bool = False
    """Whether LoRA adapters sit on the routed experts' weights (peft wraps the fused 3-D expert tensors under
    "all-linear" or when named): a model prepared with LoRA (ModelPreparation.for_sizing)."""
    router_aux_coef: float | None = None
    """The HF config's router load-balancing loss weight (router_aux_loss_coef) where its causal LM defines that
    loss (Mixtral, Qwen3-MoE); None where it defines none (DeepSeek-V2/V3, dense models)."""
    attention_interface: bool = True
    """Whether the model's attention goes through transformers' attention interface (its class's
    is_backend_compatible), so that a registered attention function (sequence parallelism's) replaces it."""
    frozen_shapes: tuple[tuple[int, ...], ...] = ()
    """Shape of every frozen parameter tensor (a LoRA run's base; empty for full fine-tuning):
    held as parameters, with no gradient or optimizer state."""
    block_matrix_shapes: tuple[tuple[int, ...], ...] = ()
    """Shape of every trainable 2-D weight inside the transformer blocks (block_matrices): what --optimizer muon
    steps with Muon (one momentum buffer) instead of AdamW (two)."""
    static_cache_refusal: str = ""
    """Why transformers builds this model no static KV cache, as rl.cache_implementation static's one-line refusal
    (static_cache_refusal); "" where it builds one."""

    @property
    def frozen_params(self) -> int:
        """Frozen parameter elements (num_params counts them too)."""
        return sum(math.prod(shape) for shape in self.frozen_shapes)

    @property
    def active_params(self) -> int:
        """Parameter elements one token goes through: the dense ones and its top-k experts' share."""
        if not self.num_experts:
            return self.num_params
        routed = self.expert_params * min(self.experts_per_token, self.num_experts) // self.num_experts
        return self.num_params - self.expert_params + routed

    @property
    def numels(self) -> list[int]:
        """Elements of each trainable parameter tensor."""
        return [math.prod(shape) for shape in self.param_shapes]


def load_hf_config(name_or_path: str):
    """AutoConfig for a hub id, a model directory, a config.json file or a tiny preset name."""
    from transformers import CONFIG_MAPPING, AutoConfig

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


def max_positions(hf_config: Any) -> Optional[int]:
    """Longest sequence the model's position embeddings allow (None when unbounded)."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def meta_model(hf_config, task: Optional["TaskSpec"] = None, **kwargs) -> "nn.Module":
    """The task's model for a HF config on the meta device (task None: causal-lm): the architecture, no weights, no
    memory. kwargs go to from_config (e.g. dtype)."""
    import torch

    from ..tasks import TASKS

    with torch.device("meta"):
        return (task or TASKS["causal-lm"]).model_class.from_config(hf_config, **kwargs)


def _full_shape(p) -> tuple[int, ...]:
    """A parameter's whole shape, also when ZeRO-3 has partitioned it (its local tensor is then empty)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def facts_of(model: "nn.Module", hf_config) -> ModelFacts:
    """ModelFacts of a built model (usually on the meta device; a ZeRO-3 model built under zero.Init
    counts its partitioned parameters whole) and its HF config."""
    from .lora import unwrapped
    from .router import experts_per_token_of, moe_blocks, num_experts_of, router_aux_coef_of

    blocks = moe_blocks(model)  # a declared but unfound mixture of experts is refused here, before launch
    expert_tensors = {id(p): (n, p) for b in blocks for n, p in _routed_expert_parameters(b)}
    # an image-text config holds the language model's sizes in its text config (transformers' get_text_config)
    dims = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    hidden = _first(dims, "hidden_size", "n_embd", "d_model", default=0)
    return ModelFacts(
        num_params=sum(math.prod(_full_shape(p)) for p in model.parameters()),  # parameters() dedupes ties
        hidden_size=hidden,
        num_layers=_first(dims, "num_hidden_layers", "n_layer", "num_layers", default=0),
        vocab_size=getattr(dims, "vocab_size", 0) or 0,
        max_positions=max_positions(dims),
        num_heads=_first(dims, "num_attention_heads", "n_head", default=0),
        intermediate_size=_first(dims, "intermediate_size", "n_inner", default=None) or 4 * hidden,
        block_classes=block_classes(model),
        model_type=getattr(hf_config, "model_type", "") or "",
        param_shapes=tuple(_full_shape(p) for p in model.parameters() if p.requires_grad),
        num_kv_heads=_first(dims, "num_key_value_heads", "num_attention_heads", "n_head", default=0),
        block_tp_plan=block_tp_plan(hf_config),
        attention_types=attention_types_of(dims),
        attention_extras=attention_extras_of(dims),
        attention_interface=bool(getattr(model, "is_backend_compatible", lambda: False)()),
        num_experts=num_experts_of(hf_config),
        experts_per_token=experts_per_token_of(hf_config),
        expert_params=sum(math.prod(_full_shape(p)) for _, p in expert_tensors.values()),
        expert_shapes=tuple(_full_shape(p) for n, p in expert_tensors.values() if p.requires_grad and "lora_" not in n),
        moe_blocks=len(blocks),
        expert_parallel_plan="ep_dispatch_experts" in (getattr(hf_config, "base_model_ep_plan", None) or {}).values(),
        router_aux_coef=router_aux_coef_of(hf_config),
        adapted_experts=any("lora_" in n for n, _ in expert_tensors.values()),
        frozen_shapes=tuple(_full_shape(p) for p in model.parameters() if not p.requires_grad),
        block_matrix_shapes=tuple(_full_shape(p) for p, _ in block_matrices(model) if p.requires_grad),
        static_cache_refusal=static_cache_refusal(unwrapped(model)),
    )


def block_matrices(model: "nn.Module") -> list[tuple["nn.Parameter", "nn.Module"]]:
    """(parameter, its module) of every 2-D weight inside the transformer blocks (transformer_blocks), in block
    order: the attention and MLP projections (the matrices --optimizer muon orthogonalises)."""
    out, seen = [], set()
    for block in transformer_blocks(model):
        for module in block.modules():
            for p in module.parameters(recurse=False):
                if len(_full_shape(p)) == 2 and id(p) not in seen:  # a ZeRO-3 partition counts whole
                    seen.add(id(p))
                    out.append((p, module))
    return out


def kv_cache_of(model: "nn.Module", cache_implementation: Optional[str] = None) -> str:
    """The KV cache a model's `generate` calls use under rl.cache_implementation, as grpo's banner and metrics.jsonl
    name it: "static" or "dynamic" (transformers' GenerationConfig names; None: dynamic, its default), or "own" for a
    model with a cache of its own (transformers' _supports_default_dynamic_cache, by class: RWKV, XLNet, ...)."""
    supports_dynamic = getattr(model, "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        return "own"
    return cache_implementation or "dynamic"


def static_cache_refusal(model: "nn.Module") -> str:
    """rl.cache_implementation static's one-line refusal for a model (its class and config; a meta-device build will
    do) for which transformers builds no static KV cache: it would ignore the setting (a model with a cache of its
    own: transformers' _supports_default_dynamic_cache, by class) or fail inside generate (a layer kind its StaticCache
    does not know). "" where it builds one, and for a model that does not generate (no GenerationMixin). The plan
    refuses with it before launch (ModelFacts), a generation phase before it gathers anything
    (backends/generation.py check_static_cache)."""
    from transformers import StaticCache

    if getattr(model, "_supports_default_dynamic_cache", None) is None or getattr(model, "config", None) is None:
        return ""
    why = "has a cache of its own" if kv_cache_of(model) == "own" else ""
    if not why:
        try:  # its layers are built lazily: this allocates nothing
            StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=1)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            why = f"has a layer transformers' StaticCache does not hold ({type(e).__name__}: {e})"
    if not why:
        return ""
    kind = getattr(model.config, "model_type", "") or "?"
    return (f"rl.cache_implementation=static: {type(model).__name__} (model type '{kind}') {why}; "
            "drop --cache-implementation (the model's default cache)")


def _routed_expert_parameters(block) -> list[tuple[str, "nn.Parameter"]]:
    """(name, parameter) of one MoE block's routed experts: the modules its expert-parallel plan dispatches to; for a
    model without such a plan (DBRX, JetMoE), every parameter of the block but its router's."""
    if block.experts is not None:
        return list(block.experts.named_parameters())
    router = {id(p) for p in block.router.parameters()}
    return [(n, p) for n, p in block.module.named_parameters() if id(p) not in router]


def attention_types_of(hf_config) -> tuple[str, ...]:
    """Per-block attention kind, as the HF model itself picks each block's mask: `layer_types` where the
    config has them (Qwen2, Gemma 2/3, ...), else sliding for every block under a `sliding_window`
    (Mistral), else full attention."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(str(t) for t in types)
    layers = _first(hf_config, "num_hidden_layers", "n_layer", "num_layers", default=0) or 0
    sliding = getattr(hf_config, "sliding_window", None) is not None
    return ("sliding_attention" if sliding else "full_attention",) * layers


ATTENTION_EXTRA_SETTINGS = ("attn_logit_softcapping",)
"""Config attributes that, set, add to the attention's softmax (Gemma 2's score softcapping)."""
SINK_MODEL_TYPES = ("gpt_oss",)
"""Model types whose attention has learned sink logits."""


def attention_extras_of(hf_config) -> tuple[str, ...]:
    """The config's attention features beyond a masked softmax (ModelFacts.attention_extras)."""
    extras = [a for a in ATTENTION_EXTRA_SETTINGS if getattr(hf_config, a, None) is not None]
    if getattr(hf_config, "model_type", "") in SINK_MODEL_TYPES:
        extras.append("attention sinks")
    return tuple(extras)


def block_tp_plan(hf_config) -> tuple[tuple[str, str], ...]:
    """The per-block entries ("layers.*.<sub>": style) of the config's base_model_tp_plan."""
    plan = getattr(hf_config, "base_model_tp_plan", None) or {}
    return tuple((key.split(".*.", 1)[1], style) for key, style in plan.items() if ".*." in key)


def model_facts(name_or_path: str, task: Optional["TaskSpec"] = None, cfg=None) -> ModelFacts:
    """ModelFacts of a hub id, a local directory, a config.json or a tiny preset (no weights loaded);
    with a RunConfig that asks for LoRA, of the peft model (adapters trainable, base frozen)."""
    hf = load_hf_config(name_or_path)
    return run_facts(meta_model(hf, task), hf, cfg)


def run_facts(model: "nn.Module", hf_config, cfg=None) -> ModelFacts:
    """facts_of the model a run trains, as its ModelPreparation prepares it for sizing (for_sizing): under
    LoRA the peft model on the meta device; under QAT a model torchao cannot quantize is refused. (train's
    preflight sizes with the preparation it made once, the same way.)"""
    if cfg is not None:
        from .preparation import ModelPreparation

        model = ModelPreparation.from_config(cfg).for_sizing(model)
    return facts_of(model, hf_config)


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
    """Distinct class names of transformer_blocks(model), in model order: ZeRO-3's leaf modules.

    Less the image tower's blocks of a model that reads its image features from the tower's hidden states (a config
    naming vision_feature_layer: LLaVA and its kin): transformers records those outputs in a forward hook, which sees
    a block's output before DeepSpeed's full backward hook wraps it, so their gradient bypasses the hook and the
    leaf's gradients are never reduced (DeepSpeed 0.19's zero_grad then fails: "unknown parameter type"). Those
    blocks keep DeepSpeed's per-submodule hooks."""
    blocks = transformer_blocks(model)
    if getattr(getattr(model, "config", None), "vision_feature_layer", None) is not None:
        from .vision_roles import tower_blocks

        recorded = {id(b) for b in tower_blocks(model)}
        blocks = [b for b in blocks if id(b) not in recorded]
    return tuple(dict.fromkeys(type(b).__name__ for b in blocks))
