"""`zerotrain train`: fine-tune a HuggingFace model, the same under every launcher.

    zerotrain train --output runs/demo                       # embedded tiny GPT-2 + corpus, offline
    torchrun --nproc_per_node 2 -m zerotrain train --model gpt2 --data my.jsonl --stage 3 --output runs/a
    deepspeed --hostfile hostfile.example --no_ssh --node_rank 0 --master_addr 127.0.0.1 \\
        --module zerotrain train --stage 3 --output runs/demo

Order matters: every input is validated on every rank BEFORE the process group starts (so a bad
input fails every rank at once), then the engine is built, then the trainer runs.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import warnings

from ..config.flags import add_run_flags, config_from_args
from ..distributed.preemption import Preempted
from ..errors import UserError, print_user_error


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)


def _quiet(rank: int) -> None:
    """Library chatter off (progress bars, per-rank warnings); rank 0 keeps warnings."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning() if rank == 0 else transformers.utils.logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    # DeepSpeed calls torch collectives that torch 2.13 deprecates; the user can do nothing about it.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def _timed_out(err: BaseException) -> bool:
    """Whether a failure is a collective that waited out --dist-timeout (gloo and NCCL both say 'timed out')."""
    return "timed out" in str(err).lower() or "timeout" in type(err).__name__.lower()


def _report_hang(setup, err: BaseException) -> None:
    """This rank's hang dump; rank 0 then waits for the others' dumps and names the rank(s) that diverged."""
    from ..distributed import watchdog

    cfg = setup.cfg
    path = watchdog.write_dump(setup.run_dir.root, setup.rank, f"collective timed out after {cfg.dist_timeout_s:.0f} s "
                        f"(--dist-timeout): {str(err).splitlines()[0][:300]}", None, in_collective=True)
    if setup.rank == 0:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a launcher stopping the job: this line first, then exit
        world = setup.plan.world.world_size
        wait = watchdog.BACKSTOP_S + max(0.0, min(cfg.hang_timeout_s - cfg.dist_timeout_s, 120.0))
        dumps = watchdog.wait_for_dumps(setup.run_dir.root, world, wait)
        print(watchdog.diverged_line(dumps, world, setup.run_dir.root), file=sys.stderr, flush=True)
    else:
        print(f"zerotrain: rank {setup.rank}: a collective timed out after {cfg.dist_timeout_s:.0f} s "
              f"(--dist-timeout); where it was: {path or 'not written (see the warning above)'}", file=sys.stderr,
              flush=True)


def run(args: argparse.Namespace) -> int:
    from ..distributed import process_group as dist
    from ..engine import engine_for
    from ..train.preflight import preflight
    from ..train.trainer import Trainer, format_summary

    cfg = config_from_args(args)
    from ..plan.resolve import quantizes_nothing

    try:
        unused = quantizes_nothing(cfg)
    except (UserError, ValueError):  # preflight below says what is wrong, in its own words
        unused = False
    if unused:  # before anything imports transformers' model code (seconds per rank)
        from ..model.quant import transformers_without_torchao

        transformers_without_torchao()
    _quiet(dist.env().rank)
    setup = preflight(cfg)  # no process group yet: every rank fails the same way on bad input
    if setup.rank == 0:
        plan = setup.plan
        f = plan.facts
        trainable = f" ({f.num_params - f.frozen_params:,} trainable)" if f.frozen_params else ""
        per_epoch = f"{plan.steps_per_epoch}/epoch" if plan.steps_per_epoch else "streamed: an epoch ends with the stream"
        print(f"zerotrain train: {setup.source.description}, {f.num_params:,} parameters{trainable}\n"
              f"  data {setup.data.description}\n"
              f"  {plan.total_steps} steps ({per_epoch}), global batch {plan.batch.global_batch} = "
              f"micro {plan.batch.micro_batch} x accum {plan.batch.grad_accum} x {plan.world.dp} "
              f"{'ranks' if plan.world.dp == plan.world.world_size else 'replicas'}, ZeRO stage {plan.sharding.stage}, "
              f"{plan.dtype}, lr {plan.lr:g}"
              + (f"\n  resuming from {setup.resume_from}" if setup.resume_from else ""), flush=True)
        if setup.resume_from is None and cfg.run.resume == "auto":
            print(f"zerotrain train: --resume auto: no complete checkpoint in {setup.run_dir.checkpoints}; starting "
                  "fresh" + (" (the previous attempt's outputs are replaced)" if setup.clears_previous_run else ""),
                  flush=True)
        for w in [*plan.warnings, *([setup.fault_hook] if setup.fault_hook else [])]:
            print(f"zerotrain train: warning: {w}", flush=True)
    # Every object alive now (the imported libraries' millions) is never garbage: out of the collector's sight, the
    # full collections that teardown needs (process_group.py) take ~0.05 s instead of ~0.3 s each (cProfile here).
    # Once per process: a caller that runs train twice in one process keeps the second run's garbage collectable.
    if not gc.get_freeze_count():
        gc.freeze()
    engine = engine_for(setup.plan, setup.model_factory())
    finished = False
    try:
        from ..launch.launchers import format_world_layout

        layout = format_world_layout(layout=setup.plan.world)  # a collective: every rank takes part, rank 0 prints
        if setup.rank == 0:
            print("\n".join([layout, *(f"  {line}" for line in engine.describe())]), flush=True)
        trainer = Trainer(setup, engine)
        trainer.start()
        summary = trainer.fit()
        finished = True
        from ..memory.measure import record_run_peak

        record_run_peak()  # only under `zerotrain compare` / `tune` ($ZEROTRAIN_MODEL_STATE_DIR)
    except Preempted as e:  # every rank stopped at the same step boundary
        if setup.rank == 0 or not e.saved:
            print(f"zerotrain train: {e}", file=sys.stderr, flush=True)
        finished = e.saved
        return e.exit_code
    except UserError as e:
        from ..distributed import process_group as dist
        from ..distributed.agree import is_agreed

        if is_agreed(e):  # every rank raised it together: print (once, where marked), settle while the group is up
            if not getattr(e, "zerotrain_printed", False):
                print_user_error("train", e)
            dist.barrier(timeout_s=30.0)
        raise
    except Exception as e:
        if not _timed_out(e):
            raise
        _report_hang(setup, e)  # a collective waited --dist-timeout: say where every rank was (watchdog.py)
        from ..distributed.watchdog import HANG_EXIT

        return HANG_EXIT
    finally:
        # every rank, also on error: drop process groups (no abort at exit); after an error without
        # the barrier, since the other ranks may be inside a training collective this rank never joins
        engine.close(barrier=finished)
    if setup.rank == 0:
        print(format_summary(summary, setup), flush=True)
    return 0
