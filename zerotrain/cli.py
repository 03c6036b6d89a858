"""`zerotrain` command line: config | train | estimate | compare | export.

    zerotrain config --stage 3 --offload-optimizer cpu --precision bf16 -o zero3.json
    deepspeed --hostfile hostfile.example --no_ssh --node_rank 0 --master_addr 127.0.0.1 \\
        --module zerotrain train --output runs/demo

Each subcommand lives in zerotrain/commands/<name>.py with `add_arguments(parser)` and
`run(args) -> int`, imported only when chosen. User errors (errors.UserError) print one line and exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Optional

from .config import RunConfig, build_config, field_paths
from .errors import UserError
from .rules import check_config

COMMANDS = {
    "config": "print or write the DeepSpeed JSON for a run config",
    "train": "fine-tune a HuggingFace model (under deepspeed, torchrun or one process)",
    "estimate": "predict per-rank memory for every ZeRO stage and offload",
    "compare": "train one short run per stage/backend and report memory and speed",
    "export": "turn a checkpoint into a HuggingFace model directory",
    "launch": "check a hostfile's hosts, then run the deepspeed launcher over them and name a lost host",
}

# CLI flag -> dotted run-config path. Help text is the field's docstring, so it never drifts.
RUN_FLAGS: dict[str, str] = {
    "--model": "model.name",
    "--task": "model.task",
    "--model-config": "model.from_config",
    "--num-labels": "model.num_labels",
    "--gradient-checkpointing": "model.gradient_checkpointing",
    "--data": "data.path",
    "--data-config": "data.data_config",
    "--split": "data.split",
    "--text-column": "data.text_column",
    "--label-column": "data.label_column",
    "--eval-data": "data.eval_path",
    "--eval-split": "data.eval_split",
    "--seq-len": "data.seq_len",
    "--stage": "zero.stage",
    "--offload-optimizer": "zero.offload_optimizer",
    "--offload-param": "zero.offload_param",
    "--nvme-path": "zero.nvme_path",
    "--precision": "precision.dtype",
    "--micro-batch": "batch.micro_batch",
    "--grad-accum": "batch.grad_accum",
    "--global-batch": "batch.global_batch",
    "--optimizer": "optimizer.name",
    "--lr": "optimizer.lr",
    "--weight-decay": "optimizer.weight_decay",
    "--clip": "optimizer.clip",
    "--schedule": "schedule.name",
    "--warmup-steps": "schedule.warmup_steps",
    "--max-steps": "run.max_steps",
    "--epochs": "run.epochs",
    "--seed": "run.seed",
    "--output": "run.output",
    "--save-every": "run.save_every",
    "--keep-last": "run.keep_last",
    "--eval-every": "run.eval_every",
    "--log-every": "run.log_every",
    "--resume": "run.resume",
    "--overwrite": "run.overwrite",
    "--tensorboard": "run.tensorboard",
    "--backend": "backend",
    "--dist-timeout": "dist_timeout_s",
}


def _field(dotted: str):
    model_cls, info = RunConfig, None
    for part in dotted.split("."):
        info = model_cls.model_fields[part]
        model_cls = info.annotation
    return info


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The training flags shared by `config`, `train` and `compare`; all default to None (= not given)."""
    assert set(RUN_FLAGS.values()) <= set(field_paths()) | set(RunConfig.model_fields), "stale RUN_FLAGS"
    g = p.add_argument_group("run config (each also settable in the YAML --config file)")
    g.add_argument("--config", dest="config_file", metavar="RUN.yaml", help="YAML run config; flags override it")
    for flag, dotted in RUN_FLAGS.items():
        info = _field(dotted)
        dest = "cfg__" + dotted.replace(".", "__")
        helptext = f"{info.description} [{dotted}]"
        ann = str(info.annotation)
        if info.annotation is bool:
            g.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=helptext)
        elif flag == "--resume":
            g.add_argument(flag, dest=dest, nargs="?", const="latest", default=None, metavar="PATH", help=helptext)
        else:
            literal_choices = None
            if "Literal" in ann:
                literal_choices = list(_literal_args(info.annotation))
            typ = int if "int" in ann and "float" not in ann else float if "float" in ann else str
            g.add_argument(flag, dest=dest, type=typ, choices=literal_choices, default=None, help=helptext)
    g.add_argument("--ds-override", dest="ds_override", action="append", default=[], metavar="KEY=JSON",
                   help="raw DeepSpeed key merged last, e.g. zero_optimization.sub_group_size=1e8 [ds_overrides]")


def _literal_args(ann) -> tuple:
    from typing import get_args, get_origin, Literal
    if get_origin(ann) is Literal:
        return get_args(ann)
    for a in get_args(ann):
        if get_origin(a) is Literal:
            return get_args(a)
    return ()


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig from --config YAML plus the flags that were given."""
    overrides: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            overrides[key[5:].replace("__", ".")] = value
    cfg = build_config(getattr(args, "config_file", None), overrides)
    for item in getattr(args, "ds_override", []) or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"--ds-override {item!r}: expected KEY=JSON, e.g. zero_optimization.sub_group_size=1e8")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        tree = cfg.ds_overrides
        *parents, leaf = key.split(".")
        for k in parents:
            tree = tree.setdefault(k, {})
        tree[leaf] = value
    if cfg.ds_overrides:
        check_config(cfg)
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerotrain", description="ZeRO training for HuggingFace models.")
    # The deepspeed launcher inserts --local_rank=N right after the module name, before the subcommand.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, helptext in COMMANDS.items():
        sp = sub.add_parser(name, help=helptext, description=helptext)
        sp.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
        _command(name).add_arguments(sp)
    return p


def _command(name: str):
    return importlib.import_module(f"zerotrain.commands.{name}")


def main(argv: Optional[list[str]] = None) -> int:
    """Run one subcommand; return its exit code.

    As a program (argv None: `python -m zerotrain`, the `zerotrain` script, the launchers), a
    process that created a process group does not return: it ends through
    dist.exit_cleanly(code) after the engine's close(), so gloo's still-running threads never
    meet C++ static destructors at exit (the "terminate called without an active exception"
    abort; see zerotrain/dist.py). The code is unchanged: a failed run still exits non-zero.
    Called with an argv list (in-process, e.g. tests) it always returns.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        code = int(_command(args.command).run(args) or 0)
    except UserError as e:  # one line, no traceback; any other exception keeps its traceback
        print(f"zerotrain {args.command}: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:
        if argv is not None or not _used_process_group():
            raise
        from .dist import _exit_code

        code = _exit_code(e.code)
    except BaseException:
        if argv is not None or not _used_process_group():
            raise
        import traceback

        traceback.print_exc()  # what the interpreter would print, then the same exit code (1)
        code = 1
    if argv is None and _used_process_group():
        from . import dist

        dist.exit_cleanly(code)
    return code


def _used_process_group() -> bool:
    dist = sys.modules.get("zerotrain.dist")
    return dist is not None and dist.used_process_group()
