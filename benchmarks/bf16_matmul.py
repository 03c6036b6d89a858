"""bf16 vs fp32 matrix multiply on this CPU: the figure behind the bf16 warning (plan/parallel_rules.check_backend) and
`zerotrain doctor`'s bf16 line. Writes the raw timings as JSON.

    python benchmarks/bf16_matmul.py --out benchmarks/results/bf16_matmul.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_matmul(dtype: torch.dtype, m: int, k: int, n: int, repeats: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    a @ b  # warm-up (kernel selection)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=3, default=(512, 256, 1024), metavar=("M", "K", "N"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)  # one rank's thread (tests and launches set OMP_NUM_THREADS=1)
    m, k, n = a.shape
    load = os.getloadavg()
    fp32 = time_matmul(torch.float32, m, k, n, a.repeats)
    bf16 = time_matmul(torch.bfloat16, m, k, n, a.repeats)
    result = {"cpu": cpu_model(), "native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
              "torch": torch.__version__, "threads": 1, "shape": [m, k, n], "loadavg_before": load,
              "fp32_s": fp32, "bf16_s": bf16, "fp32_median_s": statistics.median(fp32),
              "bf16_median_s": statistics.median(bf16),
              "bf16_over_fp32": statistics.median(bf16) / statistics.median(fp32)}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
