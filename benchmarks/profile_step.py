"""Where each millisecond of one optimizer step goes: zerotrain's loop beside the hand-written DeepSpeed loop.

    .venv/bin/python benchmarks/profile_step.py --stages 0,3 --rounds 2 --out benchmarks/results/step_profile
    torchrun --nproc_per_node 2 benchmarks/profile_step.py --rank-job RUNNER JOB_JSON PREFIX   (what the driver launches)

Both runners train benchmarks/common.py's job (the bench.py comparison's) on 2 ranks. Instead of cProfile (its
per-call cost inflates Python-heavy code unevenly), every function named in PROBES is wrapped by a perf_counter
timer that records its EXCLUSIVE wall time (a probe called inside another is subtracted from the outer one) and
when it ran. A step is the interval between two consecutive optimizer-step ends (what bench.py times); each probe's
time is booked to the step whose interval it ran in, and "not probed" is the rest of the interval (Python between
the probes, the interpreter's own work). Per runner and stage: the median per step after the warm-up steps, per
rank, then the median over ranks and rounds. The table's last column is zerotrain minus the loop.

Writes OUT.md (the tables) and OUT.json (every step of every rank of every run). Run it with nothing else on the
machine (FACTS.md: a benchmark beside another job is meaningless here).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common as C  # noqa: E402

PROBES: list[tuple[str, str, str]] = [tuple(row) for row in yaml.safe_load((HERE / "profile_probes.yaml").read_text())]
"""(category, module, qualified attribute) of every timed function (benchmarks/profile_probes.yaml)."""
STEP_END = {"zerotrain": ("zerotrain.train.trainer", "Trainer._train_step")}
"""zerotrain: a step ends when Trainer._train_step returns (as bench.py's run_zerotrain.py times it)."""
NOT_PROBED = "not probed (Python between the probes)"


class Recorder:
    """Exclusive wall time of every probed call, with the perf_counter() when it ended."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, float]] = []
        """(end time, category, exclusive seconds) of every probed call."""
        self._stack: list[float] = []
        """Seconds spent in probes nested inside each open probe."""
        self.skipped: list[str] = []

    def wrap(self, category: str, module: str, attr: str) -> None:
        import importlib

        try:
            owner: Any = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            inner = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        except (ImportError, AttributeError, KeyError):
            self.skipped.append(f"{module}.{attr}")
            return
        rec = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            rec._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                nested = rec._stack.pop()
                if rec._stack:
                    rec._stack[-1] += t1 - t0
                rec.calls.append((t1, category, t1 - t0 - nested))

        timed.__wrapped__ = inner  # type: ignore[attr-defined]
        setattr(owner, name, timed)  # a module-level function is looked up by its global name: patched there


READS = "host reads of a tensor's value by zerotrain's code (count)"
"""Tensor.item / float() / int() / bool() / tolist() called from a zerotrain module: on a GPU each waits for the
device (a host sync); on CPU ranks they cost nothing, so they are counted, not timed."""


def count_reads(rec: Recorder) -> None:
    import torch

    for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
        inner = getattr(torch.Tensor, name)

        def counted(self, *args, _inner=inner, **kwargs):  # noqa: ANN001
            caller = sys._getframe(1).f_code.co_filename
            if "/zerotrain/" in caller:  # the package's own modules (not DeepSpeed's, torch's or this script's)
                rec.calls.append((time.perf_counter(), READS, 1.0))
            return _inner(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def per_step(rec: Recorder, step_ends: list[float]) -> list[dict[str, float]]:
    """Probe seconds booked to each step interval (step_ends[i-1], step_ends[i]]; the first step has no start."""
    out: list[dict[str, float]] = []
    for a, b in zip(step_ends, step_ends[1:]):
        row: dict[str, float] = defaultdict(float)
        for end, cat, secs in rec.calls:
            if a < end <= b:
                row[cat] += secs
        row["step"] = b - a
        row[NOT_PROBED] = row["step"] - sum(v for k, v in row.items() if k not in ("step", READS))
        out.append(dict(row))
    return out


def rank_job(runner: str, job_json: str, prefix: str, log_every: str = "1") -> None:
    """One rank: probes on, then the runner's usual code (bench.py's zerotrain runner or the hand loop)."""
    job = C.Job(**json.loads(job_json))
    rec = Recorder()
    for cat, module, attr in PROBES:
        rec.wrap(cat, module, attr)
    count_reads(rec)
    ends: list[float] = []
    if runner in ("zerotrain", "zerotrain_before"):  # the latter: an older commit's zerotrain on PYTHONPATH
        from zerotrain import cli
        from zerotrain.train import trainer

        inner = trainer.Trainer._train_step

        def step(self, *args, **kwargs):  # noqa: ANN001 - the step's signature differs between versions
            out = inner(self, *args, **kwargs)
            ends.append(time.perf_counter())
            return out

        trainer.Trainer._train_step = step
        trainer.Trainer.save = lambda self: None  # the end-of-run checkpoint is not a step
        run = Path(f"{prefix}.run{C.rank()}")
        argv = ["train", "--model", str(C.model_dir(job.preset)), "--seq-len", str(job.seq_len), "--stage",
                str(job.stage), "--precision", job.precision, "--micro-batch", str(C.MICRO_BATCH), "--grad-accum",
                str(C.GRAD_ACCUM), "--lr", str(C.LR), "--clip", str(C.CLIP), "--seed", str(C.SEED), "--max-steps",
                str(job.steps), "--output", str(run), "--overwrite", "--backend", "deepspeed", "--schedule",
                "constant", "--no-save-final", "--log-every", log_every]
        code = cli.main(argv)
        if code:
            raise SystemExit(code)
    else:
        from peers.ds_loop import run as run_loop

        ends = run_loop(job, {})[0].step_ends  # the benchmark's hand-written loop, probed
    steps = per_step(rec, ends)
    Path(f"{prefix}.rank{C.rank()}.json").write_text(json.dumps({"steps": steps, "skipped": rec.skipped}))


def launch(runner: str, job: C.Job, prefix: Path, timeout: float, pythonpath: str, log_every: int) -> int:
    import os

    from zerotrain.launch.subprocess_run import run_with_timeout
    from zerotrain.util import free_port

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
               PYTHONPATH=pythonpath)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(Path(__file__).resolve()), "--rank-job",
           runner, json.dumps(asdict(job)), str(prefix), str(log_every)]
    res = run_with_timeout(cmd, timeout, env=env, cwd=HERE.parent, merge_stderr=True)
    if res.returncode != 0:
        print(res.stdout[-3000:], file=sys.stderr)
    return res.returncode


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(runs: list[dict[str, Any]], warmup: int) -> dict[tuple[int, str], dict[str, float]]:
    """(stage, runner) -> category -> median ms per step (over the timed steps of every rank of every round)."""
    table: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for rank_steps in run["ranks"]:
            timed = rank_steps[max(warmup - 1, 0):]  # rank_steps[i] is step i+2
            cats = {k for s in timed for k in s}
            for cat in cats:
                table[(run["stage"], run["runner"])][cat].append(median([s.get(cat, 0.0) for s in timed]) * 1e3)
    return {key: {cat: median(v) for cat, v in cats.items()} for key, cats in table.items()}


def render(summary: dict[tuple[int, str], dict[str, float]], stages: list[int], runners: list[str]) -> str:
    lines = []
    cats = [c for c, _, _ in PROBES]
    order = list(dict.fromkeys(cats + [NOT_PROBED, "step", READS]))
    for stage in stages:
        head = [f"stage {stage}: ms per optimizer step (median)", *runners, f"{runners[0]} - {runners[-1]}"]
        lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for cat in order:
            vals = [summary.get((stage, r), {}).get(cat, 0.0) for r in runners]
            if not any(abs(v) >= 0.005 for v in vals):
                continue
            name = f"**{cat}**" if cat == "step" else cat
            if cat == READS:  # a count, not milliseconds (summarize scaled every category by 1e3)
                vals = [v / 1e3 for v in vals]
            lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {vals[0] - vals[-1]:+.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-job":
        rank_job(*sys.argv[2:6])
        return 0
    import os
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="0,3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--runners", default="zerotrain,ds_loop")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--log-every", type=int, default=1, help="zerotrain's --log-every (its default: 1)")
    ap.add_argument("--before", default="", metavar="REF", help="also profile zerotrain_before: git REF's zerotrain "
                    "(exported to a temporary folder, first on its ranks' PYTHONPATH), in the same rounds")
    ap.add_argument("--out", required=True, help="OUT.md and OUT.json are written")
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    runners = args.runners.split(",")
    precision = C.default_precision()
    pythonpath = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    paths = {r: pythonpath for r in runners}
    if args.before:
        import subprocess

        root = Path(tempfile.mkdtemp(prefix="zt-before-"))
        archive = subprocess.run(["git", "archive", args.before, "zerotrain"], cwd=HERE.parent, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        runners.insert(1, "zerotrain_before")
        paths["zerotrain_before"] = os.pathsep.join([str(root), pythonpath])
    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="zt-profile-"))
    for rnd in range(args.rounds):
        for stage in stages:
            order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
            for runner in order:
                job = C.Job(stage=stage, steps=args.steps, warmup=args.warmup, precision=precision)
                prefix = work / f"r{rnd}-s{stage}-{runner}"
                rc = launch(runner, job, prefix, args.timeout, paths[runner], args.log_every)
                ranks = [json.loads(p.read_text())["steps"] for p in sorted(work.glob(prefix.name + ".rank*.json"))]
                runs.append({"round": rnd, "stage": stage, "runner": runner, "rc": rc, "ranks": ranks})
                step = summarize([runs[-1]], args.warmup).get((stage, runner), {}).get("step", 0.0)
                print(f"  round {rnd} stage {stage} {runner:>10}: {step:.1f} ms/step (rc {rc})", flush=True)
    summary = summarize([r for r in runs if r["rc"] == 0], args.warmup)
    md = (f"{args.rounds} rounds x stages {args.stages}, {args.steps} steps ({args.warmup} warm-up), precision "
          f"{precision}, zerotrain --log-every {args.log_every}, benchmarks/common.py's job on 2 ranks\n\n"
          + render(summary, stages, runners))
    Path(f"{args.out}.md").write_text(md)
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "precision": precision, "runs": runs},
                                                   indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
