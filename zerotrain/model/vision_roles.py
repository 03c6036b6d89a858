"""The parts of an image-text model by role: vision (the image encoder), projector (what maps image features into
the language model), language (the decoder and its head), found from what transformers declares about the
model, so --freeze and --lora-scope mean the same on every family.

    roles = role_map(hf_model)              # RoleMap: role -> module names, each parameter's role
    freeze(model, ("vision", "projector"))  # ModelPreparation.apply / for_sizing, before the engine is built
    roles.exclude_regex(("vision", "projector"))   # peft's exclude_modules (zerotrain/model/lora.py)
    tower_blocks(hf_model)                  # the tower's block stack (model/facts.py: which blocks are ZeRO-3 leaves)

How each part is found (transformers 5.x, no per-family table):
- vision: `get_encoder(modality="image")`, PreTrainedModel's own lookup of the image tower (LLaVA's and Gemma 3's
  model.vision_tower, Qwen2-VL's model.visual);
- language: `get_decoder()` (model.language_model) and `get_output_embeddings()` (lm_head);
- projector: the base model's (base_model_prefix) other children that hold parameters (LLaVA's and Gemma 3's
  model.multi_modal_projector); where it has none, the tower's children registered after its block stack (the
  ModuleList of the `_no_split_modules` blocks the tower declares): Qwen2-VL's model.visual.merger (Qwen3-VL's
  deepstack mergers too), which transformers builds inside the tower.
A parameter belongs to the role of the longest module name that prefixes it (model.visual.merger.* is projector,
the rest of model.visual.* vision).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from ..config.schema import IMAGE_TEXT_ROLES
from ..errors import UserError
from ..tasks import image_text

if TYPE_CHECKING:
    from torch import nn

ROLES = IMAGE_TEXT_ROLES
"""vision, projector, language: what --freeze names (zerotrain/config/schema.py types the setting)."""


def parse_roles(text: str) -> tuple[str, ...]:
    """The roles of a --freeze value ('vision,projector'), in ROLES order; the rules layer refused unknown ones."""
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    return tuple(r for r in ROLES if r in names)


def _hf(model: "nn.Module") -> "nn.Module":
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class RoleMap:
    """Each role's modules in one image-text model, by their names in the HF model (a peft wrapper's names less its
    base_model.model. prefix)."""

    model_type: str
    modules: tuple[tuple[str, str], ...]
    """(module name, role), longest name first: a parameter takes the role of the first name that prefixes it."""

    def names(self, role: str) -> tuple[str, ...]:
        """The module names of one role."""
        return tuple(n for n, r in self.modules if r == role)

    def role_of(self, name: str) -> Optional[str]:
        """The role of a parameter or module name (None: outside every role)."""
        for prefix, role in self.modules:
            if name == prefix or name.startswith(prefix + "."):
                return role
        return None

    def parameters(self, model: "nn.Module", role: str) -> list[tuple[str, "nn.Parameter"]]:
        """(name, parameter) of one role (tied weights once, under the name transformers lists first)."""
        return [(n, p) for n, p in _hf(model).named_parameters() if self.role_of(n) == role]

    def counts(self, model: "nn.Module") -> dict[str, int]:
        """Parameter elements per role (ZeRO-3 partitioned tensors counted whole)."""
        out = {r: 0 for r in ROLES}
        for n, p in _hf(model).named_parameters():
            role = self.role_of(n)
            if role is not None:
                out[role] += math.prod(tuple(getattr(p, "ds_shape", None) or p.shape))
        return out

    def exclude_regex(self, roles: Iterable[str]) -> Optional[str]:
        """A regex that re.fullmatch-es every module name inside `roles` and none outside (peft's exclude_modules):
        a role's module, less the modules of other roles nested in it (Qwen2-VL's merger inside its tower)."""
        chosen = set(roles)
        alts = []
        for name, role in self.modules:
            if role not in chosen:
                continue
            inner = [n for n, r in self.modules if r not in chosen and n.startswith(name + ".")]
            keep = "".join(f"(?!{re.escape(n[len(name):])}(?:\\.|$))" for n in inner)
            alts.append(f"{re.escape(name)}{keep}(?:\\..*)?")
        return f"(?:{'|'.join(alts)})" if alts else None


def _tower_stack(tower: "nn.Module") -> tuple[str, list["nn.Module"]]:
    """(name, blocks) of the tower's block stack: the first ModuleList holding a `_no_split_modules` class the
    tower declares (CLIP's encoder.layers, Qwen2-VL's blocks), else its first ModuleList; ("", []) without one."""
    from torch import nn

    declared = set(getattr(tower, "_no_split_modules", None) or [])
    stacks = [(n, m) for n, m in tower.named_modules() if isinstance(m, nn.ModuleList)]
    for name, stack in stacks:
        if any(type(b).__name__ in declared for b in stack):
            return name, list(stack)
    return (stacks[0][0], list(stacks[0][1])) if stacks else ("", [])


def tower_blocks(model: "nn.Module") -> list["nn.Module"]:
    """The blocks of an image-text model's image tower (its block stack, _tower_stack)."""
    return _tower_stack(_hf(model).get_encoder(modality="image"))[1]


def role_map(model: "nn.Module") -> RoleMap:
    """The RoleMap of an image-text model (UserError, one line, for a model whose parts transformers does not
    declare: a text-only model, or a tower without a findable projector)."""
    hf = _hf(model)
    config = getattr(hf, "config", None)
    kind = getattr(config, "model_type", "") or "?"
    if config is None or not image_text(config):
        raise UserError(f"{type(hf).__name__} (model type '{kind}') is a text-only model (its config has no "
                        "vision_config): it has no vision, projector or language parts")
    tower = hf.get_encoder(modality="image")
    decoder = hf.get_decoder()
    base = getattr(hf, "base_model", hf)
    where = {id(m): n for n, m in hf.named_modules()}
    if tower is hf or tower is base or id(tower) not in where:
        raise UserError(f"{type(hf).__name__}: transformers declares no image encoder for it (get_encoder"
                        "(modality='image')); zerotrain cannot tell its vision, projector and language parts apart")
    if decoder is hf or decoder is base or id(decoder) not in where:
        raise UserError(f"{type(hf).__name__}: transformers declares no language model inside it (get_decoder()); "
                        "zerotrain cannot tell its vision, projector and language parts apart")
    tower_name, decoder_name = where[id(tower)], where[id(decoder)]
    modules = [(tower_name, "vision"), (decoder_name, "language")]
    head = hf.get_output_embeddings()
    if head is not None and id(head) in where and not where[id(head)].startswith(decoder_name + "."):
        modules.append((where[id(head)], "language"))
    projector = [where[id(c)] for _, c in base.named_children()
                 if c is not tower and c is not decoder and any(True for _ in c.parameters())] if base is not hf else []
    if not projector:  # built inside the tower: what runs after its block stack
        stack = _tower_stack(tower)[0].split(".")[0]
        names = [n for n, _ in tower.named_children()]
        after = names[names.index(stack) + 1:] if stack in names else []
        projector = [f"{tower_name}.{n}" for n in after if any(True for _ in getattr(tower, n).parameters())]
    if not projector:
        raise UserError(f"{type(hf).__name__}: zerotrain finds no projector between its image encoder ({tower_name}) "
                        f"and its language model ({decoder_name})")
    modules += [(n, "projector") for n in projector]
    return RoleMap(kind, tuple(sorted(modules, key=lambda m: -len(m[0]))))


def freeze(model: "nn.Module", roles: Iterable[str]) -> dict[str, int]:
    """requires_grad off on every parameter of `roles` (before the engine is built, so DeepSpeed and FSDP2 give the
    optimizer none of them). Returns the frozen parameter elements per role."""
    roles = tuple(roles)
    rmap = role_map(model)
    for role in roles:
        for _, p in rmap.parameters(model, role):
            p.requires_grad_(False)
    counts = rmap.counts(model)
    return {r: counts[r] for r in roles}


def describe_frozen(model: "nn.Module", roles: Iterable[str]) -> str:
    """The banner's line: 'frozen: vision (model.vision_tower, 1,234 parameters), projector (...)'."""
    rmap = role_map(model)
    counts = rmap.counts(model)
    parts = [f"{r} ({', '.join(rmap.names(r))}: {counts[r]:,} parameters)" for r in roles]
    return "frozen (--freeze): " + ", ".join(parts) + "; no gradients or optimizer state for them"


@dataclass(frozen=True)
class ImageTextSize:
    """What the images of an image-text model add to one sample, for the memory estimate
    (zerotrain/memory/estimate.py): the tower's and projector's parameters and, from the model's processor run on
    one image, the image tokens in the language model's sequence and the pixel tensors."""

    vision_params: int
    """Parameter elements of the vision role (the image encoder)."""
    projector_params: int
    """Parameter elements of the projector role."""
    vision_trains: bool
    """Whether any tower parameter trains (not --freeze vision, not LoRA's language scope): only then does
    autograd keep the tower's activations."""
    tower_elements: int
    """Elements one patch leaves for backward in the whole tower: over its block stack (_tower_stack), the inputs
    and outputs of each block's Linears (q, k, v, output, the MLP's in and out: 8h + 2I with a fused qkv, as
    estimate.FORMULAS counts a text block)."""
    image_size: tuple[int, int] = (0, 0)
    """(height, width) of the image the processor was run on: its own resize target (dynamic-resolution
    processors: the largest image it keeps, max_pixels); (0, 0): no processor to ask, the figures below are 0."""
    image_tokens: int = 0
    """Image tokens one image puts in the language model's sequence."""
    tower_tokens: int = 0
    """Patches one image runs through the tower (before any merge)."""
    pixel_bytes: int = 0
    """Bytes of the floating-point tensors the processor returns for one image (pixel_values)."""

    def tower_activation_bytes(self, images: int, dtype_bytes: int) -> int:
        """What the tower keeps for backward for `images` images: patches x tower_elements; 0 when no tower
        parameter trains (autograd then keeps nothing of its forward)."""
        return images * self.tower_tokens * self.tower_elements * dtype_bytes if self.vision_trains and \
            self.tower_tokens else 0


def _probe_image(processor: Any) -> Any:
    """One RGB image at the size the image processor brings images to: its crop or fixed size; a dynamic-resolution
    processor's largest (max_pixels; Qwen2-VL-style patch processors, those with a temporal_patch_size, keep their
    pixel bounds in size's longest_edge / shortest_edge); else a square of its longest or shortest edge."""
    from PIL import Image

    images = getattr(processor, "image_processor", processor)

    def get(obj: Any, key: str) -> Any:
        return (obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)) if obj is not None else None

    size, crop = getattr(images, "size", None), getattr(images, "crop_size", None)
    pixel_bounds = getattr(images, "temporal_patch_size", None) is not None
    max_pixels = get(images, "max_pixels") or get(size, "max_pixels") or (get(size, "longest_edge") if pixel_bounds
                                                                          else None)
    if getattr(images, "do_center_crop", False) and get(crop, "height"):
        h, w = int(get(crop, "height")), int(get(crop, "width"))
    elif get(size, "height"):
        h, w = int(get(size, "height")), int(get(size, "width"))
    elif max_pixels:
        h = w = int(math.isqrt(int(max_pixels)))
    else:
        h = w = int(get(size, "longest_edge") or get(size, "shortest_edge") or 224)
    return Image.new("RGB", (w, h), (127, 127, 127))


def image_text_size(model: "nn.Module", processor: Any = None) -> ImageTextSize:
    """The ImageTextSize of a (meta-device, prepared) image-text model and its processor (None: the parameter
    rows alone)."""
    from torch import nn

    hf = _hf(model)
    rmap = role_map(hf)
    counts = rmap.counts(hf)
    blocks = _tower_stack(hf.get_encoder(modality="image"))[1]
    linears = [m for m in blocks[0].modules() if isinstance(m, nn.Linear)] if blocks else []
    per_patch = len(blocks) * sum(m.in_features + m.out_features for m in linears)
    trains = any(p.requires_grad for _, p in rmap.parameters(hf, "vision"))
    base = ImageTextSize(vision_params=counts["vision"], projector_params=counts["projector"], vision_trains=trains,
                         tower_elements=per_patch)
    if processor is None or not hasattr(processor, "image_processor"):
        return base
    image = _probe_image(processor)
    part = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    text = processor.apply_chat_template(part, tokenize=False) if getattr(processor, "chat_template", None) \
        else getattr(processor, "image_token", "<image>")
    out = processor(text=[text], images=[image], return_tensors="pt")
    config = hf.config
    image_id = getattr(config, "image_token_id", None)
    image_id = image_id if image_id is not None else getattr(config, "image_token_index", None)
    tokens = int((out["input_ids"] == image_id).sum()) if image_id is not None else 0
    pixels = out.get("pixel_values")
    patch = getattr(config.vision_config, "patch_size", 0) or 0
    if pixels is None:
        tower_tokens = 0
    elif pixels.dim() == 2:  # flattened patches (Qwen2-VL's dynamic resolution)
        tower_tokens = int(pixels.shape[0])
    else:
        tower_tokens = int(pixels.shape[-2] * pixels.shape[-1] // (patch * patch)) if patch else 0
    nbytes = sum(v.numel() * v.element_size() for v in out.values()
                 if hasattr(v, "is_floating_point") and v.is_floating_point())
    return ImageTextSize(**{**vars(base), "image_tokens": tokens, "tower_tokens": tower_tokens,
                            "pixel_bytes": nbytes, "image_size": (image.height, image.width)})
