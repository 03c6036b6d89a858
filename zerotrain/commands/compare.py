"""`zerotrain compare`: one short real training run per configuration, then a report.

    zerotrain compare --stages 0,1,2,3 --offload-optimizer none,cpu --backends deepspeed,fsdp \\
        --nproc 2 --max-steps 4 --output runs/compare
    zerotrain compare --model path/to/model --data train.jsonl --stages 2,3 --output runs/cmp
    zerotrain compare --backends fsdp --tp 1,2 --pp 1,2 --stages 3 --model-config tiny-llama --output runs/par
    zerotrain compare --backends deepspeed,fsdp --sp 1,2 --stages 3 --seq-len 4096 --model long-llama --output runs/sp
    zerotrain compare --backends fsdp --ep 1,2 --stages 3 --model-config tiny-qwen3-moe --output runs/ep

Every configuration is a fresh `torchrun -m zerotrain train --config DIR/<config>.yaml` (same seed,
data and batch; the run flags and --config YAML of `train` apply to every run), with a timeout; a
failed one is recorded with its error and the rest go on, and one the rules refuse (the run plan
train would build, zerotrain/plan/run_plan.py) is recorded as failed without launching. Writes DIR/report.csv,
DIR/report.md and DIR/report.png (model-state memory measured vs predicted, tokens/s), and keeps
each run's output under DIR/runs/<config>/. Measured model-state bytes come from the trainer's
record_model_state hook (after the first backward of the last step), predictions from
zerotrain.memory.estimate of the same run plan. With train's default --grad-accum 1 the snapshot is
at the accumulation boundary, where ZeRO-1 holds what ZeRO-2 holds; --grad-accum 2 or more measures
gradients mid-accumulation, where the stages differ.

--tp, --pp, --sp and --ep take grids too: every tp x pp x sp x ep x backend x stage x offload point is planned; a
point the rules refuse (DeepSpeed pipeline at stage 2, tensor parallelism on GPT-2, a degree not dividing --nproc,
dimensions a backend does not run together: the capability table zerotrain/plan/capabilities.py, e.g. tp x pp runs
on FSDP2 only, sp x tp on DeepSpeed at ZeRO 0-2, ep on a dense model) is recorded as refused with its one-line reason and
the others run. Under pp the measured figure is the largest rank's and the prediction the largest stage's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from ..config.flags import add_run_flags, config_from_args, overrides_from_args
from ..errors import UserError
from ..plan.capabilities import BACKENDS
from ..search.trials import run_trial
from ..util import human_bytes

if TYPE_CHECKING:
    from ..config.schema import RunConfig
    from ..memory.estimate import Setup
    from ..model.facts import ModelFacts
    from ..plan.run_plan import RunPlan

_OFFLOADS = ("none", "cpu")
OWN = ("zero.stage", "zero.offload_optimizer", "zero.offload_param", "backend", "run.max_steps", "run.output",
       "parallel.tp", "parallel.pp", "parallel.sp", "parallel.ep")
"""Run-config keys compare sets per run itself (its sweep, --max-steps, --output): not run flags here."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny-preset", default="small-gpt2",
                   help="architecture of the embedded model when --model is unset")
    p.add_argument("--stages", default="0,1,2,3", help="comma list of ZeRO stages")
    p.add_argument("--offload-optimizer", default="none", help="comma list of none,cpu (cpu only at stage >= 1)")
    p.add_argument("--offload-param", default="none", help="comma list of none,cpu (cpu only at stage 3)")
    p.add_argument("--backends", default="deepspeed", help=f"comma list of {','.join(BACKENDS)}")
    p.add_argument("--tp", default="1", help="comma list of tensor-parallel degrees, e.g. 1,2 [parallel.tp]")
    p.add_argument("--pp", default="1", help="comma list of pipeline-parallel degrees, e.g. 1,2 [parallel.pp]")
    p.add_argument("--sp", default="1", help="comma list of sequence-parallel degrees, e.g. 1,2 [parallel.sp]")
    p.add_argument("--ep", default="1", help="comma list of expert-parallel degrees, e.g. 1,2 [parallel.ep]")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (torchrun --nproc_per_node)")
    p.add_argument("--max-steps", type=int, default=4, help="optimizer steps per run (>= 2: Adam state exists)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra `zerotrain train` flag for every run (repeat), e.g. --train-arg=--lr=1e-4")
    p.add_argument("--output", required=True, help="report directory")
    # train's own run flags and defaults; --model unset trains the embedded model (--tiny-preset)
    add_run_flags(p, skip=OWN)


def _csv(value: str, allowed: Optional[tuple] = None, flag: str = "", cast=str) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        out = [cast(v) for v in items]
    except ValueError:
        raise UserError(f"{flag} {value!r}: expected a comma list") from None
    if not out or (allowed and any(v not in allowed for v in out)):
        raise UserError(f"{flag} {value!r}: use a comma list of {', '.join(map(str, allowed or ()))}")
    return out


class GridPoint(NamedTuple):
    """One compared run: its model-parallel degrees and its backend/stage/offload row."""

    tp: int
    pp: int
    sp: int
    ep: int
    setup: "Setup"

    @property
    def data_parallel_only(self) -> bool:
        return self.tp == self.pp == self.sp == 1  # ep splits experts, not the batch


def run_name(s: Setup, tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 1) -> str:
    par = "".join(f"-{d}{n}" for d, n in (("tp", tp), ("pp", pp), ("sp", sp), ("ep", ep)) if n > 1)
    return f"{s.backend}{par}-z{s.stage}-opt_{s.offload_optimizer}-param_{s.offload_param}"


def plan_grid(args: argparse.Namespace) -> list[GridPoint]:
    """Every --tp x --pp x --sp x --ep point with every plan_runs row, in report order."""
    tps, pps, sps, eps = (_csv(getattr(args, d), None, f"--{d}", int) for d in ("tp", "pp", "sp", "ep"))
    bad = [v for v in tps + pps + sps + eps if v < 1]
    if bad:
        raise UserError(f"--tp/--pp/--sp/--ep {bad[0]}: degrees must be >= 1")
    runs = plan_runs(args)
    return [GridPoint(tp, pp, sp, ep, s) for tp in tps for pp in pps for sp in sps for ep in eps for s in runs]


def plan_runs(args: argparse.Namespace) -> list[Setup]:
    """Every backend x stage x offload combination `train` accepts (memory.setups), in report order."""
    from ..memory.estimate import setups

    stages = _csv(args.stages, (0, 1, 2, 3), "--stages", int)
    oo = _csv(args.offload_optimizer, _OFFLOADS, "--offload-optimizer")
    op = _csv(args.offload_param, _OFFLOADS, "--offload-param")
    backends = _csv(args.backends, BACKENDS, "--backends")
    runs = setups(backends, stages, oo, op, distinct=False)  # FSDP stage 1 asked is a run of its own
    if not runs:
        raise UserError("no valid configuration: offload-optimizer needs stage >= 1, offload-param stage 3")
    return runs


def _train_flags(args: argparse.Namespace) -> argparse.Namespace:
    """--train-arg values read as `zerotrain train` flags, so the planned run sees them too."""
    p = argparse.ArgumentParser(prog="zerotrain compare --train-arg", add_help=False, allow_abbrev=False)
    add_run_flags(p)
    ns, unknown = p.parse_known_args(args.train_arg)
    if unknown:
        raise UserError(f"--train-arg {' '.join(unknown)}: not a `zerotrain train` flag")
    return ns


def base_config(args: argparse.Namespace) -> RunConfig:
    """The run config every compared run shares: compare's settings <- --config YAML and run flags
    <- --train-arg flags; no model given: the embedded one (--tiny-preset)."""
    extra = _train_flags(args)
    merged = argparse.Namespace(**vars(args))
    merged.config_file = extra.config_file or args.config_file
    merged.ds_override = args.ds_override + extra.ds_override
    # short comparison runs: no HF export at the end (it measures nothing we report)
    own = {"run.max_steps": args.max_steps, "run.overwrite": True, "run.save_final": False}
    cfg = config_from_args(merged, {**own, **overrides_from_args(extra)})
    if cfg.model.name is None and cfg.model.from_config is None:
        from ..assets.demo import ensure_tiny_model

        path = str(ensure_tiny_model(args.tiny_preset))
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": path})})
    return cfg


def _pct(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
    if not measured or not predicted:
        return None
    return round(100.0 * (measured - predicted) / predicted, 2)


def _planned(cfg: RunConfig, s: Setup, nproc: int, facts: ModelFacts, tp: int = 1,
             pp: int = 1, sp: int = 1, ep: int = 1) -> tuple[Optional[RunPlan], str]:
    """(the run plan train will build for this row, "") or (None, why the rules refuse the row)."""
    from ..memory.estimate import setup_plan
    from ..plan.resolve import run_device

    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"tp": tp, "pp": pp, "sp": sp, "ep": ep})})
    try:
        return setup_plan(cfg, s, nproc, facts=facts, device=run_device()), ""
    except UserError as e:
        return None, f"refused: {e}"


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..config.load import to_yaml
    from ..memory.estimate import estimate
    from ..model.source import model_facts_for
    from ..plan.parallel_rules import resolve_batch
    from ..plan.resolve import asked
    from ..search.report import REPORT_COLUMNS, plot_compare, write_csv

    runs = plan_grid(args)
    for name in ("nproc", "max_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    cfg = base_config(args)
    if all(point.data_parallel_only for point in runs):  # refuses a global batch the ranks cannot split, up front
        resolve_batch(cfg, args.nproc)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = cfg.model.name or cfg.model.from_config
    spec = model_facts_for(cfg)
    request = asked(cfg)

    rows: list[dict[str, Any]] = []
    bar = tqdm(runs, desc="compare", unit="config", file=sys.stderr)
    batches: list[tuple[int, int]] = []
    for tp, pp, sp, ep, rs in bar:
        name = run_name(rs, tp, pp, sp, ep)
        bar.set_postfix_str(name)
        out = out_dir / "runs" / name
        t0 = time.perf_counter()
        plan, err = _planned(cfg, rs, args.nproc, spec, tp, pp, sp, ep)
        trial = None
        if plan is None:  # what `train` would refuse at start-up: recorded (refused: a tp/pp/sp/ep point), not launched
            (out_dir / f"{name}.log").write_text(err + "\n")
        else:
            run_yaml = out_dir / f"{name}.yaml"
            run_yaml.write_text(to_yaml(plan.cfg))
            trial = run_trial(run_yaml, out, args.nproc, args.timeout, out_dir / f"{name}.log")
            err = trial.error
            batches.append((plan.batch.micro_batch, plan.batch.grad_accum))
        est = estimate(plan) if plan is not None else None
        m, meas = (trial.metrics, trial.model_state) if trial is not None else ({}, None)
        row: dict[str, Any] = {
            "backend": rs.backend, "stage": rs.stage, "offload_optimizer": rs.offload_optimizer,
            "offload_param": rs.offload_param, "precision": request.dtype, "world_size": args.nproc,
            "tp": tp, "pp": pp, "sp": sp, "ep": ep,
            "model_state_bytes_measured": meas["measured"]["total"] if meas else None,
            "model_state_bytes_predicted": est.largest_stage_model_states if est else None,
            "peak_rss_predicted": est.run_peak_rss if est else None,
            **m, **({"peak_rss_bytes": trial.run_peak_rss} if trial is not None and trial.run_peak_rss else {}),
            "status": trial.status if trial is not None else "refused" if (tp, pp, sp, ep) != (1, 1, 1, 1) else "failed",
            "error": err,
            "output": str(out)}
        row["model_state_error_pct"] = _pct(row["model_state_bytes_measured"], row["model_state_bytes_predicted"])
        row["peak_rss_error_pct"] = _pct(row.get("peak_rss_bytes"), row["peak_rss_predicted"])
        rows.append(row)
        if row["status"] == "refused":
            tqdm.write(f"{name}: {err}", file=sys.stderr)
            continue
        tqdm.write(f"{name}: {row['status']} in {time.perf_counter() - t0:.0f}s  model states "
                   f"{human_bytes(row['model_state_bytes_measured'])} measured / "
                   f"{human_bytes(row['model_state_bytes_predicted'])} predicted  peak RSS "
                   f"{human_bytes(row.get('peak_rss_bytes'))}  "
                   f"{(row.get('tokens_per_s') or 0):,.0f} tok/s" + (f"  error: {err}" if err else ""), file=sys.stderr)
    bar.close()

    write_csv(out_dir / "report.csv", rows, REPORT_COLUMNS)
    plot_compare(out_dir / "report.png", rows)
    micro, accum = batches[0] if batches else (request.micro_batch, request.grad_accum)
    header = (f"{spec.num_params:,} parameters, {args.nproc} ranks, {request.dtype}, micro-batch {micro} x "
              f"accum {accum} x seq {cfg.data.seq_len}, {request.max_steps} steps, seed {cfg.run.seed}.")
    (out_dir / "report.md").write_text(_markdown(rows, args, model, header))
    ok = sum(r["status"] == "ok" for r in rows)
    refused = sum(r["status"] == "refused" for r in rows)  # a grid point the rules refuse is a result, not a failure
    print(f"compare: {ok}/{len(rows)} configurations ran" + (f" ({refused} refused)" if refused else "")
          + f"; wrote {out_dir}/report.csv, report.md, report.png")
    return 0 if ok and ok + refused == len(rows) else 1


def _markdown(rows: list[dict[str, Any]], args: argparse.Namespace, model: str, header: str) -> str:
    from ..search.report import config_label, markdown_table

    def fmt(r: dict[str, Any]) -> dict[str, Any]:
        pct = r.get("model_state_error_pct")
        return {"config": config_label(r), "status": r["status"],
                "model states measured": human_bytes(r.get("model_state_bytes_measured")),
                "predicted": human_bytes(r.get("model_state_bytes_predicted")),
                "error": "-" if pct is None else f"{pct:+.1f}%",
                "peak RSS": human_bytes(r.get("peak_rss_bytes")),
                "RSS predicted": human_bytes(r.get("peak_rss_predicted")),
                "tokens/s": "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}",
                "step time": "-" if r.get("step_time_s") is None else f"{r['step_time_s']:.3f} s",
                "final loss": "-" if r.get("final_loss") is None else f"{r['final_loss']:.4f}"}

    table = [fmt(r) for r in rows]
    lines = [f"# zerotrain compare: {model}", "",
             header, "",
             markdown_table(table, list(table[0])), "",
             "Model states: per rank (largest rank), bytes of every tensor the engine and optimizer hold, each "
             "storage once, after the first backward of the last step. Predicted: `zerotrain estimate` "
             "(formulas in zerotrain/memory/estimate.py FORMULAS). Peak RSS: VmHWM of the whole run (loading, steps, "
             "checkpoint save), largest rank, predicted by Estimate.run_peak_rss. tokens/s and step "
             "time: median over steps after the first, all ranks."]
    refused = [r for r in rows if r["status"] == "refused"]
    if refused:
        lines += ["", "## Refused configurations (not run)", ""]
        lines += [f"- {config_label(r)}: `{r['error']}`" for r in refused]
    failed = [r for r in rows if r["status"] not in ("ok", "refused")]
    if failed:
        lines += ["", "## Failed configurations", ""]
        lines += [f"- {config_label(r)}: {r['status']}: `{r['error']}` (log: {Path(args.output) / 'runs'})"
                  for r in failed]
    return "\n".join(lines) + "\n"
