"""README's main job, run exactly as README.md prints it, timed: the figures README and docs/training.md quote.

    .venv/bin/python benchmarks/demo_run.py            # ~1 min on 2 CPU cores once DeepSpeed's JIT ops are cached

Takes the command from README.md's first bash block (the part after the last `&&`: the `deepspeed` launcher
line), points `--output` at a scratch directory, runs it, and writes benchmarks/results/demo.json: the command,
wall seconds of the whole command, and from the run's metrics.jsonl the number of optimizer steps, the first and
last loss, the summed step times (training alone) and the largest peak RSS a step reported (largest rank).
tests/unit/test_figures.py checks that the docs quote these values.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "demo.json"


def readme_command() -> list[str]:
    """The demo command of README.md's first bash block, as argv (.venv/bin/ -> this interpreter's bin/)."""
    block = re.search(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), re.S).group(1)
    launch = block.split("&&")[-1].strip()
    argv = shlex.split(launch)
    argv[0] = str(Path(sys.executable).parent / Path(argv[0]).name)
    return argv


def main() -> int:
    argv = readme_command()
    with tempfile.TemporaryDirectory(prefix="zt-demo-") as tmp:
        run_dir = Path(tmp) / "demo"
        argv[argv.index("--output") + 1] = str(run_dir)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return proc.returncode
        steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in steps if "loss" in m and "step" in m]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    import torch

    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "command": shlex.join(argv),
              "wall_s": round(wall, 1), "steps": len(steps), "loss_first": steps[0]["loss"],
              "loss_last": steps[-1]["loss"], "train_s": round(sum(m["step_time_s"] for m in steps), 1),
              "peak_rss_mib": round(max(m["peak_mem_bytes"] for m in steps) / 2**20),
              "native_cpu_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
              "cpu_count": os.cpu_count()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
