"""LoRA through HF peft: wrap the model, name its base, write the adapter (and the merged model).

Whether a run uses LoRA, and with what settings, is its ModelPreparation's (zerotrain/model/preparation.py; a
LoraPlan here). Both engines build the base model as they always do (ZeRO-3: partitioned under
zero.Init), then call `apply_lora` (through ModelPreparation.apply) outside any zero.Init, so peft's
initialisation (A Kaiming-uniform, B zero) runs on ordinary tensors, seeded alike on every rank and in
the one-process reference; the engine then shards the adapters with the rest. Only adapter (and
`modules_to_save` head) parameters require grad, so both engines give the optimizer those alone and
checkpoint those alone.

`final/` holds the adapter as peft writes it (adapter_config.json, adapter_model.safetensors), every
tensor gathered to its full shape, plus the tokenizer; `--merge-lora` adds `final/merged/`, the base
with the adapter merged in (peft's merge_and_unload), a plain HF model.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..checkpoint.store import write_hf_dir, write_tokenizer
from ..errors import UserError

if TYPE_CHECKING:
    from ..config.preparation import LoraPlan
    from ..tasks import TaskSpec

SEED_OFFSET = 7_777
"""apply_lora seeds torch with run.seed + this before peft creates the adapters (the reference too)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MERGED_DIR = "merged"
"""Under final/ (or an export's OUT): the merged plain HF model."""


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def target_names(targets: str) -> Any:
    """peft's target_modules: the 'all-linear' shorthand, or a list of module names."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    return "all-linear" if names == ["all-linear"] else names


def check_targets(model: torch.nn.Module, targets: str) -> None:
    """Refuse module names that match no module of the model, naming the Linear-like ones that exist."""
    wanted = target_names(targets)
    if wanted == "all-linear":
        return
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    missing = [t for t in wanted if t not in leaves and not any(n == t or n.endswith("." + t)
                                                                 for n, _ in model.named_modules())]
    if missing:
        from transformers.pytorch_utils import Conv1D

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, (torch.nn.Linear, Conv1D))})
        raise UserError(f"--lora-targets {targets}: no module named {', '.join(missing)} in "
                        f"{type(model).__name__}; its linear modules are {', '.join(linear)} (or pass all-linear)")


def scope_exclude(model: torch.nn.Module, lo: "LoraPlan") -> Optional[str]:
    """peft's exclude_modules for an image-text model: a regex of the roles outside --lora-scope (language: the
    image encoder and projector) and of the roles --freeze names (zerotrain/model/vision_roles.py); None for a
    text-only model, which refuses an explicit --lora-scope (UserError, one line)."""
    from ..tasks import image_text
    from .vision_roles import ROLES, role_map

    hf = unwrapped(model)
    if getattr(hf, "config", None) is None or not image_text(hf.config):
        if lo.scope is not None:
            raise UserError(f"lora.scope={lo.scope}: {type(hf).__name__} is a text-only model (no vision_config), "
                            "its adapters go where --lora-targets says; drop --lora-scope")
        return None
    scope = ROLES if lo.scope == "all" else ("language",)
    exclude = role_map(hf).exclude_regex([r for r in ROLES if r not in scope or r in lo.frozen])
    wanted = target_names(lo.targets)
    if wanted != "all-linear" and exclude is not None:
        import re

        from transformers.pytorch_utils import Conv1D

        inside = [n for n, m in hf.named_modules() if n and not re.fullmatch(exclude, n)]
        if not any(n.rsplit(".", 1)[-1] in wanted for n in inside):
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in hf.named_modules()
                             if n in set(inside) and isinstance(m, (torch.nn.Linear, Conv1D))})
            raise UserError(f"--lora-targets {lo.targets}: no module of that name inside --lora-scope "
                            f"{lo.scope or 'language'} of {type(hf).__name__}; its linear modules there are "
                            f"{', '.join(linear)} (or pass all-linear, or --lora-scope all)")
    return exclude


def peft_config(lo: "LoraPlan", exclude: Optional[str] = None) -> Any:
    """peft's LoraConfig; exclude: a regex of the module names that get no adapter (scope_exclude)."""
    from peft import LoraConfig, TaskType

    task = getattr(TaskType, lo.peft_task_type)
    # SEQ_CLS makes peft train (and save) the fresh classifier head whole: modules_to_save.
    return LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=target_names(lo.targets),
                      exclude_modules=exclude, task_type=task)


def apply_lora(model: torch.nn.Module, lo: "LoraPlan") -> torch.nn.Module:
    """The peft model around `model` (frozen base, trainable adapters); seeded so every rank and the
    reference create the same adapters."""
    import warnings

    from peft import get_peft_model

    check_targets(model, lo.targets)
    exclude = scope_exclude(model, lo)
    if lo.gradient_checkpointing:
        # Checkpointed blocks behind frozen embeddings would get inputs without grad: no adapter grads.
        model.enable_input_require_grads()
    torch.manual_seed(lo.seed + SEED_OFFSET)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")  # GPT-2's Conv1D: peft sets it itself
        # peft probes transformers' deprecated `is_gradient_checkpointing` (a FutureWarning naming no setting of
        # the user's); zerotrain reads and sets checkpointing itself (model/source.py)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, peft_config(lo, exclude))


def base_name(model: Any) -> str:
    """Where the base weights came from (path or hub id), as peft recorded it."""
    return str(model.peft_config["default"].base_model_name_or_path or "")


@functools.cache
def base_fingerprint(name: str) -> str:
    """A hash of the base weights: sha256 of a local directory's weight files, or the hub commit."""
    p = Path(name).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file())
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
        return "sha256:" + h.hexdigest()[:16]
    try:
        from transformers import AutoConfig

        commit = getattr(AutoConfig.from_pretrained(name), "_commit_hash", None)
    except Exception:  # noqa: BLE001 - offline and not cached: the name is all there is
        commit = None
    return f"hub:{commit}" if commit else f"name:{name}"


def identity_of(base: Optional[str], lo: "LoraPlan") -> dict[str, Any]:
    """What a LoRA checkpoint records so that a resume on another base or adapter shape is refused: the
    adapter's shape and its base weights `base` (a path or hub id; the engine's peft model's base_name,
    preflight's model source before the model exists)."""
    name = str(base or "")
    out = {"base": name, "base_hash": base_fingerprint(name), "r": lo.r, "alpha": lo.alpha, "targets": lo.targets}
    if lo.scope is not None:  # image-text models: which parts hold adapters (absent: text-only, or the default)
        out["scope"] = lo.scope
    return out


def write_adapter(out: Path, model: Any, state: dict[str, torch.Tensor], tokenizer: Any = None) -> Path:
    """Rank 0: peft's adapter files from `state` (the gathered trainable parameters, full names)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    write_tokenizer(out, tokenizer)
    return out


def load_base(name: str, task: "TaskSpec", hf_config: Any) -> torch.nn.Module:
    """The base model in fp32 on the CPU, in this process (no process group, no ZeRO-3 hook)."""
    if not name:
        raise UserError("the adapter names no base model (adapter_config.json base_model_name_or_path is empty)")
    try:
        return task.model_class.from_pretrained(name, config=hf_config, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise UserError(f"the adapter's base {name} cannot be loaded ({str(e).splitlines()[0]}); "
                        "make it reachable at that path or hub id") from None


def write_merged(out: Path, adapter_dir: Path, base: torch.nn.Module, tokenizer: Any = None) -> Path:
    """The base with the adapter in adapter_dir merged in: a plain HF save_pretrained dir."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return write_hf_dir(out, merged, tokenizer=tokenizer)


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def describe(model: Any) -> str:
    """'LoRA r=8: 12,288 trainable of 1,234,567 parameters (1.00%)' (ZeRO-3 shapes counted by ds_numel)."""
    def numel(p: torch.nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += numel(p)
        trainable += numel(p) if p.requires_grad else 0
    r = model.peft_config["default"].r
    return f"LoRA r={r}: {trainable:,} trainable of {total:,} parameters ({100.0 * trainable / max(total, 1):.2f}%)"


