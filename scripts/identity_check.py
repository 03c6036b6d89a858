"""Identity check for refactors: the same inputs must give byte-identical outputs before and after.

Runs whatever `zerotrain` the current interpreter imports (set PYTHONPATH to an old checkout to run
the old code; the commands run from a neutral working directory so the current directory never
shadows it) and either writes the outputs or compares them with a directory written earlier:

    # baseline from the old code (a worktree of the commit before the refactor)
    PYTHONPATH=/tmp/zt_base python scripts/identity_check.py config --write /tmp/baseline
    # the new code, compared with it (exit 1 on any difference)
    python scripts/identity_check.py config --compare /tmp/baseline
    # two runs' metrics.jsonl: loss, lr and grad_norm bit for bit, step by step
    python scripts/identity_check.py metrics /tmp/baseline/demo/metrics.jsonl runs/demo/metrics.jsonl

`config` covers `zerotrain config --all` (every shipped preset, into DIR/config_all/) and a grid of
flag combinations (DIR/config_grid/<name>.json = stdout, .err = stderr, .rc = exit code). stdout and
the exit code must match byte for byte; stderr is compared after dropping DeepSpeed's timestamped log
lines and writing the zerotrain source root as <ZT>.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> `zerotrain config` arguments. Names starting with err_ are expected to be refused (rc 2).
GRID: dict[str, list[str]] = {
    "default": [],
    **{f"stage{s}": ["--stage", str(s)] for s in range(4)},
    "stage1_offload_opt": ["--stage", "1", "--offload-optimizer", "cpu"],
    "stage2_offload_opt": ["--stage", "2", "--offload-optimizer", "cpu"],
    "stage3_offload_both": ["--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"],
    "stage3_offload_nvme": ["--stage", "3", "--offload-optimizer", "nvme", "--offload-param", "nvme",
                            "--nvme-path", "/local_nvme"],
    "stage3_bf16": ["--stage", "3", "--precision", "bf16"],
    "stage2_bf16_ws8": ["--stage", "2", "--precision", "bf16", "--world-size", "8"],
    "stage0_ws2": ["--stage", "0", "--world-size", "2"],
    "fp16": ["--precision", "fp16"],
    "global_batch_ws2": ["--global-batch", "32", "--micro-batch", "4", "--world-size", "2"],
    "global_batch_ws8_stage3": ["--stage", "3", "--global-batch", "64", "--micro-batch", "2", "--world-size", "8"],
    "cosine_100": ["--max-steps", "100", "--schedule", "cosine", "--warmup-steps", "10"],
    "linear_100": ["--max-steps", "100", "--schedule", "linear", "--min-lr-ratio", "0.1"],
    "constant_100": ["--max-steps", "100", "--schedule", "constant", "--warmup-steps", "5"],
    "hf_auto_stage2": ["--hf-auto", "--stage", "2"],
    "hf_auto_stage3_offload_bf16": ["--hf-auto", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu",
                                    "--precision", "bf16"],
    "tiny_llama_stage3": ["--model-config", "tiny-llama", "--stage", "3"],
    "tiny_llama_stage3_hf_auto": ["--model-config", "tiny-llama", "--stage", "3", "--hf-auto"],
    "tiny_llama_stage3_leaf": ["--model-config", "tiny-llama", "--stage", "3", "--leaf-blocks"],
    "small_gpt2_stage3_ws2": ["--model-config", "small-gpt2", "--stage", "3", "--world-size", "2"],
    "small_gpt2_stage2_bf16_cosine": ["--model-config", "small-gpt2", "--stage", "2", "--precision", "bf16",
                                      "--max-steps", "100", "--schedule", "cosine"],
    "ds_override_sub_group": ["--stage", "3", "--ds-override", "zero_optimization.sub_group_size=1e8"],
    "ds_override_two": ["--ds-override", "wall_clock_breakdown=true", "--ds-override", "steps_per_print=10"],
    "buckets_stage2": ["--stage", "2", "--reduce-bucket-size", "1000000", "--allgather-bucket-size", "2000000",
                       "--no-overlap-comm"],
    "knobs_stage3": ["--stage", "3", "--prefetch-bucket-size", "100000", "--param-persistence-threshold", "0",
                     "--max-live-parameters", "1000000"],
    "sgd_stage1": ["--stage", "1", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"],
    "adam_clip0_wd": ["--optimizer", "adam", "--clip", "0", "--weight-decay", "0.1"],
    "tp2_ws4": ["--tp", "2", "--world-size", "4", "--stage", "1"],
    "tp2_ws4_tiny_llama": ["--tp", "2", "--world-size", "4", "--stage", "2", "--model-config", "tiny-llama"],
    "pp2_ws4": ["--pp", "2", "--world-size", "4", "--stage", "1"],
    "pp2_ws4_tiny_gpt2_gb": ["--pp", "2", "--world-size", "4", "--model-config", "tiny-gpt2", "--global-batch", "16",
                             "--micro-batch", "2"],
    "err_stage0_offload": ["--stage", "0", "--offload-optimizer", "cpu"],
    "err_offload_param_stage2": ["--stage", "2", "--offload-param", "cpu"],
    "err_global_batch_indivisible": ["--global-batch", "30", "--micro-batch", "4", "--world-size", "2"],
    "err_ds_override_conflict": ["--ds-override", "zero_optimization.stage=1"],
    "err_ds_override_auto": ["--ds-override", "zero_optimization.sub_group_size=auto"],
    "err_pp3_ws4": ["--pp", "3", "--world-size", "4"],
    "err_sgd_offload": ["--stage", "2", "--offload-optimizer", "cpu", "--optimizer", "sgd"],
}

_DS_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] \[[A-Z]+\] .*\n?", re.M)
METRIC_KEYS = ("loss", "lr", "grad_norm")


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error")
    return env


def _zerotrain_root(cwd: str) -> Path:
    out = subprocess.run([sys.executable, "-c", "import zerotrain; print(zerotrain.__file__)"], cwd=cwd,
                         env=_env(), capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return Path(out).resolve().parents[1]


def _zt(args: list[str], cwd: str) -> tuple[str, str, int]:
    p = subprocess.run([sys.executable, "-m", "zerotrain", *args], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=300)
    return p.stdout, p.stderr, p.returncode


def _norm_err(text: str, root: Path) -> str:
    return _DS_LOG.sub("", text).replace(str(root), "<ZT>")


def run_config(out: Path, names: list[str] | None = None) -> tuple[Path, Path]:
    """Run --all and the grid into out/config_all and out/config_grid; return (zerotrain root, out)."""
    cwd = tempfile.mkdtemp(prefix="zt_identity_")
    root = _zerotrain_root(cwd)
    print(f"zerotrain imported from {root}", file=sys.stderr)
    grid_dir, all_dir = out / "config_grid", out / "config_all"
    grid_dir.mkdir(parents=True, exist_ok=True)
    if names is None:
        if all_dir.exists():
            shutil.rmtree(all_dir)
        so, se, rc = _zt(["config", "--all", str(all_dir)], cwd)
        (out / "config_all.rc").write_text(f"{rc}\n")
        (out / "config_all.err").write_text(se)
        (out / "config_all.out").write_text(so.replace(str(all_dir), "<DIR>"))
        print(f"  config --all -> {all_dir} (rc {rc})", file=sys.stderr)
    for name in names or GRID:
        so, se, rc = _zt(["config", *GRID[name]], cwd)
        (grid_dir / f"{name}.json").write_text(so)
        (grid_dir / f"{name}.err").write_text(se)
        (grid_dir / f"{name}.rc").write_text(f"{rc}\n")
        print(f"  {name}: rc {rc}", file=sys.stderr)
    (out / "zerotrain_root.txt").write_text(f"{root}\n")
    shutil.rmtree(cwd, ignore_errors=True)
    return root, out


def _files(d: Path) -> dict[str, Path]:
    return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


def _diff(a: str, b: str, label: str, limit: int = 30) -> str:
    lines = list(difflib.unified_diff(a.splitlines(), b.splitlines(), f"baseline/{label}", f"now/{label}",
                                      lineterm="", n=1))
    more = f"\n    ... {len(lines) - limit} more diff lines" if len(lines) > limit else ""
    return "\n".join("    " + s for s in lines[:limit]) + more


def compare_config(baseline: Path) -> int:
    """Run the same commands now and compare with baseline; print a summary; return the number of differences."""
    with tempfile.TemporaryDirectory(prefix="zt_identity_now_") as tmp:
        now = Path(tmp)
        root, _ = run_config(now)
        base_root = Path((baseline / "zerotrain_root.txt").read_text().strip()) \
            if (baseline / "zerotrain_root.txt").exists() else root
        problems: list[str] = []
        checked = 0
        # presets
        for fname in ("config_all.rc", "config_all.out"):
            checked += 1
            a, b = (baseline / fname).read_text(), (now / fname).read_text()
            if a != b:
                problems.append(f"{fname} differs\n{_diff(a, b, fname)}")
        fa, fb = _files(baseline / "config_all"), _files(now / "config_all")
        for rel in sorted(set(fa) | set(fb)):
            checked += 1
            if rel not in fb:
                problems.append(f"config_all/{rel}: missing now")
            elif rel not in fa:
                problems.append(f"config_all/{rel}: new (not in baseline)")
            elif fa[rel].read_bytes() != fb[rel].read_bytes():
                problems.append(f"config_all/{rel} differs\n"
                                f"{_diff(fa[rel].read_text(), fb[rel].read_text(), 'config_all/' + rel)}")
        # grid
        base_names = {p.stem for p in (baseline / "config_grid").glob("*.rc")}
        for name in sorted(base_names - set(GRID)):
            problems.append(f"grid {name}: in baseline, not in this script's GRID")
        for name in GRID:
            if name not in base_names:
                problems.append(f"grid {name}: not in baseline")
                continue
            checked += 1
            g, n = baseline / "config_grid", now / "config_grid"
            for ext in ("rc", "json"):
                a, b = (g / f"{name}.{ext}").read_text(), (n / f"{name}.{ext}").read_text()
                if a != b:
                    problems.append(f"grid {name}.{ext} differs\n{_diff(a, b, name + '.' + ext)}")
            a = _norm_err((g / f"{name}.err").read_text(), base_root)
            b = _norm_err((n / f"{name}.err").read_text(), root)
            if a != b:
                problems.append(f"grid {name}.err differs\n{_diff(a, b, name + '.err')}")
    print(f"config identity: {checked} outputs compared ({len(GRID)} grid cases + presets), "
          f"{len(problems)} difference(s); baseline {baseline} from {base_root}, now from {root}")
    for p in problems:
        print(" - " + p)
    return len(problems)


def _train_lines(path: Path) -> dict[int, dict]:
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "loss" in row:
                rows[row["step"]] = row
    return rows


def compare_metrics(a: Path, b: Path, steps: str | None = None) -> int:
    """loss, lr and grad_norm of every training step, bitwise; return the number of differences."""
    ra, rb = _train_lines(a), _train_lines(b)
    if steps:
        lo, _, hi = steps.partition("-")
        keep = range(int(lo), int(hi or lo) + 1)
        ra, rb = ({s: r for s, r in rows.items() if s in keep} for rows in (ra, rb))
    problems = [f"step {s}: only in {a if s in ra else b}" for s in sorted(set(ra) ^ set(rb))]
    for s in sorted(set(ra) & set(rb)):
        for k in METRIC_KEYS:
            x, y = ra[s].get(k), rb[s].get(k)
            same = x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
            if not same:
                rel = abs(x - y) / max(abs(x), 1e-300) if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None
                problems.append(f"step {s} {k}: {x!r} vs {y!r}" + (f" (rel {rel:.3g})" if rel is not None else ""))
    common = len(set(ra) & set(rb))
    print(f"metrics identity: {common} common steps x {len(METRIC_KEYS)} keys, {len(problems)} difference(s) "
          f"({a} vs {b})")
    for p in problems[:50]:
        print(" - " + p)
    if len(problems) > 50:
        print(f" ... {len(problems) - 50} more")
    return len(problems)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="zerotrain config: shipped presets + a flag grid")
    mode = c.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="DIR", type=Path, help="write the outputs under DIR")
    mode.add_argument("--compare", metavar="DIR", type=Path, help="compare with the outputs written under DIR")
    c.add_argument("--list", action="store_true", help="print the grid and exit")
    m = sub.add_parser("metrics", help="two metrics.jsonl: loss, lr, grad_norm bitwise")
    m.add_argument("a", type=Path)
    m.add_argument("b", type=Path)
    m.add_argument("--steps", help="only these steps, e.g. 3-4")
    args = p.parse_args(argv)
    if args.cmd == "metrics":
        return 1 if compare_metrics(args.a, args.b, args.steps) else 0
    if args.list:
        for name, flags in GRID.items():
            print(f"{name}: zerotrain config {' '.join(flags)}")
        return 0
    if args.write:
        run_config(args.write)
        print(f"wrote {args.write}/config_all and {args.write}/config_grid ({len(GRID)} cases)")
        return 0
    return 1 if compare_config(args.compare) else 0


if __name__ == "__main__":
    sys.exit(main())
