"""DeepSpeed checkpoints read back offline, in one process and without a process group: the fp32 weights of a
ZeRO (or AutoTP) checkpoint, a LoRA checkpoint's adapters, DeepSpeed's universal conversion and the exporter of
the deepspeed format to a HF directory. plan/registry.py names the exporter and the adapter reader; `zerotrain
export` (zerotrain/export/to_hf.py) calls them. deepspeed/engine.py writes these checkpoints, and its resume on
another world size or stage converts through convert_to_universal here. (The deepspeed-pipe format's exporter
stays in deepspeed/pipeline.py: it rebuilds the pipeline's layers, and that module imports the engine.)
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...checkpoint import store as ck
from ...errors import UserError
from ..checkpointing import read_file, vet_files
from .expert_parallel import checkpoint_state as autoep_checkpoint_state
from .expert_parallel import is_autoep_checkpoint


def read_adapter(ckpt_dir: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of a DeepSpeed LoRA checkpoint (the registry's adapter reader; the
    checkpoint holds the adapters alone, so `model` is not needed to find them)."""
    return load_full_state_dict(ckpt_dir, trainable_only=True)


def load_full_state_dict(ckpt_dir: str | Path, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """fp32 weights of a DeepSpeed checkpoint, in one process, whatever world size wrote it
    (trainable_only: a LoRA checkpoint, which holds the adapters alone)."""
    path = Path(ckpt_dir)
    meta = ck.read_meta(path)
    if meta.format != "deepspeed":
        raise UserError(f"{path}: a {meta.backend} checkpoint, not a DeepSpeed one")
    vet_files(path)  # DeepSpeed's readers below unpickle as they are (backends/checkpointing.py)
    if meta.extra.get("tp", 1) > 1:
        return _merged_tensor_parallel_state(path)
    if not trainable_only and is_autoep_checkpoint(path):  # --ep: experts in per-expert files, HF layout rebuilt
        return autoep_checkpoint_state(path)
    if meta.zero_stage == 0:  # no ZeRO files: the full module is in the model-states file
        states = read_file(path / "mp_rank_00_model_states.pt")
        return {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # Merges every rank's fp32 master partition (bf16 runs included: master weights are fp32).
    return dict(get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name,
                                                         exclude_frozen_parameters=trainable_only))


def _merged_tensor_parallel_state(path: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of an AutoTP checkpoint: DeepSpeed's universal conversion merges each parameter's
    tensor-parallel slices (by the split schema AutoTP records in the checkpoint) into one fp32 file."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as work:
        out = Path(work) / path.name
        convert_to_universal(path, out)
        return {d.name: read_file(d / "fp32.pt")["param"]
                for d in sorted((out / "zero").iterdir()) if (d / "fp32.pt").is_file()}


def convert_to_universal(src: str | Path, dst: str | Path) -> None:
    """DeepSpeed's ds_to_universal in this process (one worker each: no fork of a process holding gloo)."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    # inject_missing_state: stage 1/2 checkpoints of a plain (non-Megatron) model carry no
    # universal_checkpoint_info; the converter fills it in (what HF/Accelerate checkpoints need too).
    ds_to_universal(argparse.Namespace(input_folder=str(src), output_folder=str(dst), num_extract_workers=1,
                                       num_merge_workers=1, keep_temp_folder=False, strict=True,
                                       inject_missing_state=True))


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """DeepSpeed checkpoint -> HF save_pretrained dir (fp32 safetensors, + tokenizer if saved with it)."""
    import transformers

    path, out = Path(ckpt_dir), Path(out_dir)
    meta = ck.read_meta(path)
    state = load_full_state_dict(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json in the checkpoint (written by zerotrain for HF models only); "
                        "only HF models can be exported")
    hf = transformers.AutoConfig.from_pretrained(str(path))
    cls = getattr(transformers, meta.model_class, None)
    if cls is None and getattr(hf, "architectures", None):
        cls = getattr(transformers, hf.architectures[0], None)
    if cls is None:
        raise UserError(f"{path}: model class {meta.model_class} is not a transformers class; cannot export to HF")
    model = cls(hf)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") or "decoder" in k}  # tied to embeddings
    if set(missing) - tied or unexpected:
        raise UserError(f"{path}: weights do not fit {meta.model_class} (missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}); the checkpoint is damaged or of another model")
    model.tie_weights()
    return ck.write_hf_dir(out, model, tokenizer=path)
