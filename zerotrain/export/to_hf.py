"""A complete checkpoint of any engine -> a HF save_pretrained directory (or a LoRA adapter), in one process,
through the exporter the engine table names for its checkpoint format (zerotrain/plan/registry.py)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def export_checkpoint(ckpt_dir: Path, out_dir: str | Path, merge_lora: bool = False) -> Path:
    """A complete checkpoint dir of either backend -> a HF save_pretrained dir, in one process.
    A LoRA checkpoint gives peft's adapter files (+ OUT/merged, the merged model, with merge_lora)."""
    from ..checkpoint import store as ck

    meta = ck.read_meta(ckpt_dir)
    if "lora" in meta.extra:
        from .lora import export_adapter

        return export_adapter(Path(ckpt_dir), Path(out_dir), merge_lora)
    if merge_lora:
        raise UserError(f"export --merge-lora: {ckpt_dir} is a full fine-tuning checkpoint (no LoRA adapter); "
                        "drop --merge-lora")
    from ..plan.registry import exporter

    return exporter(meta.format, ckpt_dir)(ckpt_dir, out_dir)
