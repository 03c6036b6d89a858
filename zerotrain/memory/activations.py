"""What one micro-batch adds to a rank beyond the model states, predicted from the model's facts (see
memory/estimate.py FORMULAS): the activations kept for backward, an image-text model's images, and the bytes the
sequence- and expert-parallel all-to-alls send. memory/estimate.py sums them into a rank's estimate;
`zerotrain estimate` prints the image and all-to-all lines."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..errors import UserError
from ..util import human_bytes
from .runtime import dtype_bytes

if TYPE_CHECKING:
    from ..config.schema import RunConfig
    from ..model.facts import ModelFacts
    from ..model.vision_roles import ImageTextSize


def activation_bytes(spec: ModelFacts, micro_batch: int, seq_len: int, precision: str,
                     gradient_checkpointing: bool = False, eager_attention: bool = False, *, tp: int = 1,
                     blocks: Optional[int] = None, in_flight: int = 1, logits: int = 1, mlp_tile: int = 0,
                     loss_chunk: int = 0, fused_loss: bool = False) -> int:
    """Activations one rank keeps for backward (see FORMULAS): `blocks` transformer blocks (default all)
    for `in_flight` micro-batches, split `tp` ways, plus `logits` micro-batches' logits (0 off the last
    pipeline stage). mlp_tile / loss_chunk: the tiled MLP's and the chunked loss's tokens per tile/chunk
    (zerotrain/model/memory_reducers.py; 0 = off); fused_loss: the chunks are the fused loss's, which also
    holds an fp32 [vocab, hidden] gradient buffer of the head (zerotrain/model/fused_loss.py)."""
    s, b, h = seq_len, micro_batch, spec.hidden_size
    n_layers = spec.num_layers if blocks is None else blocks
    e = dtype_bytes(precision)
    mlp_inner = 2 * spec.intermediate_size // tp
    per_layer = s * b * (4 * h + 4 * h // tp + (0 if mlp_tile and s > mlp_tile else mlp_inner)) * e
    if eager_attention:
        per_layer += 2 * spec.num_heads * s * s * b * e // tp
    head_tokens = min(loss_chunk, s * b) if loss_chunk else s * b
    head = logits * head_tokens * spec.vocab_size * (e + 8)
    if fused_loss and loss_chunk and logits:
        head += 4 * spec.vocab_size * h
    if mlp_tile and s > mlp_tile and n_layers:  # one tile's inner activations at a time, recomputed in backward
        head += mlp_tile * b * mlp_inner * e
    if gradient_checkpointing:
        return in_flight * n_layers * s * b * h * e + (per_layer if n_layers else 0) + head
    return in_flight * n_layers * per_layer + head


def image_bytes(images: ImageTextSize, micro_batch: int, precision: str) -> int:
    """What an image-text model's images add to a rank's activations (see FORMULAS): the pixel tensors and, when
    the tower trains, the tower's activations, one image per sample."""
    return images.tower_activation_bytes(micro_batch, dtype_bytes(precision)) + images.pixel_bytes * micro_batch


def image_text_line(images: ImageTextSize, micro_batch: int, precision: str) -> str:
    """`zerotrain estimate`'s line about the images: the tower and projector, image tokens, pixel tensors."""
    tower = images.tower_activation_bytes(micro_batch, dtype_bytes(precision))
    where = f"{human_bytes(tower)} of activations per micro-batch" if images.vision_trains else \
        "frozen: no gradients, optimizer state or activations"
    line = (f"image-text: vision tower {images.vision_params:,} parameters ({where}), projector "
            f"{images.projector_params:,} parameters")
    h, w = images.image_size
    if not h:
        return line + "; no processor found: image tokens and pixel tensors not counted"
    return line + (f"; {images.image_tokens} image tokens per sample (inside --seq-len), "
                   f"{human_bytes(images.pixel_bytes * micro_batch)} of pixel tensors per micro-batch "
                   f"(a {h}x{w} image per sample, the processor's size)")


_IMAGE_TEXT: dict[str, Optional[ImageTextSize]] = {}


def image_text_for(cfg: RunConfig) -> Optional[ImageTextSize]:
    """The ImageTextSize of the run's model (vision_roles.image_text_size on the meta-device model, prepared as the
    run prepares it, and its processor); None for a text-only model or one whose config cannot be read here (the
    facts the plan holds were given). Cached per model and preparation settings."""
    name = cfg.model.name or cfg.model.from_config
    if not name:
        return None
    key = cfg.model.model_dump_json() + cfg.lora.model_dump_json() + str(cfg.run.seed)
    if key not in _IMAGE_TEXT:
        from ..model.facts import load_hf_config
        from ..model.vision_roles import image_text_size
        from ..tasks import image_text

        try:
            hf = load_hf_config(name)
        except UserError:
            hf = None
        size = None
        if hf is not None and image_text(hf):
            import torch
            from transformers import AutoModelForImageTextToText

            from ..model.preparation import ModelPreparation

            with torch.device("meta"):
                model = AutoModelForImageTextToText.from_config(hf)
            model = ModelPreparation.from_config(cfg).for_sizing(model)
            size = image_text_size(model, _processor(cfg.model.name))
        _IMAGE_TEXT[key] = size
    return _IMAGE_TEXT[key]


def _processor(name: Optional[str]) -> Any:
    """The model's processor (AutoProcessor) where one loads; None where it does not (a config alone, offline)."""
    if not name:
        return None
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(name)
    except (OSError, ValueError, AttributeError, ImportError):
        return None
    return processor if hasattr(processor, "image_processor") else None


def all_to_all_bytes(spec: ModelFacts, micro_batch: int, seq_len: int, precision: str, sp: int, tp: int = 1) -> int:
    """Bytes one rank sends per micro-batch under sequence parallelism (forward and backward): per block the
    all-to-all of its shard's queries, keys, values (key/value heads fewer than sp repeated up to sp) and the
    attention output, each rank keeping 1/sp of what it holds. Under sp x tp a rank holds heads / tp of them."""
    if sp == 1:
        return 0
    all_heads = spec.num_heads or 1
    heads = max(all_heads // tp, 1)
    kv = max((spec.num_kv_heads or all_heads) // tp, 1, sp)
    head_dim = spec.hidden_size // all_heads
    per_block = micro_batch * -(-seq_len // sp) * head_dim * (2 * heads + 2 * min(kv, heads)) * dtype_bytes(precision)
    return 2 * spec.num_layers * per_block * (sp - 1) // sp


def expert_all_to_all_bytes(spec: ModelFacts, micro_batch: int, seq_len: int, precision: str, ep: int) -> int:
    """Bytes one rank sends per micro-batch under expert parallelism: in every MoE block each of its tokens' top-k
    copies whose expert lives on another rank ((ep-1)/ep of them under even routing) goes there and comes back
    (dispatch and combine), in forward and in backward."""
    if ep == 1 or not spec.moe_blocks:
        return 0
    copies = micro_batch * seq_len * max(spec.experts_per_token, 1)
    return 4 * spec.moe_blocks * copies * spec.hidden_size * dtype_bytes(precision) * (ep - 1) // ep
