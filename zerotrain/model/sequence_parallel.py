"""Ulysses sequence parallelism for HF models: every sample's sequence is cut over the sp ranks of a group;
attention all-to-alls queries, keys and values from sequence shards to head shards, attends over the whole
sequence, and all-to-alls back (DeepSpeed-Ulysses; DeepSpeed's ALST does the same for HF models in
deepspeed/runtime/sequence_parallel/ulysses_sp.py).

Everything but attention acts per token (embeddings, norms, MLPs, the head), so only attention needs the
other shards. Under tensor parallelism (sp x tp, FSDP2) q/k/v are split colwise first: the attention gets the
heads / tp query heads and kv_heads / tp key/value heads its tp rank computes and cuts those over the sp group
(ranks of the same tp coordinate); the head stays whole, so each rank's logits and loss are its shard's as without
tp. The function is registered with transformers' attention interface under ATTENTION_NAME, so
every model whose attention goes through it (GPT-2, Llama, Qwen2, Mistral, ...) runs it unchanged.

Exactness, as one process computes the same batch:
- the cut is taken after the labels are shifted (`shift_labels`), with every shard's global position ids, so
  rotary and absolute position embeddings see the same positions and no label is lost at a shard's edge;
- after the all-to-all each rank holds the whole sequence in order (shard r is tokens r*S/sp ...), so
  `is_causal` attention is the unsharded causal attention; transformers passes a custom attention function no
  mask, so the masks it needs are rebuilt here over the whole sequence: a layer's sliding window (the
  `sliding_window` transformers passes, as its own mask builders use it: key > query - window) and packed
  documents (--packing: where the whole sequence's position ids restart, transformers'
  find_packed_sequence_indices); any other attention kind is refused before launch (plan/parallel_rules.py);
- right padding (the collate pads right) is invisible to earlier tokens under causal attention and its labels
  are -100; a sequence is padded the same way to a multiple of sp;
- the loss of a shard is its token sum over (the usual divisor / sp): the backends average gradients over
  dp x sp ranks, so the sp ranks' shares add up to the replica's loss; its value is the sp group's mean
  (the replica's loss, what is logged) while its gradient stays the shard's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

ATTENTION_NAME = "zerotrain_ulysses"
"""The name the all-to-all attention is registered under (transformers' AttentionInterface)."""

IGNORE = -100


@dataclass
class SequenceGroup:
    """This rank's sequence-parallel group."""

    group: Any
    """The torch.distributed process group of the sp ranks that share this rank's samples."""
    size: int
    """sp: ranks per group (shards per sequence)."""
    rank: int
    """This rank's shard index in the group (its coordinate along sp)."""
    documents: Optional[torch.Tensor] = None
    """The current micro-batch's document index of every token of the whole sequence [b, S] (packed rows), None
    when every row is one sequence; set by shard_batch."""
    masks: Optional[dict] = None
    """The current micro-batch's rebuilt masks by sliding window (None = none), built once per forward."""


_ACTIVE: Optional[SequenceGroup] = None
"""The group the registered attention all-to-alls over: one sequence-parallel layout per process."""


def _seq_to_heads(x: torch.Tensor, g: SequenceGroup) -> torch.Tensor:
    """[b, h, s/sp, d] sequence shard of every head -> [b, h/sp, s, d] the whole sequence of h/sp heads."""
    from torch.distributed._functional_collectives import all_to_all_single

    b, h, s, d = x.shape
    x = x.reshape(b, g.size, h // g.size, s, d).transpose(0, 1).contiguous()  # [sp, b, h/sp, s/sp, d]
    y = all_to_all_single(x, None, None, g.group)  # dim 0 is now the source rank: its sequence shard
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // g.size, g.size * s, d)


def _heads_to_seq(x: torch.Tensor, g: SequenceGroup) -> torch.Tensor:
    """[b, h/sp, s, d] -> [b, h, s/sp, d]: the inverse of _seq_to_heads."""
    from torch.distributed._functional_collectives import all_to_all_single

    b, hl, s, d = x.shape
    x = x.reshape(b, hl, g.size, s // g.size, d).permute(2, 0, 1, 3, 4).contiguous()  # [sp, b, h/sp, s/sp, d]
    y = all_to_all_single(x, None, None, g.group)  # dim 0 is now the source rank: its heads
    return y.transpose(0, 1).reshape(b, g.size * hl, s // g.size, d)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [b, heads, s/sp, d], key/value [b, kv_heads, s/sp, d]
    (this rank's sequence shard; under tp the heads this tp rank computes) -> output [b, s/sp, heads, d]. Key/value heads fewer than sp are repeated so
    every rank gets the ones its query heads use (as ALST does); causal over the whole sequence."""
    g = _ACTIVE
    if g is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} used without a sequence-parallel group")
    kv = key.shape[1]
    if kv < g.size:  # GQA/MQA: sp % kv == 0 (checked by the plan); head i uses kv head i // (heads / kv)
        key, value = (t.repeat_interleave(g.size // kv, dim=1) for t in (key, value))
    for extra in ("softcap", "s_aux"):  # refused before launch (ModelFacts.attention_extras); never dropped silently
        if kwargs.get(extra) is not None:
            raise RuntimeError(f"{ATTENTION_NAME}: the model's attention passes {extra}, which plain SDPA does not compute")
    query, key, value = (_seq_to_heads(t, g) for t in (query, key, value))
    if key.shape[1] != query.shape[1]:  # the local heads' groups
        r = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(r, dim=1) for t in (key, value))
    mask = whole_sequence_mask(g, query.shape[2], kwargs.get("sliding_window"), query.device)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           is_causal=mask is None, scale=scaling)
    return _heads_to_seq(out, g).transpose(1, 2).contiguous(), None


def whole_sequence_mask(g: SequenceGroup, length: int, window: Optional[int],
                        device: torch.device) -> Optional[torch.Tensor]:
    """The boolean mask [b or 1, 1, S, S] (True = attend) of a whole sequence of `length` tokens: causal, inside
    the sliding window when the layer has one, inside each packed document; None when plain causal is all it is
    (SDPA's is_causal, no mask materialised). Built once per micro-batch and window."""
    if window is None and g.documents is None:
        return None
    if g.masks is None:
        g.masks = {}
    if window not in g.masks:
        i = torch.arange(length, device=device)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed = allowed & (i[None, :] > i[:, None] - window)
        allowed = allowed[None]
        if g.documents is not None:
            docs = g.documents.to(device)
            allowed = allowed & (docs[:, :, None] == docs[:, None, :])
        g.masks[window] = allowed[:, None]
    return g.masks[window]


def install(model: torch.nn.Module, group: SequenceGroup) -> None:
    """Register the all-to-all attention and switch the model (under a peft wrapper: its base) to it."""
    global _ACTIVE
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    _ACTIVE = group
    from .lora import unwrapped

    unwrapped(model).set_attn_implementation(ATTENTION_NAME)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM labels [b, s] shifted to the token each position predicts (transformers' shift), IGNORE last."""
    out = torch.full_like(labels, IGNORE)
    out[:, :-1] = labels[:, 1:]
    return out


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens a causal-LM batch's loss counts: labels after the shift that are not IGNORE."""
    return int((labels[:, 1:] != IGNORE).sum())


def shard_batch(batch: dict[str, Any], g: SequenceGroup, pad_id: int = 0) -> dict[str, Any]:
    """This rank's cut of a causal-LM batch: input_ids, position_ids and the shifted labels (`shift_labels`;
    also passed as `labels`, which is what makes a HF model compute its loss) sliced along the sequence,
    padded on the right to a multiple of sp. The attention mask is dropped (right padding under causal
    attention changes no real token); other entries pass through. Records on g the whole sequence's packed
    documents (from where its position ids restart) that attention masks with."""
    ids = batch["input_ids"]
    b, s = ids.shape
    width = padded_width(s, g)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    labels = batch.get("labels")
    shifted = shifted_labels(labels) if labels is not None else None
    if width != s:
        extra = width - s
        ids = torch.nn.functional.pad(ids, (0, extra), value=pad_id)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)], dim=1)
        if shifted is not None:
            shifted = torch.nn.functional.pad(shifted, (0, extra), value=IGNORE)
    from transformers.masking_utils import find_packed_sequence_indices

    g.documents, g.masks = find_packed_sequence_indices(pos), None
    part = shard_slice(width, g)
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "position_ids", "labels", "attention_mask")}
    out.update(input_ids=ids[:, part].contiguous(), position_ids=pos[:, part].contiguous())
    if shifted is not None:
        out["labels"] = out["shift_labels"] = shifted[:, part].contiguous()
    return out


def padded_width(length: int, g: SequenceGroup) -> int:
    """The sequence length a batch is padded to on the right so that sp divides it (shard_batch's cut)."""
    return -(-length // g.size) * g.size


def shard_slice(width: int, g: SequenceGroup) -> slice:
    """This rank's positions of a sequence padded to `width` (padded_width)."""
    return slice(g.rank * width // g.size, (g.rank + 1) * width // g.size)


def cut(t: torch.Tensor, g: SequenceGroup, fill: int) -> torch.Tensor:
    """This rank's shard of a [rows, seq] tensor, cut as shard_batch cuts the input ids: padded on the right with
    `fill` to padded_width, then shard_slice (what a preference objective cuts its labels and masks with)."""
    width = padded_width(t.shape[1], g)
    if width != t.shape[1]:
        t = torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)
    return t[:, shard_slice(width, g)].contiguous()


def shard_loss(loss: torch.Tensor, g: SequenceGroup) -> torch.Tensor:
    """A loss whose value is the sp group's mean (the replica's loss) and whose gradient is this shard's."""
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean, group=g.group)
    return loss + (mean / g.size - loss.detach())


def gather_sequence(x: torch.Tensor, g: SequenceGroup, length: int) -> torch.Tensor:
    """The whole sequence of a per-shard tensor [b, s/sp, ...] (no gradient), cut back to `length`."""
    parts = [torch.empty_like(x) for _ in range(g.size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=g.group)
    return torch.cat(parts, dim=1)[:, :length]


def forward_shard(forward: Callable[..., Any], batch: dict[str, Any], g: SequenceGroup) -> Any:
    """One micro-batch under sp (Engine.__call__): this rank's cut of the whole sequence (every rank of the group
    holds the same batch); the loss divisor shared over the sp ranks, whose gradients the backend averages with the
    data-parallel ones (the module docstring says why)."""
    divisor = batch.pop("num_items_in_batch", None)
    labels = batch.get("labels")
    shard = shard_batch(batch, g)
    if labels is not None:
        if divisor is None:  # a plain loop's micro-batch: the mean over its label tokens, as one process
            divisor = torch.tensor(float(max(label_tokens(labels), 1)), device=labels.device)
        shard["num_items_in_batch"] = divisor / g.size
    out = forward(**shard)
    if labels is not None:
        out["loss"] = shard_loss(out.loss, g)
    return out
