"""`zerotrain config`: the DeepSpeed JSON for a run config, resolved (or HF-"auto") and validated.

    zerotrain config --stage 3 --offload-optimizer cpu --offload-param cpu --precision bf16 \
        --micro-batch 4 --grad-accum 2 -o zero3_offload.json
    zerotrain config --all ds_configs        # regenerate the shipped presets
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config.flags import add_run_flags, config_from_args
from ..errors import ConfigError
from ..plan.ds_config import build_ds_config, schedule_note
from ..plan.presets import dumps, write_presets
from ..plan.run_plan import degrees


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)
    p.add_argument("-o", "--out", metavar="FILE", help="write the JSON here instead of printing it")
    p.add_argument("--hf-auto", action="store_true",
                   help='the HF Trainer / Accelerate flavour: "auto" where they fill values from their own args')
    p.add_argument("--world-size", type=int, default=None,
                   help="also write train_batch_size (and derive grad-accum from --global-batch) for N ranks")
    p.add_argument("--all", metavar="DIR", help="write every shipped preset (resolved and hf/) into DIR")


def run(args: argparse.Namespace) -> int:
    if args.all:
        for path in write_presets(args.all):
            print(path)
        return 0
    cfg = config_from_args(args)
    facts = None
    if cfg.model.name or cfg.model.from_config:
        from ..model.source import model_facts_for  # imports torch/transformers: only when sizing from a model
        facts = model_facts_for(cfg)
    elif degrees(cfg).ep > 1:  # the AutoEP section names the model's preset (plan/ds_config.py)
        raise ConfigError(f"--ep {degrees(cfg).ep}: DeepSpeed's expert_parallel section needs the model's type; "
                          "pass --model or --model-config")
    from ..plan.resolve import asked

    total_steps = asked(cfg).max_steps
    ds = build_ds_config(cfg, world_size=args.world_size, model_facts=facts, hf_auto=args.hf_auto,
                         total_steps=total_steps)
    note = schedule_note(cfg, total_steps, args.hf_auto)
    if note:
        print(f"zerotrain config: note: {note}", file=sys.stderr)
    text = dumps(ds)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
