"""FSDP checkpoints (torch.distributed.checkpoint directories, written by fsdp/engine.py and fsdp/pipeline.py,
keyed by HF parameter names) read back offline, in one process, whatever world size and stage wrote them: the
whole HF model, a LoRA checkpoint's adapters, and the exporter to a HF directory. plan/registry.py names the
exporter and the adapter reader; `zerotrain export` (zerotrain/export/to_hf.py) calls them.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ...checkpoint import store as ck
from ...errors import UserError
from ..checkpointing import vet_files


def load_full_model(ckpt_dir: str | Path) -> nn.Module:
    """The HF model of an FSDP checkpoint, in one process, whatever world size and stage wrote it.

    Builds the class named in the checkpoint's config.json and lets DCP read every shard into it
    (no process group needed). Used by `zerotrain export`.
    """
    import transformers

    path = Path(ckpt_dir)
    meta = ck.read_meta(path)
    if meta.format != "dcp":
        raise UserError(f"{path}: a {meta.backend} checkpoint, not an FSDP (dcp) one")
    vet_files(path)  # DCP reads its .metadata with pickle.load (backends/checkpointing.py)
    hf = transformers.AutoConfig.from_pretrained(str(path))
    archs = getattr(hf, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise UserError(f"{path}/config.json names no known transformers model class (architectures={archs}); "
                        "the checkpoint needs the config.json zerotrain writes into it")
    model = cls(hf)
    sd = model.state_dict()  # tensors share storage with the parameters: DCP loads in place
    dcp.load({"model": sd}, checkpoint_id=str(path / ck.DCP_SUBDIR), no_dist=not dist.is_initialized())
    model.tie_weights()
    return model


def load_trainable(ckpt_dir: str | Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (a LoRA checkpoint's adapters) of an FSDP checkpoint, read by DCP into
    `model`'s own tensors (the peft model the checkpoint was trained as, built on the CPU)."""
    vet_files(Path(ckpt_dir))
    sd = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    dcp.load({"model": sd}, checkpoint_id=str(Path(ckpt_dir) / ck.DCP_SUBDIR), no_dist=not dist.is_initialized())
    return sd


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """FSDP checkpoint -> HF save_pretrained dir (safetensors, + tokenizer if the checkpoint has one)."""
    path = Path(ckpt_dir)
    return ck.write_hf_dir(Path(out_dir), load_full_model(path), tokenizer=path)
