"""zerotrain vs the tools users would pick instead, on the same fine-tuning job, interleaved and repeated.

    .venv/bin/python benchmarks/bench.py --rounds 3 --out /tmp/bench.md            # the comparison
    .venv/bin/python benchmarks/bench.py --sweep --rounds 3 --out /tmp/sweep.md    # stage-3 knob sweep
    .venv/bin/python benchmarks/bench.py --speed --configs 0,3 --rounds 4 --out /tmp/speed.md  # fused loss, compile
    .venv/bin/python benchmarks/bench.py --quick --out /tmp/smoke.md               # CI smoke (tiny, 1 round)

Runners (each a 2-rank torchrun job over gloo on 127.0.0.1, same model/data/batch/precision/seed):
  zerotrain  benchmarks/run_zerotrain.py   the `zerotrain train` command (metrics.jsonl read too)
  ds_loop    benchmarks/peers/ds_loop.py    hand-written deepspeed.initialize loop, DeepSpeed defaults
  hf_trainer benchmarks/peers/hf_trainer.py HF Trainer + the HF docs' "auto" DeepSpeed config
  accelerate benchmarks/peers/accelerate_loop.py Accelerate + DeepSpeedPlugin
Before round 0 every runner does one short untimed run per configuration (JIT op builds, page
cache). Order within a round is A B C D per configuration (rotated by one every round so no runner always
goes first). Per run: the median wall time between consecutive optimizer-step ends on rank 0 over
the steps after `--warmup` warm-up steps (JIT op builds and start-up happen before step 1 and are
never timed). Across rounds: median of the per-run medians, [min-max]. Ratios are taken per round
(zerotrain / peer from the same round, run back to back), then their median [min-max].
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import common as C  # noqa: E402

from zerotrain.launch.subprocess_run import run_with_timeout  # noqa: E402
from zerotrain.util import free_port  # noqa: E402

RUNNERS = {"zerotrain": "run_zerotrain.py", "ds_loop": "peers/ds_loop.py",
           "hf_trainer": "peers/hf_trainer.py", "accelerate": "peers/accelerate_loop.py",
           "zt_engine": "peers/zt_engine.py",  # diagnostic: zerotrain's engine in the hand-written loop
           "zerotrain_before": "run_zerotrain.py"}  # --before REF: the same runner on that commit's zerotrain
BEFORE_ROOT: Optional[Path] = None
"""--before REF: where that commit's tree was exported (`git archive`), first on zerotrain_before's PYTHONPATH."""
DEFAULT_RUNNERS = "zerotrain,ds_loop,hf_trainer,accelerate"
CONFIGS = {"0": (0, False), "1": (1, False), "2": (2, False), "3": (3, False), "3off": (3, True)}


@dataclass
class Run:
    """One launched job and what it measured (rank 0 timings, max-over-ranks memory)."""

    round: int
    """The interleaved round it ran in (-1: a warm-up run left out of the paired ratios)."""
    config: str
    """The ZeRO setting run: a key of CONFIGS ("0" to "3", "3off")."""
    runner: str
    """A key of RUNNERS."""
    variant: str
    """The knob setting of a sweep or speed variant ("default" in the comparison)."""
    ok: bool
    """The job exited 0 and every rank wrote its result."""
    step_s: Optional[float] = None
    """Median step-end to step-end wall time after warm-up (rank 0)."""
    metrics_step_s: Optional[float] = None
    """zerotrain only: median step_time_s from its metrics.jsonl after warm-up."""
    state_bytes: Optional[int] = None
    """Model-state bytes, the largest rank (common.model_state_bytes)."""
    peak_rss: Optional[int] = None
    """Peak RSS bytes, the largest rank."""
    compile_s: Optional[float] = None
    """zerotrain --compile: seconds spent compiling (its metrics.jsonl compile records)."""
    wall_s: float = 0.0
    error: str = ""


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error",
             PYTHONWARNINGS="ignore")
    e.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "zt-bench-inductor"))  # shared by runs
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def launch(runner: str, job: C.Job, prefix: Path, extra: Optional[dict], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / RUNNERS[runner]),
           json.dumps(asdict(job)), str(prefix)] + ([json.dumps(extra)] if extra else [])
    e = env()
    if runner == "zerotrain_before":
        if BEFORE_ROOT is None:
            raise SystemExit("bench.py: the zerotrain_before runner needs --before REF")
        e["PYTHONPATH"] = os.pathsep.join([str(BEFORE_ROOT), e["PYTHONPATH"]])
    res = run_with_timeout(cmd, timeout, env=e, cwd=REPO, merge_stderr=True)
    return -9 if res.timed_out else res.returncode, res.stdout[-3000:]


def median_after(values: list[float], warmup: int) -> Optional[float]:
    timed = values[warmup:]
    return statistics.median(timed) if timed else None


def collect(prefix: Path, runner: str, warmup: int) -> dict[str, Any]:
    ranks = [json.loads(p.read_text()) for p in sorted(prefix.parent.glob(prefix.name + ".rank*.json"))]
    if not ranks:
        return {}
    r0 = next(r for r in ranks if r["rank"] == 0)
    ends = r0["step_ends"]
    durations = [b - a for a, b in zip(ends, ends[1:])]  # durations[i] is step i+2
    out: dict[str, Any] = {"step_s": median_after(durations, warmup - 1),
                           "state_bytes": max(int(r["model_state_bytes"].get("total", 0)) for r in ranks),
                           "peak_rss": max(int(r["peak_rss_bytes"]) for r in ranks)}
    if runner in ("zerotrain", "zerotrain_before"):
        metrics = prefix.parent / (prefix.name + ".run") / "out" / "metrics.jsonl"
        recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        out["metrics_step_s"] = median_after([r["step_time_s"] for r in recs if "step_time_s" in r], warmup)
        out["compile_s"] = sum(r["compile_s"] for r in recs if r.get("event") == "compile") or None
    return out


def one(work: Path, rnd: int, config: str, runner: str, variant: str, job: C.Job, extra: Optional[dict],
        timeout: float) -> Run:
    prefix = work / f"r{rnd}-{config}-{runner}-{variant}"
    t0 = time.perf_counter()
    rc, log = launch(runner, job, prefix, extra, timeout)
    wall = time.perf_counter() - t0
    try:
        figures = collect(prefix, runner, job.warmup)
    except (OSError, ValueError, KeyError, StopIteration) as e:
        figures, log = {}, f"{log}\ncollect failed: {e!r}"
    ok = bool(figures) and figures.get("step_s") is not None
    # A result written before a non-zero exit (e.g. an abort at interpreter exit) still counts; say so.
    err = "" if rc == 0 else f"exit {rc}: " + " | ".join(log.strip().splitlines()[-3:])
    shutil.rmtree(prefix.parent / (prefix.name + ".run"), ignore_errors=True)
    shutil.rmtree(prefix.parent / (prefix.name + ".trainer"), ignore_errors=True)
    run = Run(rnd, config, runner, variant, ok, wall_s=wall, error=err, **figures)
    status = f"{run.step_s:.3f} s/step" if ok else "FAILED"
    print(f"  round {rnd} config {config:>4} {runner:>10} {variant:<14} {status}  ({wall:.0f} s wall)"
          + (f"  [{err[:160]}]" if err else ""), flush=True)
    return run


# --- summaries ---------------------------------------------------------------------------------

def med_range(xs: list[float], fmt: str = "{:.3f}") -> str:
    if not xs:
        return "failed"
    s = fmt.format(statistics.median(xs))
    return s if len(xs) == 1 else f"{s} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def machine() -> dict[str, str]:
    import importlib.metadata as md

    import torch

    vers = {p: md.version(p) for p in ("torch", "deepspeed", "transformers", "accelerate")}
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpus": str(os.cpu_count()), "cpu": f"{model} ({torch.backends.cpu.get_cpu_capability()})",
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "python": platform.python_version(), **vers}


def table_comparison(runs: list[Run], configs: list[str], runners: list[str], tokens: int) -> str:
    lines = ["| stage | " + " | ".join(f"{r} tokens/s" for r in runners) + " | zerotrain step_time_s (metrics.jsonl) |",
             "| --- " * (len(runners) + 2) + "|"]
    for c in configs:
        cells = []
        for r in runners:
            xs = [tokens / x.step_s for x in runs if x.config == c and x.runner == r and x.ok]
            cells.append(med_range(xs, "{:,.0f}"))
        zt = [x.metrics_step_s for x in runs if x.config == c and x.runner == "zerotrain" and x.metrics_step_s]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {med_range(zt)} |")
    return "\n".join(lines)


def table_ratios(runs: list[Run], configs: list[str], runners: list[str], base: str = "zerotrain") -> str:
    peers = [r for r in runners if r != base]
    lines = ["| stage | " + " | ".join(f"{base} / {p}" for p in peers) + " |", "| --- " * (len(peers) + 1) + "|"]
    for c in configs:
        cells = []
        for p in peers:
            ratios = []
            for rnd in sorted({x.round for x in runs}):
                a = [x for x in runs if (x.round, x.config, x.runner) == (rnd, c, base) and x.ok]
                b = [x for x in runs if (x.round, x.config, x.runner) == (rnd, c, p) and x.ok]
                if a and b:
                    ratios.append(b[0].step_s / a[0].step_s)  # tokens/s ratio = inverse step-time ratio
            cells.append(med_range(ratios, "{:.2f}"))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_overhead(runs: list[Run], configs: list[str], runners: list[str], loop: str = "ds_loop") -> str:
    """zerotrain's own cost per step: its step time minus the hand-written loop's from the same round, in ms and as
    a share of the loop's step (negative: zerotrain's step is the shorter), median [min-max] over rounds."""
    mine = [r for r in runners if r.startswith("zerotrain")]
    lines = ["| stage | " + " | ".join(f"{r} - {loop} (ms per step) | {r} - {loop} (% of {loop}'s step)" for r in mine)
             + " |", "| --- " * (2 * len(mine) + 1) + "|"]
    for c in configs:
        cells = []
        for r in mine:
            ms, pct = [], []
            for rnd in sorted({x.round for x in runs if x.round >= 0}):
                a = [x for x in runs if (x.round, x.config, x.runner) == (rnd, c, r) and x.ok]
                b = [x for x in runs if (x.round, x.config, x.runner) == (rnd, c, loop) and x.ok]
                if a and b:
                    ms.append((a[0].step_s - b[0].step_s) * 1e3)
                    pct.append(100 * (a[0].step_s - b[0].step_s) / b[0].step_s)
            cells += [med_range(ms, "{:+.1f}"), med_range(pct, "{:+.1f}")]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_memory(runs: list[Run], configs: list[str], runners: list[str]) -> str:
    lines = ["| stage | " + " | ".join(f"{r} state MiB / peak RSS MiB" for r in runners) + " |",
             "| --- " * (len(runners) + 1) + "|"]
    for c in configs:
        cells = []
        for r in runners:
            xs = [x for x in runs if x.config == c and x.runner == r and x.ok]
            cells.append(f"{mib(max(x.state_bytes for x in xs))} / {mib(max(x.peak_rss for x in xs))}" if xs else "failed")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_sweep(runs: list[Run], variants: list[str], tokens: int) -> str:
    ref = "ds_defaults"
    lines = ["| variant | step s | tokens/s | vs DeepSpeed defaults (per round) | state MiB (max rank) |",
             "| --- | --- | --- | --- | --- |"]
    for v in variants:
        xs = [x for x in runs if x.variant == v and x.ok]
        ratios = []
        for rnd in sorted({x.round for x in runs}):
            a = [x for x in xs if x.round == rnd]
            b = [x for x in runs if x.round == rnd and x.variant == ref and x.ok]
            if a and b:
                ratios.append(b[0].step_s / a[0].step_s)
        lines.append(f"| {v} | {med_range([x.step_s for x in xs])} | {med_range([tokens / x.step_s for x in xs], '{:,.0f}')} "
                     f"| {med_range(ratios, '{:.2f}')} | {mib(max((x.state_bytes for x in xs), default=None))} |")
    return "\n".join(lines)


# The stage-3 knob sweep: zerotrain runs with one knob changed from its generated default, plus the
# hand-written loop with DeepSpeed's defaults as the reference. h = hidden size (256 here).
def sweep_variants(h: int) -> dict[str, tuple[str, Optional[dict]]]:
    z = lambda **kw: ("zerotrain", {"zero": kw})  # noqa: E731
    return {
        "ds_defaults": ("ds_loop", None),
        "zt_generated": ("zerotrain", None),
        "persist_0": z(param_persistence_threshold=0),
        "persist_10h": z(param_persistence_threshold=10 * h),
        "persist_1e4": z(param_persistence_threshold=10_000),
        "persist_1e5": z(param_persistence_threshold=100_000),
        "prefetch_0": z(prefetch_bucket_size=0),
        "no_overlap": z(overlap_comm=False),
        "reduce_1e6": z(reduce_bucket_size=1_000_000),
        "buckets_hxh": z(reduce_bucket_size=h * h, prefetch_bucket_size=int(0.9 * h * h)),
        "buckets_ds": z(reduce_bucket_size=500_000_000, prefetch_bucket_size=50_000_000,
                        max_live_parameters=1_000_000_000),
    }


# The step-speed variants (--speed): zerotrain before the fused loss, with its defaults (the fused loss), and with
# --compile, against the hand-written DeepSpeed loop, at every --configs stage.
SPEED_VARIANTS: dict[str, tuple[str, Optional[dict]]] = {
    "ds_loop": ("ds_loop", None),
    "zt_unfused": ("zerotrain", {"model": {"fused_loss": False}}),
    "zt_defaults": ("zerotrain", None),
    "zt_compile": ("zerotrain", {"compile": {"enabled": True}}),
    "zt_workers1": ("zerotrain", {"data": {"loader_workers": 1}}),  # a loader process reads ahead
    "zt_workers2": ("zerotrain", {"data": {"loader_workers": 2}}),
}


def table_speed(runs: list[Run], configs: list[str], variants: list[str], tokens: int) -> str:
    """Per stage and variant: tokens/s, and per-round ratios against those of zt_unfused, zt_defaults and ds_loop
    that ran (zt_unfused and ds_loop always have a column)."""
    refs = [r for r in ("zt_unfused", "zt_defaults", "ds_loop") if r != "zt_defaults" or r in variants]
    lines = ["| stage | variant | tokens/s | " + " | ".join(f"/ {r} (per round)" for r in refs) + " | compile s |",
             "| --- " * (len(refs) + 4) + "|"]
    for c in configs:
        for v in variants:
            xs = [x for x in runs if x.config == c and x.variant == v and x.ok]
            cells = [med_range([tokens / x.step_s for x in xs], "{:,.0f}")]
            for ref in refs:
                ratios = []
                for rnd in sorted({x.round for x in xs}):
                    a = [x for x in xs if x.round == rnd]
                    b = [x for x in runs if (x.round, x.config, x.variant) == (rnd, c, ref) and x.ok]
                    if a and b:
                        ratios.append(b[0].step_s / a[0].step_s)
                cells.append(med_range(ratios, "{:.2f}") if v != ref else "-")
            comp = [x.compile_s for x in xs if x.compile_s]
            cells.append(med_range(comp, "{:.1f}") if comp else "-")
            lines.append(f"| {c} | {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tokens_per_step(seq_len: int) -> int:
    """Tokens per optimizer step of the benchmark job (micro-batch x grad-accum x 2 ranks x sequence)."""
    return C.MICRO_BATCH * C.GRAD_ACCUM * 2 * seq_len


def comparison_tables(runs: list[Run], configs: list[str], runners: list[str], tokens: int) -> str:
    """The three comparison tables (tokens/s, ratios, memory) under their headings."""
    before = ""
    if "zerotrain_before" in runners:  # bench.py --before REF: the same ratios for that commit's zerotrain
        before = ("\n\n## Ratios zerotrain_before (--before) / peer, tokens/s (per round, median [min-max])\n\n"
                  + table_ratios(runs, configs, [r for r in runners if r != "zerotrain"], base="zerotrain_before"))
    overhead = ""
    if "ds_loop" in runners:
        overhead = ("\n\n## zerotrain's own cost: its step minus the hand-written loop's (per round, median "
                    "[min-max])\n\n" + table_overhead(runs, configs, runners))
    return ("## Tokens/s (median [min-max] over rounds)\n\n" + table_comparison(runs, configs, runners, tokens)
            + "\n\n## Ratios zerotrain / peer, tokens/s (per round, median [min-max])\n\n"
            + table_ratios(runs, configs, runners) + before + overhead
            + "\n\n## Per-rank model-state bytes (max over ranks and rounds) / peak RSS\n\n"
            + table_memory(runs, configs, runners))


def render_saved(saved: Path, out: Path, seq_len: int) -> int:
    """Write the comparison tables of an earlier run's raw JSON (its machine header is not in the JSON)."""
    runs = [Run(**d) for d in json.loads(saved.read_text())]
    configs = [c for c in CONFIGS if any(r.config == c for r in runs)]
    runners = [r for r in RUNNERS if any(x.runner == r for x in runs)]
    tokens = tokens_per_step(seq_len)
    rounds = sorted({r.round for r in runs if r.round >= 0})
    out.write_text(f"Re-rendered from {saved.name}: {len(rounds)} rounds, {len(runs)} runs, "
                   f"{sum(not r.ok for r in runs)} failed.\n\n" + comparison_tables(runs, configs, runners, tokens) + "\n")
    print(out.read_text())
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps per run (warm-up included)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed optimizer steps at the start of each run")
    ap.add_argument("--configs", default="0,1,2,3,3off", help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--runners", default=DEFAULT_RUNNERS, help=f"comma list of {', '.join(RUNNERS)}")
    ap.add_argument("--preset", default=C.PRESET, help="model preset (zerotrain.model.facts.TINY_PRESETS)")
    ap.add_argument("--seq-len", type=int, default=C.SEQ_LEN)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 where the CPU has native bf16 kernels (AVX-512), else fp32")
    ap.add_argument("--sweep", action="store_true", help="stage-3 knob sweep instead of the comparison")
    ap.add_argument("--variants", default="", help="sweep/--speed: comma list of variant names (default all)")
    ap.add_argument("--speed", action="store_true", help="step-speed variants (fused loss, --compile) vs the "
                    "hand-written loop at every --configs stage instead of the comparison")
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke: seq 64, 1 round, 3 steps, 2 runs, tiny-gpt2 unless --preset is given")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launched job")
    ap.add_argument("--out", required=True, help="markdown table file to write (raw runs go to OUT.json)")
    ap.add_argument("--before", default="", metavar="REF", help="also run zerotrain_before: run_zerotrain.py on "
                    "git REF's zerotrain (exported to a temporary folder), beside today's, in the same rounds")
    ap.add_argument("--from-json", default="", help="run nothing: re-render the tables of a saved OUT.json "
                    "(give that run's --seq-len: the JSON does not record it)")
    args = ap.parse_args()
    if args.from_json:
        return render_saved(Path(args.from_json), Path(args.out), args.seq_len)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.seq_len = 1, 3, 1, 64
        if args.preset == C.PRESET:
            args.preset = "tiny-gpt2"
        if args.configs == "0,1,2,3,3off":
            args.configs = "2"
        if args.runners == DEFAULT_RUNNERS:
            args.runners = "zerotrain,ds_loop"
    configs, runners = args.configs.split(","), args.runners.split(",")
    if args.before:
        global BEFORE_ROOT
        BEFORE_ROOT = Path(tempfile.mkdtemp(prefix="zt-before-"))
        archive = subprocess.run(["git", "archive", args.before, "zerotrain"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(BEFORE_ROOT)], input=archive, check=True)
        if "zerotrain_before" not in runners:
            runners.insert(1, "zerotrain_before")
    precision = C.default_precision() if args.precision == "auto" else args.precision
    tokens = tokens_per_step(args.seq_len)
    before = machine()
    # Build the model once before timing anything (every runner then loads the same directory).
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import common; "
                    f"common.model_dir({args.preset!r})"], check=True, env=env(), cwd=REPO)
    work = Path(tempfile.mkdtemp(prefix="zt-bench-"))
    runs: list[Run] = []
    t_start = time.time()
    from zerotrain.model.facts import load_hf_config

    hf = load_hf_config(args.preset)
    hidden = getattr(hf, "hidden_size", None) or hf.n_embd
    allv = SPEED_VARIANTS if args.speed else sweep_variants(hidden)
    names = args.variants.split(",") if args.variants else list(allv)

    def report(finished: bool = False) -> None:
        """Rewrite OUT (and OUT.json) with every run so far: an interrupted benchmark keeps its rounds."""
        if args.speed:
            body = "## Step speed: fused loss and --compile\n\n" + table_speed(runs, configs, names, tokens)
        elif args.sweep:
            body = "## Stage-3 knob sweep\n\n" + table_sweep(runs, names, tokens)
        else:
            body = comparison_tables(runs, configs, runners, tokens)
        after = machine()
        per_round = len(names) if args.sweep else len(configs) * len(names if args.speed else runners)
        done = [n for n in {r.round for r in runs if r.round >= 0}
                if sum(r.round == n for r in runs) >= per_round]
        head = (f"Measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(t_start))}, {(time.time() - t_start) / 60:.1f} min; "
                f"{before['cpus']} CPUs, {before['cpu']}; load average before {before['load']}, after {after['load']}; "
                f"python {before['python']}, torch {before['torch']}, deepspeed {before['deepspeed']}, "
                f"transformers {before['transformers']}, accelerate {before['accelerate']}.\n"
                f"Job: {args.preset}, seq {args.seq_len}, micro-batch {C.MICRO_BATCH}, grad-accum {C.GRAD_ACCUM}, 2 ranks, "
                f"{precision}, {tokens} tokens/optimizer step; rounds complete: {len(done)} of {args.rounds}"
                f"{'' if finished else ' (still running: partial figures)'}, {args.steps} steps "
                f"per run, first {args.warmup} untimed.\n")
        failures = [r for r in runs if not r.ok or r.error]
        tail = "" if not failures else "\n\n## Failed or non-zero exits\n\n" + "\n".join(
            f"- round {r.round} config {r.config} {r.runner} {r.variant}: {'ok result, ' if r.ok else ''}{r.error[:300]}"
            for r in failures)
        Path(args.out).write_text(head + "\n" + body + tail + "\n")
        Path(args.out + ".json").write_text(json.dumps([asdict(r) for r in runs], indent=1))

    if args.speed:
        for c in configs:  # untimed first: JIT op builds and the compile cache (TORCHINDUCTOR_CACHE_DIR) warm
            for v in names:
                runner, extra = allv[v]
                job = C.Job(stage=CONFIGS[c][0], offload=CONFIGS[c][1], steps=6, warmup=1, preset=args.preset,
                            seq_len=args.seq_len, precision=precision)
                w = one(work, -1, c, runner, v, job, extra, args.timeout)
                if not w.ok:
                    runs.append(w)
        for rnd in range(args.rounds):
            for c in configs:
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for v in order:
                    runner, extra = allv[v]
                    job = C.Job(stage=CONFIGS[c][0], offload=CONFIGS[c][1], steps=args.steps, warmup=args.warmup,
                                preset=args.preset, seq_len=args.seq_len, precision=precision)
                    runs.append(one(work, rnd, c, runner, v, job, extra, args.timeout))
                    report()
    elif args.sweep:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for v in order:
                runner, extra = allv[v]
                job = C.Job(stage=3, steps=args.steps, warmup=args.warmup, preset=args.preset, seq_len=args.seq_len,
                            precision=precision)
                runs.append(one(work, rnd, "3", runner, v, job, extra, args.timeout))
                report()
    else:
        if not args.quick:
            # One short untimed run per runner and stage first: JIT op builds (fused_adam, cpu_adam,
            # shm comm), page cache and imports are then warm for every timed run, whichever goes first.
            for c in configs:
                stage, offload = CONFIGS[c]
                for r in runners:
                    job = C.Job(stage=stage, offload=offload, steps=2, warmup=1, preset=args.preset,
                                seq_len=args.seq_len, precision=precision)
                    w = one(work, -1, c, r, "warm-up", job, None, args.timeout)
                    if not w.ok:
                        runs.append(w)  # a runner that cannot start is reported, not silently skipped
        for rnd in range(args.rounds):
            for c in configs:
                stage, offload = CONFIGS[c]
                order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
                for r in order:
                    job = C.Job(stage=stage, offload=offload, steps=args.steps, warmup=args.warmup,
                                preset=args.preset, seq_len=args.seq_len, precision=precision)
                    runs.append(one(work, rnd, c, r, "default", job, None, args.timeout))
                    report()
    report(finished=True)
    shutil.rmtree(work, ignore_errors=True)
    print(Path(args.out).read_text())
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
