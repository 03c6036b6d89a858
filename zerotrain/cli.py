"""`zerotrain` command line: config | train | estimate | compare | tune | export | launch.

    zerotrain config --stage 3 --offload-optimizer cpu --precision bf16 -o zero3.json
    deepspeed --hostfile hostfile.example --no_ssh --node_rank 0 --master_addr 127.0.0.1 \\
        --module zerotrain train --output runs/demo

Each subcommand lives in zerotrain/commands/<name>.py with `add_arguments(parser)` and
`run(args) -> int`, imported only when chosen; the run-config flags they share come from
zerotrain/config/flags.py (so no command imports this module). User errors (errors.UserError) print one line and exit 2;
so does an OSError (a full disk, a read-only file system: errors.os_error_line), never as a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from .errors import EnvironmentFault, UserError, os_error_line, print_user_error

COMMANDS = {
    "config": "print or write the DeepSpeed JSON for a run config",
    "train": "fine-tune a HuggingFace model (under deepspeed, torchrun or one process)",
    "estimate": "predict per-rank memory for every ZeRO stage and offload",
    "compare": "train one short run per stage/backend and report memory and speed",
    "tune": "pick the fastest configuration that fits (estimate + short measured trials), write it as a run config",
    "export": "turn a checkpoint into a HuggingFace model directory",
    "launch": "check a hostfile's hosts, then run the deepspeed launcher over them and name a lost host",
    "data": "data tools: `data prepare` tokenizes once into a directory every node's `train --data DIR` reads",
    "doctor": "check this machine (and a hostfile's hosts) for a run: versions, device, ops, locks, network",
}


class ExactParser(argparse.ArgumentParser):
    """Flags are matched exactly (argparse's prefix matching is off: `--sp 2` once trained as `--split 2`),
    and a flag that does not exist is refused in one line naming the closest one that does."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}
        """Subcommand parsers by name (their flags are what an unknown flag is matched against)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        flags = [a for a in extras if a.startswith("-")]
        if flags and self.commands:
            sub = self.commands.get(getattr(parsed, "command", None) or "", self)
            self.exit(2, f"{sub.prog}: error: {unknown_flag_line(flags[0], sub)}\n")
        return parsed, extras

    def error(self, message: str):  # one line, as every other refusal (no usage block)
        self.exit(2, f"{self.prog}: error: {message}\n")


def unknown_flag_line(flag: str, parser: argparse.ArgumentParser) -> str:
    """'unknown flag --sp; did you mean --seq-len?' (or the list of flags when nothing is close)."""
    import difflib

    name = flag.split("=", 1)[0]
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    bare = {o[2:]: o for o in known}  # compared without the dashes every flag shares
    close = [bare[c] for c in difflib.get_close_matches(name.lstrip("-"), list(bare), n=1, cutoff=0.6)]
    prefixed = sorted(o for o in known if o.startswith(name))  # what prefix matching would have taken
    hint = f"did you mean {close[0]}?" if close else f"see `{parser.prog} --help` for the flags"
    if prefixed and len(name) > 2:
        hint = f"flags are not abbreviated: did you mean {' or '.join(prefixed[:3])}?"
    return f"unknown flag {name}; {hint}"


def build_parser() -> argparse.ArgumentParser:
    p = ExactParser(prog="zerotrain", description="ZeRO training for HuggingFace models.")
    # The deepspeed launcher inserts --local_rank=N right after the module name, before the subcommand.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=ExactParser)
    for name, helptext in COMMANDS.items():
        sp = sub.add_parser(name, help=helptext, description=helptext)
        p.commands[name] = sp
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
    abort; see zerotrain/distributed/process_group.py). The code is unchanged: a failed run still exits non-zero.
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
        if not getattr(e, "zerotrain_printed", False):  # train prints an agreed failure before its teardown
            print_user_error(args.command, e)
            _settle(e)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except OSError as e:  # the machine's fault (a full disk, a read-only file system): one line, never a traceback
        print_user_error(args.command, EnvironmentFault(os_error_line(e, _rank(), args.command)))
        code = 2
    except SystemExit as e:
        if argv is not None or not _used_process_group():
            raise
        from .distributed.process_group import _exit_code

        code = _exit_code(e.code)
    except BaseException:
        if argv is not None or not _used_process_group():
            raise
        import traceback

        traceback.print_exc()  # what the interpreter would print, then the same exit code (1)
        code = 1
        _settle(sys.exc_info()[1])
    if argv is None and _used_process_group():
        from .distributed import process_group as dist

        dist.exit_cleanly(code)
    return code


def _settle(err: BaseException | None) -> None:
    """After a failure every rank raised together (zerotrain/distributed/agree.py) and printed: wait, bounded, for the
    others to have printed theirs too, so the launcher killing the survivors of the first exit loses no line.
    Only while the process group is up: an engine's close() tears it down, so `train` settles an agreed
    failure itself, before its engine closes (commands/train.py)."""
    from .distributed.agree import is_agreed

    if err is not None and is_agreed(err) and _used_process_group():
        from .distributed import process_group as dist

        dist.barrier(timeout_s=30.0)


def _rank() -> Optional[int]:
    """This process's rank under a launcher ($RANK), else None (one process: no rank in its lines)."""
    import os

    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None


def _used_process_group() -> bool:
    dist = sys.modules.get("zerotrain.distributed.process_group")
    return dist is not None and dist.used_process_group()
