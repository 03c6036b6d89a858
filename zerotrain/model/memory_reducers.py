"""Memory reducers for long sequences: what grows with seq-len besides attention, cut into tiles that are
recomputed in backward (DeepSpeed's ALST does the same with TiledMLP and TiledFusedLogitsLoss in
deepspeed/runtime/sequence_parallel/ulysses_sp.py; these are written on torch.utils.checkpoint so they work
under ZeRO-3's parameter hooks, FSDP2's DTensors and peft alike, and take this project's pre-shifted labels).

- tiled MLP (--tiled-mlp T): each block's MLP runs over sequence tiles of T tokens, each under a
  non-reentrant checkpoint, so the [b, s, intermediate] activations exist one tile at a time (forward and
  backward); the MLP acts per token, so the result is the untiled one.
- chunked loss (--chunked-loss T): the causal LM's forward stops at the hidden states; the head and the
  cross-entropy run over chunks of T tokens, each under a checkpoint, so the [s, vocab] logits (fp32 for
  the loss: 4 x s x vocab bytes, the largest activation of a long-sequence step) exist one chunk at a time.
  `chunked_lm_loss` and `chunked_token_logps` are the one implementation other losses reuse.
- offload activations (--offload-activations): the tensors saved for backward go to pinned host memory
  (torch.autograd.graph.save_on_cpu) - a GPU's memory reducer; on CPU it means nothing and is refused
  (config/rules.py UNUSED).

`apply` installs the first two on a built model (ModelPreparation.apply, after LoRA); `check` refuses, in one
line, a model they cannot be installed on before anything is built around it.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from ..errors import UserError
from .lora import unwrapped
from .sequence_parallel import IGNORE, shifted_labels

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config attributes of families whose logits are not the head's output as it is (Gemma-2's softcapping,
Cohere's scale, Granite's scaling, ...): the chunked loss would drop them, so such a model is refused."""


# --- tiled MLP ------------------------------------------------------------------------------------------
def mlp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every transformer block's MLP: the modules named `mlp` (Llama, Qwen2, Mistral, GPT-2, ... all name it so)."""
    return [m for name, m in unwrapped(model).named_modules() if name.rsplit(".", 1)[-1] == "mlp"]


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], tile_tokens: int, hidden: torch.Tensor,
           *args: Any, **kwargs: Any) -> torch.Tensor:
    """forward(hidden) over tiles of the sequence (dim 1), each recomputed in backward."""
    if hidden.dim() != 3 or hidden.shape[1] <= tile_tokens or args or kwargs:
        return forward(hidden, *args, **kwargs)
    tiles = [checkpoint(forward, part.contiguous(), use_reentrant=False) for part in hidden.split(tile_tokens, dim=1)]
    return torch.cat(tiles, dim=1)


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> int:
    """Make every block's MLP run tiled; returns how many were."""
    mlps = mlp_modules(model)
    for m in mlps:
        m.forward = functools.partial(_tiled, m.forward, tile_tokens)
    return len(mlps)


# --- chunked loss ---------------------------------------------------------------------------------------
def _chunk_loss_sum(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # fp32 for the loss, as transformers' ForCausalLMLoss upcasts
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


def chunked_lm_loss(hidden: torch.Tensor, head: torch.nn.Module, shift_labels: torch.Tensor,
                    chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token cross-entropies, tokens counted) of hidden states [b, s, h] through the output head
    against labels already shifted ([b, s]: the token each position predicts, IGNORE where none), never holding
    more than chunk_tokens rows of logits: fused (zerotrain/model/fused_loss.py) on a head it was installed on,
    else each chunk recomputed in backward. `head` is called as a module (ZeRO-3 gathers its weight in its hooks,
    FSDP2 in its own, GPT-2's tied embedding is the same weight)."""
    flat, labels = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device)
    if getattr(head, "_zt_fused", False):  # fused_loss.install_on_head: gradients made in the forward
        return head(flat, fused_labels=labels, chunk_tokens=chunk_tokens), (labels != IGNORE).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if bool((labels[part] != IGNORE).any()):
            total = total + checkpoint(_chunk_loss_sum, head, flat[part], labels[part], use_reentrant=False)
    return total, (labels != IGNORE).sum()


def _chunk_logps(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                 entropies: bool = False) -> Any:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    safe = labels.clamp(min=0)
    logps = torch.gather(logp_all, 1, safe.unsqueeze(1)).squeeze(1)
    logps = torch.where(labels == IGNORE, torch.zeros_like(logps), logps)
    if not entropies:
        return logps
    with torch.no_grad():
        detached = logp_all.detach()
        return logps, -(detached.exp() * detached).sum(-1)


def chunked_token_logps(hidden: torch.Tensor, head: torch.nn.Module, shift_labels: torch.Tensor,
                        chunk_tokens: int, temperature: float = 1.0, entropies: bool = False) -> Any:
    """Per-token log-probabilities of the (pre-shifted) labels under softmax(logits / temperature), [b, s] with 0
    where IGNORE, chunk by chunk like chunked_lm_loss (what a preference loss sums per sequence, the policy loss of
    online RL per token). entropies: also each position's entropy of that distribution ([b, s], no gradient), as
    (logps, entropies)."""
    flat, labels = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device)
    parts = [checkpoint(_chunk_logps, head, flat[s:s + chunk_tokens], labels[s:s + chunk_tokens], temperature,
                        entropies, use_reentrant=False)
             for s in range(0, flat.shape[0], chunk_tokens)]
    if not entropies:
        return torch.cat(parts).reshape(shift_labels.shape)
    return (torch.cat([lp for lp, _ in parts]).reshape(shift_labels.shape),
            torch.cat([ent for _, ent in parts]).reshape(shift_labels.shape))


@dataclass
class TokenLogpsOutput(ModelOutput):
    """What the chunked forward returns for token_logps_of, as declared fields: FSDP2 finds the outputs it hooks its
    pre-backward all-gather on through a dataclass's fields (torch/distributed/fsdp/_common_utils.py
    collect_grad_tensors), so log-probs set as an extra key of CausalLMOutputWithPast were missed and the
    recomputed chunks met the head's sharded weight in backward."""

    token_logps: Optional[torch.Tensor] = None
    """[b, s] log-probabilities of the pre-shifted labels (0 where IGNORE)."""
    token_entropies: Optional[torch.Tensor] = None
    """[b, s] entropies of each position's distribution (no gradient), when asked for."""
    aux_loss: Optional[torch.Tensor] = None
    """A mixture of experts' router load-balancing loss of the pass."""


def _chunked_forward(model: torch.nn.Module, forward: Callable[..., Any], chunk_tokens: int, *args: Any,
                     labels: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
                     num_items_in_batch: Optional[torch.Tensor] = None, token_logps_of: Optional[torch.Tensor] = None,
                     logps_temperature: float = 1.0, token_entropies: bool = False, **kwargs: Any) -> Any:
    """The causal LM's forward with the chunked loss when it trains on labels (eval and generation keep the
    model's own forward, which returns logits): transformers' ForCausalLMLoss (sum / num_items_in_batch, else
    the mean over counted tokens) without the logits. token_logps_of (pre-shifted labels, a preference or policy
    loss's): the output's "token_logps" are their per-token log-probs (chunked_token_logps) under
    softmax(logits / logps_temperature), with or without gradients; token_entropies: "token_entropies" too."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if token_logps_of is not None:
        kwargs.pop("logits_to_keep", None)
        out = model.base_model(*args, **kwargs)
        got = chunked_token_logps(out[0], model.get_output_embeddings(), token_logps_of, chunk_tokens,
                                  logps_temperature, token_entropies)
        logps, entropies = got if token_entropies else (got, None)
        return TokenLogpsOutput(token_logps=logps, token_entropies=entropies, aux_loss=out.get("aux_loss"))
    if (labels is None and shift_labels is None) or not torch.is_grad_enabled():
        return forward(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                       **kwargs)
    kwargs.pop("logits_to_keep", None)
    kwargs["use_cache"] = False
    out = model.base_model(*args, **kwargs)
    target = shift_labels if shift_labels is not None else shifted_labels(labels)
    total, counted = chunked_lm_loss(out[0], model.get_output_embeddings(), target, chunk_tokens)
    divisor = num_items_in_batch if num_items_in_batch is not None else counted.clamp(min=1)
    return CausalLMOutputWithPast(loss=total / divisor, logits=None)


def chunked_loss_problem(model: torch.nn.Module) -> Optional[str]:
    """Why the chunked loss cannot replace this model's head + loss (one line), or None."""
    base = unwrapped(model)
    name = type(base).__name__
    if base.base_model is base or not isinstance(base.get_output_embeddings(), torch.nn.Linear):
        return f"{name} has no plain backbone + Linear output head to chunk"
    for attr in LOGIT_TRANSFORMS:
        value = getattr(base.config, attr, None)
        if value not in (None, 1, 1.0):
            return f"{name} transforms its logits ({attr}={value}), which the chunked loss would drop"
    return None


def fused_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The causal LM's output head (None for a model without one)."""
    base = unwrapped(model)
    get = getattr(base, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def installed_chunk(model: torch.nn.Module) -> int:
    """Tokens per chunk of the head that apply installed on this model (the preparation's loss_chunk, as run);
    0: the model's own head, whole logits."""
    head = fused_head(model)
    return getattr(head, "_zt_chunk", 0) if head is not None else 0


def default_chunk_problem(model: torch.nn.Module) -> Optional[str]:
    """Why a default (auto) head chunking is off on this model (one line), or None: what the chunked loss cannot
    run, and a mixture of experts, whose causal LM's forward adds the router's load-balancing loss (computed from
    the router logits after the backbone, which the chunked path skips)."""
    from .router import moe_blocks

    problem = chunked_loss_problem(model)
    if problem:
        return problem
    if moe_blocks(model):
        return (f"{type(unwrapped(model)).__name__} is a mixture of experts, whose forward adds the router's "
                "load-balancing loss to the LM loss")
    return None


def fused_loss_problem(model: torch.nn.Module) -> Optional[str]:
    """Why the fused loss cannot replace this model's head + loss (one line), or None."""
    from .fused_loss import carries_fused

    problem = default_chunk_problem(model)
    if problem:
        return problem
    head = fused_head(model)
    if not carries_fused(head):
        return (f"{type(unwrapped(model)).__name__}'s output head is a {type(head).__name__} (fake-quantized or "
                "adapted), whose own forward must run")
    return None


def _moe_mlps(model: torch.nn.Module) -> bool:
    """Whether some block's MLP is, or holds, a mixture-of-experts block (the routers the model declares,
    zerotrain/model/router.py moe_blocks)."""
    from .router import moe_blocks

    routers = {id(b.router) for b in moe_blocks(model)}
    return any(id(m) in routers for mlp in mlp_modules(model) for m in mlp.modules())


def check(model: torch.nn.Module, tiled_mlp: int, chunked_loss: int) -> None:
    """Refuse (UserError, one line) reducers this model cannot carry."""
    if tiled_mlp and not mlp_modules(model):
        raise UserError(f"model.tiled_mlp: {type(unwrapped(model)).__name__} has no blocks with an `mlp` module to "
                        "tile; drop --tiled-mlp")
    if tiled_mlp and _moe_mlps(model):
        raise UserError(f"model.tiled_mlp: {type(unwrapped(model)).__name__}'s MLPs are mixture-of-experts blocks (their "
                        "routers' logits, which the load-balancing loss reads, would be cut by tile); drop --tiled-mlp")
    if chunked_loss:
        problem = chunked_loss_problem(model)
        if problem:
            raise UserError(f"model.chunked_loss: {problem}; drop --chunked-loss")


def apply(model: torch.nn.Module, tiled_mlp: int, chunked_loss: int, fused: bool = False) -> torch.nn.Module:
    """Install the reducers asked for on a built model (under peft: on its base model); returns it. fused: the
    chunked loss is the fused one (fused_loss.py) where the head is a plain Linear."""
    check(model, tiled_mlp, chunked_loss)
    if tiled_mlp:
        tile_mlps(model, tiled_mlp)
    if chunked_loss:
        from .fused_loss import carries_fused, install_on_head

        base = unwrapped(model)
        head = base.get_output_embeddings()
        if fused and carries_fused(head):
            install_on_head(head)
        head._zt_chunk = chunked_loss  # what the banner says
        chunked = functools.partial(_chunked_forward, base, base.forward, chunked_loss)
        # transformers' generate reads the forward's parameters (position_ids from a left-padded attention mask,
        # logits_to_keep): the wrapper shows the model's own (without it, left-padded rows got shifted positions)
        chunked.__signature__ = inspect.signature(base.forward)  # type: ignore[attr-defined]
        base.forward = chunked
    return model
