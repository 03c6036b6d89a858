"""`zerotrain export CKPT_DIR OUT_DIR`: a checkpoint of either backend -> a HF model directory.

    zerotrain export runs/demo/checkpoints out/hf          # the run's latest complete checkpoint
    zerotrain export runs/demo/checkpoints/global_step200 out/hf

Runs in one process, whatever world size and ZeRO stage wrote the checkpoint: DeepSpeed
checkpoints go through deepspeed.utils.zero_to_fp32, FSDP ones through torch.distributed.checkpoint
without a process group. Writes fp32 safetensors, config.json and the tokenizer if it was saved.
A LoRA checkpoint gives the adapter (adapter_config.json, adapter_model.safetensors), and with
--merge-lora also OUT_DIR/merged, the base with the adapter merged in.
"""
from __future__ import annotations

import argparse

from ..errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_dir", metavar="CKPT_DIR",
                   help="a checkpoint dir (global_stepN), a checkpoints/ root (its latest), or a run output dir")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF model (save_pretrained layout)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA checkpoint: also write OUT_DIR/merged, the base with the adapter merged in")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .. import checkpoint as ck
    from ..engine import export_checkpoint

    src = Path(args.ckpt_dir)
    if not src.exists():
        raise UserError(f"export: {src} does not exist; pass a checkpoint dir or a run's checkpoints/ dir")
    path = ck.resolve_checkpoint(src)
    meta = ck.read_meta(path)
    out = export_checkpoint(path, args.out_dir, merge_lora=args.merge_lora)
    print(f"exported {path} ({meta.backend}, ZeRO stage {meta.zero_stage}, {meta.world_size} ranks, "
          f"step {meta.global_step}) -> {out}", flush=True)
    return 0
