"""The parts of an image-text model by role: vision (the image encoder), projector (what maps image features into
the language model), language (the decoder and its head), found from what transformers declares about the
model, so --freeze and --lora-scope mean the same on every family.

    roles = role_map(hf_model)              # RoleMap: role -> module names, each parameter's role
    freeze(model, ("vision", "projector"))  # ModelPreparation.apply / for_sizing, before the engine is built
    roles.exclude_regex(("vision", "projector"))   # peft's exclude_modules (zerotrain/model/lora.py)

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

if TYPE_CHECKING:
    from torch import nn

ROLES = IMAGE_TEXT_ROLES
"""vision, projector, language: what --freeze names (zerotrain/config/schema.py types the setting)."""


def parse_roles(text: str) -> tuple[str, ...]:
    """The roles of a --freeze value ('vision,projector'), in ROLES order; the rules layer refused unknown ones."""
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    return tuple(r for r in ROLES if r in names)


def is_image_text(hf_config: Any) -> bool:
    """Whether a HF config describes an image-text model: it carries a vision_config (LLaVA, Qwen2-VL, Gemma 3,
    SmolVLM, Llama 3.2 Vision, ...)."""
    return getattr(hf_config, "vision_config", None) is not None


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


def _block_stack(tower: "nn.Module") -> Optional[str]:
    """The name of the tower's child that holds its repeated blocks (a ModuleList of a `_no_split_modules` class
    the tower declares), or None."""
    from torch import nn

    declared = set(getattr(tower, "_no_split_modules", None) or [])
    for name, child in tower.named_children():
        if isinstance(child, nn.ModuleList) and any(type(b).__name__ in declared for b in child):
            return name
    return None


def role_map(model: "nn.Module") -> RoleMap:
    """The RoleMap of an image-text model (UserError, one line, for a model whose parts transformers does not
    declare: a text-only model, or a tower without a findable projector)."""
    hf = _hf(model)
    config = getattr(hf, "config", None)
    kind = getattr(config, "model_type", "") or "?"
    if not is_image_text(config):
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
        stack = _block_stack(tower)
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
