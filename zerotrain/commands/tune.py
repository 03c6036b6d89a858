"""`zerotrain tune`: pick the fastest configuration that fits, from the estimate and short measured trials,
and write it as a run config.

    zerotrain tune --model path/to/model --data train.jsonl --nproc 2 --seq-len 512 --global-batch 16 -o tuned/
    zerotrain tune --model-config small-llama --memory-per-rank 24GiB --budget-s 900 --backends deepspeed,fsdp -o tuned/
    torchrun --nproc_per_node 2 -m zerotrain train --config tuned/run.yaml      # run the winner as is
    zerotrain tune --replay tuned/trials.json --memory-per-rank 900MiB -o tuned2/  # decide again, run nothing

1. Search space: backend x ZeRO stage x offload (only where a GPU exists: on a CPU-only machine the "device" is
   host RAM, so offload moves nothing and is not ranked) x micro-batch (grad-accum follows from --global-batch)
   x gradient checkpointing x tp/pp/sp/ep (the rules refuse what a model or backend cannot split, with the reason)
   x the long-sequence memory reducers (sp and the reducers searched from --seq-len 4096 on; ep for a mixture of
   experts); --task grpo adds the rollout engine (batched, exact), the batched engine's rows per generate call and
   the generation gather (phase, forward: only where the weights are sharded), keeps tp/pp/sp/ep at 1 (grpo runs
   data parallel) and ranks trials by completions/s (its step is mostly generation), not tokens/s;
   LoRA when --lora-r is given. Every candidate is the run plan `zerotrain train` builds (zerotrain/plan/run_plan.py).
2. Prune: the estimator's per-rank peak (zerotrain/memory/estimate.py) against --memory-per-rank less --safety-margin
   (default: GPU memory, else the host RAM available now / --nproc).
3. Trials: the cheapest-looking candidates first (zerotrain/search/tune_decisions.py prior_cost), each a real `zerotrain train`
   on --nproc local ranks (zerotrain/search/trials.py), warm-up steps excluded, within --budget-s and --max-trials;
   --repeats R runs every trial R times in interleaved rounds. A trial that fails, runs out of memory or hangs
   (--trial-timeout) is recorded as infeasible with its first error line and the search goes on.
4. Writes OUT/run.yaml (model and data included), OUT/ds_config.json (a DeepSpeed winner), OUT/report.md,
   report.csv, report.png (tokens/s against memory per rank, the winner and the limit marked) and OUT/trials.json
   (everything measured: `--replay` decides again from it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..checkpoint.run_dir import RunDir
from ..config.flags import add_run_flags, config_from_args
from ..errors import UserError
from ..plan.capabilities import BACKENDS
from ..plan.parallel_rules import resolve_batch
from ..plan.resolve import asked
from ..search.tune_report import write_reports
from ..tasks import task_spec
from ..util import human_bytes

OWN = ("zero.stage", "zero.offload_optimizer", "zero.offload_param", "backend", "batch.micro_batch",
       "batch.grad_accum", "model.gradient_checkpointing", "parallel.tp", "parallel.pp", "parallel.sp", "parallel.ep",
       "model.tiled_mlp", "model.chunked_loss", "run.output", "rl.rollout_engine", "rl.rollout_rows",
       "rl.generation_gather")
"""Run-config keys the search sets per candidate (or tune sets itself): not run flags here."""

TRIAL_OVERRIDES_ENV = "ZEROTRAIN_TUNE_TRIAL_OVERRIDES"
"""Test hook: JSON {candidate name: {dotted run-config key: value}} written into that trial's YAML only (after
planning), e.g. an impossible micro-batch, so a test can make one trial crash for real. Checked at tune's start
(trial_overrides: JSON of that shape, keys of the config schema, candidates of this search) and named in the
banner; the values are not validated (the trial itself must meet them)."""


def trial_overrides(environ: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """$ZEROTRAIN_TUNE_TRIAL_OVERRIDES parsed, its keys checked against the run-config schema; {} when unset.
    A malformed value is one UserError line naming the variable."""
    import difflib

    from ..config.schema import field_paths

    raw = (os.environ if environ is None else environ).get(TRIAL_OVERRIDES_ENV, "").strip()
    if not raw:
        return {}
    unset = f"it is a test hook: unset it (`unset {TRIAL_OVERRIDES_ENV}`) for a real search"
    try:
        tree = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"${TRIAL_OVERRIDES_ENV}: not valid JSON ({e.msg} at character {e.pos}); {unset}") from None
    if not isinstance(tree, dict) or not all(isinstance(v, dict) for v in tree.values()):
        raise UserError(f"${TRIAL_OVERRIDES_ENV}: expected a JSON object "
                        f"{{\"CANDIDATE\": {{\"section.key\": value}}}}; {unset}")
    known = field_paths()
    for name, keys in tree.items():
        for k in keys:
            if k not in known:
                close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
                raise UserError(f"${TRIAL_OVERRIDES_ENV}: candidate {name!r}: unknown config key {k!r}"
                                + (f" (did you mean {close[0]!r}?)" if close else "") + f"; {unset}")
    return tree


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="directory for run.yaml, ds_config.json, report.*, trials/")
    p.add_argument("--nproc", type=int, default=None, help="ranks per trial (this machine's GPUs, else 2)")
    p.add_argument("--memory-per-rank", default=None, metavar="SIZE",
                   help="memory one rank may use, bytes or e.g. 24GiB (default: GPU memory, else host RAM "
                        "available / --nproc)")
    p.add_argument("--safety-margin", type=float, default=0.10,
                   help="fraction of --memory-per-rank kept free when pruning by the prediction (default 0.10)")
    p.add_argument("--budget-s", type=float, default=900.0, help="seconds of trials at most (default 900)")
    p.add_argument("--max-trials", type=int, default=8, help="candidates measured at most (default 8)")
    p.add_argument("--backends", default=None, help=f"comma list of {','.join(BACKENDS)} (default: both where "
                                                    "DeepSpeed imports, else fsdp)")
    p.add_argument("--stages", default="0,1,2,3", help="comma list of ZeRO stages (default 0,1,2,3)")
    p.add_argument("--micro-batches", default="auto",
                   help="comma list, or auto: powers of two dividing the global batch per replica")
    p.add_argument("--checkpointing", choices=("auto", "off", "on"), default="auto",
                   help="gradient checkpointing: auto tries both")
    p.add_argument("--offload", choices=("auto", "off", "on"), default="auto",
                   help="CPU offload candidates: auto = where a GPU exists (on CPU ranks offload moves nothing)")
    p.add_argument("--tp", default="auto", help="comma list of tensor-parallel degrees (auto: 1 and every divisor "
                                                "of --nproc up to 8)")
    p.add_argument("--pp", default="auto", help="comma list of pipeline degrees (auto: as --tp)")
    p.add_argument("--sp", default="auto", help="comma list of sequence-parallel degrees (auto: as --tp from "
                                                "--seq-len 4096 on, else 1)")
    p.add_argument("--ep", default="auto", help="comma list of expert-parallel degrees (auto: for a mixture of "
                                                "experts 1 and every divisor of --nproc up to 8 that divides its "
                                                "experts, else 1)")
    p.add_argument("--reducers", choices=("auto", "off", "on"), default="auto",
                   help="the tiled MLP (2048 tokens; the fused loss chunks the logits anyway): auto tries it from --seq-len 4096 on")
    p.add_argument("--rollout-engines", default="auto", help="--task grpo: comma list of batched, exact (auto: both)")
    p.add_argument("--rollout-rows", default="auto",
                   help="--task grpo, batched engine: comma list of rows per generate call, 0 = a rank's whole "
                        "generation batch (auto: 0 and half of it in whole groups)")
    p.add_argument("--generation-gathers", default="auto",
                   help="--task grpo, where the weights are sharded: comma list of phase, forward (auto: both)")
    p.add_argument("--trial-steps", type=int, default=6, help="optimizer steps per trial (default 6)")
    p.add_argument("--trial-warmup", type=int, default=2,
                   help="first steps of a trial left out of its speed (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every trial, interleaved (median speed)")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds before a trial is killed")
    p.add_argument("--tie-pct", type=float, default=3.0,
                   help="speeds (tokens/s; grpo: completions/s) within this %% of the best tie, decided by less memory "
                        "(default 3)")
    p.add_argument("--run-output", default="runs/tuned", help="run.output written into run.yaml")
    p.add_argument("--tiny-preset", default="small-gpt2", help="architecture of the embedded model when no --model")
    p.add_argument("--replay", metavar="TRIALS.json", default=None,
                   help="decide again from a tune's trials.json (e.g. with another --memory-per-rank); runs nothing")
    add_run_flags(p, skip=OWN)


# --- inputs ----------------------------------------------------------------------------------------

def _ints(value: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{flag} {value!r}: expected a comma list of integers") from None
    if not out or min(out) < 1 and flag != "--stages":
        raise UserError(f"{flag} {value!r}: expected a comma list of integers >= 1")
    return out


def _choices(value: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    if not out or any(v not in allowed for v in out):
        raise UserError(f"{flag} {value!r}: use auto or a comma list of {', '.join(allowed)}")
    return out


def _grpo_axes(args: argparse.Namespace, num_generations: int) -> dict[str, Any]:
    """--task grpo's axes of the Space: rollout engines, rows per call, generation gathers."""
    rows = None
    if args.rollout_rows != "auto":
        parts = [v.strip() for v in args.rollout_rows.split(",") if v.strip()]
        if not parts or not all(v.isdigit() for v in parts):
            raise UserError(f"--rollout-rows {args.rollout_rows!r}: use auto or a comma list of integers >= 0 "
                            "(0: a rank's whole generation batch per call)")
        rows = tuple(dict.fromkeys(int(v) for v in parts))
    return {"rollout_engines": ("batched", "exact") if args.rollout_engines == "auto" else
            _choices(args.rollout_engines, "--rollout-engines", ("batched", "exact")),
            "rollout_rows": rows, "num_generations": num_generations,
            "gathers": ("phase", "forward") if args.generation_gathers == "auto" else
            _choices(args.generation_gathers, "--generation-gathers", ("phase", "forward"))}


def _space(args: argparse.Namespace, nproc: int, on_gpu: bool, seq_len: int, num_experts: int = 0,
           num_generations: int = 0) -> Any:
    """The search's axes from the flags; num_generations > 0 (--task grpo) adds the rollout axes and keeps the
    model-parallel degrees at 1 under auto (grpo runs data parallel: the rules refuse them)."""
    from ..plan.resolve import deepspeed_importable
    from ..search.tune_decisions import LONG_SEQUENCE, Space, divisors

    if args.backends is None:
        backends = BACKENDS if deepspeed_importable()[0] else ("fsdp",)
    else:
        backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
        if not backends or any(b not in BACKENDS for b in backends):
            raise UserError(f"--backends {args.backends!r}: use a comma list of {', '.join(BACKENDS)}")
    stages = _ints(args.stages, "--stages")
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise UserError(f"--stages {args.stages!r}: ZeRO stages are 0, 1, 2, 3")
    grpo = num_generations > 0
    pinned = [f for f in ("rollout_engines", "rollout_rows", "generation_gathers") if getattr(args, f) != "auto"]
    if pinned and not grpo:
        raise UserError(f"--{pinned[0].replace('_', '-')} {getattr(args, pinned[0])}: a rollout axis of --task grpo; "
                        "drop it, or pass --task grpo")
    auto_degrees = (1,) if grpo else tuple(d for d in divisors(nproc) if d <= 8)
    long = seq_len >= LONG_SEQUENCE and not grpo
    return Space(backends=backends, stages=stages,
                 offload=(args.offload == "on") or (args.offload == "auto" and on_gpu),
                 micro_batches=None if args.micro_batches == "auto" else _ints(args.micro_batches, "--micro-batches"),
                 checkpointing={"auto": (False, True), "off": (False,), "on": (True,)}[args.checkpointing],
                 tps=auto_degrees if args.tp == "auto" else _ints(args.tp, "--tp"),
                 pps=auto_degrees if args.pp == "auto" else _ints(args.pp, "--pp"),
                 sps=(auto_degrees if long else (1,)) if args.sp == "auto" else _ints(args.sp, "--sp"),
                 reducers={"auto": (False, True) if long else (False,), "off": (False,), "on": (True,)}[args.reducers],
                 eps=tuple(d for d in auto_degrees if num_experts and num_experts % d == 0) or (1,)
                 if args.ep == "auto" else _ints(args.ep, "--ep"),
                 **(_grpo_axes(args, num_generations) if grpo else {}))


def _base_config(args: argparse.Namespace, nproc: int) -> tuple[Any, str]:
    """The user's run config (flags <- --config YAML), the embedded model when none is named, a global batch
    always set (grad-accum follows each candidate's micro-batch); and a note when tune chose the batch."""
    cfg = config_from_args(args)
    note = ""
    if cfg.model.name is None and cfg.model.from_config is None:
        from ..assets.demo import ensure_tiny_model

        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"name": str(ensure_tiny_model(args.tiny_preset))})})
    request = asked(cfg)
    if request.global_batch is None:
        gb = resolve_batch(cfg, nproc)[2]  # micro-batch x grad-accum x the ranks (plan/parallel_rules.py)
        note = f"no --global-batch: {gb} (micro-batch {request.micro_batch} x grad-accum {request.grad_accum} x " \
               f"{nproc} ranks)"
        cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"global_batch": gb})})
    return cfg, note


def _limit(args: argparse.Namespace, nproc: int, on_gpu: bool) -> tuple[int, str]:
    """(memory per rank, where the figure came from)."""
    from ..search.tune_decisions import parse_size

    if args.memory_per_rank is not None:
        return parse_size(args.memory_per_rank), "--memory-per-rank"
    if on_gpu:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory), "GPU 0's memory"
    avail = _mem_available()
    return avail // nproc, f"host RAM available now ({human_bytes(avail)}) / {nproc} ranks"


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- the command -----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    if args.replay:
        return _replay(args)
    from ..model.source import model_facts_for
    from ..plan.resolve import run_device
    from ..search.tune_decisions import predict, prune, search_space, trial_order

    device = run_device()
    on_gpu = device == "cuda"
    nproc = args.nproc or (_gpu_count() if on_gpu else 2)
    for name, low in (("max_trials", 1), ("trial_steps", 1), ("repeats", 1)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(args, name)})")
    if args.trial_warmup < 0 or args.trial_warmup >= args.trial_steps:
        raise UserError(f"--trial-warmup {args.trial_warmup}: must be >= 0 and below --trial-steps "
                        f"{args.trial_steps} (some steps must be timed)")
    if not 0.0 <= args.safety_margin < 1.0:
        raise UserError(f"--safety-margin {args.safety_margin}: must be in [0, 1)")
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1 (got {nproc})")
    forced = trial_overrides()  # a malformed test hook is refused before any work
    cfg, batch_note = _base_config(args, nproc)
    limit, limit_source = _limit(args, nproc, on_gpu)
    facts = model_facts_for(cfg)
    space = _space(args, nproc, on_gpu, cfg.data.seq_len, facts.num_experts,
                   cfg.rl.num_generations if task_spec(cfg.model.task).online_rl is not None else 0)

    plans: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for c in dict.fromkeys(search_space(asked(cfg).global_batch, nproc, space)):  # a value listed twice runs once
        row, plan = predict(c, cfg, nproc, facts, device)
        rows.append(row)
        if plan is not None:
            plans[row["name"]] = plan
    unknown = sorted(set(forced) - {r["name"] for r in rows})
    if unknown:
        raise UserError(f"${TRIAL_OVERRIDES_ENV}: {', '.join(unknown)} is not a candidate of this search (candidates: "
                        f"{', '.join(r['name'] for r in rows[:6])}{', ...' if len(rows) > 6 else ''}); unset it "
                        f"(`unset {TRIAL_OVERRIDES_ENV}`): it is a test hook")
    prune(rows, limit, args.safety_margin)
    order = trial_order(rows)
    ctx = _context(args, cfg, facts, nproc, device, limit, limit_source, space, batch_note)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not order:
        from ..model.preparation import ModelPreparation
        from ..search.tune_decisions import no_fit_message

        write_reports(out_dir, rows, ctx, None)
        raise UserError(no_fit_message(rows, limit, args.safety_margin, nproc,
                                       lora=ModelPreparation.from_config(cfg).uses_lora,
                                       offload_searched=space.offload, on_gpu=on_gpu))
    chosen = order[:args.max_trials]
    _banner(rows, chosen, ctx, space, on_gpu)
    if forced:
        print(f"zerotrain tune: warning: ${TRIAL_OVERRIDES_ENV} is set: a test hook writes "
              + "; ".join(f"{', '.join(f'{k}={v!r}' for k, v in keys.items())} into trial {name}"
                          for name, keys in forced.items())
              + " (unset it unless this is a test)", flush=True)
    for r in order[args.max_trials:]:
        r.update(status="not-run", reason=f"not run: beyond --max-trials {args.max_trials} (prior rank "
                                          f"{r['prior_rank']})")
    _run_trials(chosen, plans, args, nproc, out_dir, on_gpu, limit, ctx["rank_by"])
    return _decide_and_write(rows, plans, ctx, out_dir)


def _banner(rows: list[dict], chosen: list[dict], ctx: dict, space: Any, on_gpu: bool) -> None:
    """What the search is about to do, before the first trial."""
    count = {k: sum(r["status"] == k for r in rows) for k in ("refused", "pruned")}
    print(f"zerotrain tune: {ctx['model']}: {ctx['num_params']:,} parameters, {ctx['nproc']} ranks, global batch "
          f"{ctx['global_batch']}, seq-len {ctx['seq_len']}\n  memory per rank {human_bytes(ctx['limit'])} "
          f"({ctx['limit_source']}), pruning above {human_bytes(int(ctx['limit'] * (1 - ctx['safety_margin'])))}"
          f"\n  {len(rows)} candidates: {count['refused']} refused by the rules, {count['pruned']} predicted not to "
          f"fit; measuring {len(chosen)} (--max-trials {ctx['max_trials']}, --budget-s {ctx['budget_s']:g})"
          + (f"\n  ranked by {ctx['rank_by'].replace('samples_per_s', 'completions/s')}: {ctx['rl_note'] or 'grpo'}"
             if ctx["rank_by"] != "tokens_per_s" else "")
          + ("" if space.offload or on_gpu else "\n  offload not searched: on CPU ranks the device is host RAM, "
                                                 "so offloading moves nothing off it"), flush=True)


GRPO_NOTE = ("tp, pp, sp and ep are kept at 1 for --task grpo: it runs data parallel (ZeRO 0-3 / FSDP2, LoRA) "
             "and the rules refuse the others.")
"""The report's and banner's line on grpo's model-parallel degrees (auto)."""


def _gpu_count() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def _context(args, cfg, facts, nproc: int, device: str, limit: int, limit_source: str, space, batch_note: str) -> dict:
    """Everything the report says about the search besides its rows (saved in trials.json)."""
    from ..config.load import to_yaml
    from ..model.preparation import ModelPreparation
    from ..search.tune_decisions import measure_of

    grpo = space.num_generations > 0
    return {"model": cfg.model.name or cfg.model.from_config, "num_params": facts.num_params,
            "trainable_params": facts.num_params - facts.frozen_params, "model_type": facts.model_type,
            "nproc": nproc, "device": device, "precision": asked(cfg).dtype, "seq_len": cfg.data.seq_len,
            "global_batch": asked(cfg).global_batch, "lora_r": ModelPreparation.from_config(cfg).lora_rank,
            "limit": limit, "limit_source": limit_source,
            "safety_margin": args.safety_margin, "budget_s": args.budget_s, "max_trials": args.max_trials,
            "trial_steps": args.trial_steps, "warmup_steps": args.trial_warmup, "repeats": args.repeats,
            "tie_pct": args.tie_pct, "run_output": args.run_output, "batch_note": batch_note,
            "space": {"backends": list(space.backends), "stages": list(space.stages), "offload": space.offload,
                      "micro_batches": list(space.micro_batches) if space.micro_batches else "auto",
                      "checkpointing": list(space.checkpointing), "tp": list(space.tps), "pp": list(space.pps),
                      "sp": list(space.sps), "ep": list(space.eps), "reducers": list(space.reducers),
                      **({"rollout_engines": list(space.rollout_engines), "gathers": list(space.gathers),
                          "rollout_rows": list(space.rollout_rows) if space.rollout_rows else "auto"} if grpo else {})},
            "rank_by": measure_of(cfg),
            "rl_note": GRPO_NOTE if grpo and args.tp == args.pp == args.sp == args.ep == "auto" else "",
            "date": time.strftime("%Y-%m-%d %H:%M"), "base_config": to_yaml(cfg)}


def _trial_yaml(plan, args: argparse.Namespace, out: Path, name: str) -> str:
    """The trial's run config: the candidate's plan as `train` runs it, a few steps, no trackers, no resume."""
    from ..config.load import to_yaml
    from ..search.tune_decisions import with_overrides

    cfg = with_overrides(plan.cfg, {"run.max_steps": args.trial_steps, "run.overwrite": True, "run.output": str(out),
                                    "run.save_every": 0, "run.eval_every": 0, "run.report_to": "none",
                                    "run.tensorboard": False, "run.resume": None})
    forced = trial_overrides().get(name)
    if forced:  # the test hook: keys checked at tune's start, values written as is (the trial itself must meet them)
        import yaml

        from ..config.load import set_path

        tree = yaml.safe_load(to_yaml(cfg))
        for k, v in forced.items():
            set_path(tree, k, v)
        return yaml.safe_dump(tree, sort_keys=False)
    return to_yaml(cfg)


def _run_trials(chosen: list[dict], plans: dict, args: argparse.Namespace, nproc: int, out_dir: Path,
                on_gpu: bool, limit: int, measure: str = "tokens_per_s") -> None:
    """Measure the chosen rows in order (rounds interleaved under --repeats) within --budget-s; fills each
    row's measured columns and status in place. The progress bar's "best" is the fastest (by `measure`) within
    `limit`."""
    from tqdm import tqdm

    from ..search.report import config_label
    from ..search.trials import median, run_trial
    from ..search.tune_decisions import MEASURES, out_of_budget, peak_error_pct

    trials_dir = out_dir / "trials"
    trials_dir.mkdir(exist_ok=True)
    t_start = time.perf_counter()
    longest = 0.0
    bar = tqdm(total=len(chosen) * args.repeats, desc="tune", unit="trial", file=sys.stderr)
    best: Optional[dict] = None
    for rnd in range(args.repeats):
        for r in chosen:
            if r["status"] not in ("", "ok"):  # failed in an earlier round, or out of budget
                bar.update(1)
                continue
            spent = time.perf_counter() - t_start
            if out_of_budget(spent, longest, args.budget_s, rnd > 0 or any(x["status"] for x in chosen)):
                if r["status"] == "":
                    r.update(status="not-run", reason=f"not run: --budget-s {args.budget_s:g} spent "
                                                      f"({spent:.0f} s; a trial took up to {longest:.0f} s)")
                bar.update(1)
                continue
            name = r["name"]
            run_yaml = trials_dir / f"{name}.yaml"
            out = trials_dir / name
            run_yaml.write_text(_trial_yaml(plans[name], args, out, name))
            res = run_trial(run_yaml, out, nproc, args.trial_timeout, trials_dir / f"{name}.log",
                            warmup=args.trial_warmup)
            longest = max(longest, res.seconds)
            trial_dir = RunDir(out)
            for heavy in (trial_dir.checkpoints, trial_dir.final):  # measured already; a big model's would fill the disk
                shutil.rmtree(heavy, ignore_errors=True)
            r["trial_seconds"] = round((r.get("trial_seconds") or 0.0) + res.seconds, 1)
            if res.status != "ok" or not res.metrics:
                r.update(status=res.status if res.status != "ok" else "failed",
                         error=res.error or "the run logged no training step",
                         reason=f"infeasible: {res.status if res.status != 'ok' else 'failed'}")
                tqdm.write(f"{name}: {r['status']}: {r['error']}", file=sys.stderr)
                bar.update(1)
                continue
            m = res.metrics
            peak = m.get("peak_gpu_mem_bytes") if on_gpu else res.run_peak_rss
            for key in ("tokens_per_s", "samples_per_s"):  # each round's median; the row: the median of rounds
                runs = list(r.get(f"{key}_runs") or []) + [round(m[key], 2)]
                r.update({f"{key}_runs": runs, key: round(median(runs), 2)})
            r.update(status="ok", step_time_s=m["step_time_s"], final_loss=m["final_loss"],
                     generation_s=m.get("generation_s"),
                     measured_peak_bytes=max(peak or 0, r.get("measured_peak_bytes") or 0) or None)
            if res.model_state:
                r["measured_model_state_bytes"] = res.model_state["measured"]["total"]
                r["model_state_error_pct"] = peak_error_pct(r["measured_model_state_bytes"],
                                                            r["predicted_model_state_bytes"])
            r["peak_error_pct"] = peak_error_pct(r["measured_peak_bytes"], r["predicted_peak_bytes"])
            fits = r["measured_peak_bytes"] is not None and r["measured_peak_bytes"] <= limit
            if fits and (best is None or r[measure] > best[measure]):
                best = r
            tqdm.write(f"{name}: {r[measure]:,.{0 if measure == 'tokens_per_s' else 2}f} {MEASURES[measure]} (step "
                       f"{r['step_time_s']:.3f} s), peak {human_bytes(r['measured_peak_bytes'])} "
                       f"per rank (predicted {human_bytes(r['predicted_peak_bytes'])}) in {res.seconds:.0f} s",
                       file=sys.stderr)
            if best is not None:
                bar.set_postfix_str(f"best {config_label(best)} mb{best['micro_batch']} "
                                    f"{best[measure]:,.1f} {MEASURES[measure]}")
            bar.update(1)
    bar.close()


def _decide_and_write(rows: list[dict], plans: dict, ctx: dict, out_dir: Path) -> int:
    from ..config.load import to_yaml
    from ..search.tune_decisions import MEASURES, pick_winner, with_overrides

    measure = ctx.get("rank_by", "tokens_per_s")  # a trials.json from before grpo's measure: tokens/s
    winner = pick_winner(rows, ctx["limit"], ctx["tie_pct"], measure)
    for stale in ("run.yaml", "ds_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    if winner is not None:
        plan = plans[winner["name"]]
        final = with_overrides(plan.cfg, {"run.output": ctx["run_output"]})  # the rest is the user's run config
        (out_dir / "run.yaml").write_text(to_yaml(final))
        if plan.backend == "deepspeed":
            from ..plan.ds_config import render

            (out_dir / "ds_config.json").write_text(json.dumps(render(plan), indent=2, sort_keys=True) + "\n")
    (out_dir / "trials.json").write_text(json.dumps({"context": ctx, "rows": rows}, indent=1) + "\n")
    write_reports(out_dir, rows, ctx, winner)
    if winner is None:
        failed = [r for r in rows if r["status"] in ("failed", "timeout", "over-limit", "unknown-peak")]
        why = f"{failed[0]['name']}: {failed[0]['error'] or failed[0]['reason']}" if failed else "no trial ran"
        print(f"zerotrain tune: no measured candidate fits ({len(failed)} infeasible; first: {why}); see "
              f"{out_dir}/report.md", file=sys.stderr)
        return 1
    launch = f"torchrun --nproc_per_node {ctx['nproc']} -m zerotrain train --config {out_dir}/run.yaml"
    print(f"tune: winner {winner['name']}: {float(winner[measure]):,.{0 if measure == 'tokens_per_s' else 2}f} "
          f"{MEASURES[measure]} (step {float(winner['step_time_s']):.3f} s), peak "
          f"{human_bytes(winner['measured_peak_bytes'])} per rank (limit {human_bytes(ctx['limit'])}); wrote "
          f"{out_dir}/run.yaml" + (", ds_config.json" if (out_dir / "ds_config.json").exists() else "")
          + f", report.md, report.csv, report.png\n  run it: {launch}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Decide again from a saved trials.json: statuses the decision set are reset, measurements kept."""
    import yaml

    from ..config.schema import RunConfig
    from ..model.source import model_facts_for
    from ..plan.resolve import run_device
    from ..plan.run_plan import build_plan
    from ..search.tune_decisions import Candidate, parse_size, prune, with_overrides

    path = Path(args.replay)
    try:
        saved = json.loads(path.read_text())
        ctx, rows = saved["context"], saved["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--replay {path}: not a tune trials.json ({type(e).__name__}: {e})") from None
    if args.memory_per_rank is not None:
        ctx["limit"], ctx["limit_source"] = parse_size(args.memory_per_rank), "--memory-per-rank (replay)"
    ctx["tie_pct"] = args.tie_pct
    for r in rows:
        if r["status"] in ("winner", "over-limit", "unknown-peak"):
            r["status"] = "ok"
        if r["status"] == "ok":
            r["reason"] = ""
        if r["status"] == "pruned":  # never measured: pruned again under this limit, or left unrun
            r["status"] = ""
    prune(rows, ctx["limit"], ctx["safety_margin"])
    for r in rows:
        if r["status"] == "":
            r.update(status="not-run", reason="not run: pruned under the limit of the original search")
    cfg = RunConfig.model_validate(yaml.safe_load(ctx["base_config"]))
    plans: dict[str, Any] = {}
    facts = None
    for r in rows:
        if r["status"] == "ok":
            if facts is None:
                facts = model_facts_for(cfg)
            c = Candidate.of_row(r)
            plans[r["name"]] = build_plan(with_overrides(cfg, c.overrides()), ctx["nproc"], backend=c.backend,
                                          device=run_device(), facts=facts)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    return _decide_and_write(rows, plans, ctx, out_dir)
