"""FSDP2 stage 3: host memory when only rank 0 reads the weights (zerotrain's ModelBuilder) vs every rank.

    .venv/bin/python benchmarks/rank0_load.py          # ~3 min on 2 CPU cores; writes benchmarks/results/rank0_load.json

A GPT-2 of 124 M parameters (transformers' GPT2Config() defaults, random weights) is saved once with
save_pretrained. Then, for each way of building, one 2-rank torchrun job builds an FSDP2 stage-3 engine
(`zerotrain.engine.build_engine`, fp32) and trains 2 steps on random tokens (micro-batch 2 x 256):
- "rank0": the ModelBuilder `zerotrain train` uses (ranks > 0 build on the meta device and receive their
  shards from rank 0);
- "every_rank": `lambda: AutoModelForCausalLM.from_pretrained(dir)`, every rank reading the weights.
Each rank records its peak RSS (VmHWM) after the engine is built and after the steps. docs/engine-api.md
quotes rank 1's figures.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "rank0_load.json"
MIB = 2**20


def rank_main(mode: str, model_dir: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from zerotrain import dist
    from zerotrain.config import build_config
    from zerotrain.engine import build_engine
    from zerotrain.model.source import resolve_model
    from zerotrain.util import peak_rss_bytes

    cfg = build_config(overrides={"backend": "fsdp", "zero.stage": 3, "model.name": model_dir,
                                  "precision.dtype": "fp32", "batch.micro_batch": 2, "data.seq_len": 256})
    if mode == "rank0":
        factory = resolve_model(cfg).factory()
    else:
        def factory():
            return AutoModelForCausalLM.from_pretrained(model_dir)
    engine = build_engine(factory, cfg, total_steps=2)
    after_build = peak_rss_bytes()
    torch.manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 50257, (2, 256))
        engine.train_step([{"input_ids": ids, "labels": ids}])
    after_steps = peak_rss_bytes()
    peaks = [None] * dist.env().world_size
    torch.distributed.all_gather_object(peaks, (after_build, after_steps))
    if dist.env().rank == 0:
        Path(out).write_text(json.dumps([{"rank": r, "after_build_mib": round(b / MIB), "after_steps_mib":
                                          round(s / MIB)} for r, (b, s) in enumerate(peaks)]))
    engine.close()
    dist.exit_cleanly(0)


def main() -> int:
    import tempfile

    from zerotrain.util import free_port

    work = Path(tempfile.mkdtemp(prefix="zt-rank0-"))
    model_dir = work / "gpt2-124m"
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    del model
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": "GPT2Config() (124 M)", "num_params": num_params,
              "fp32_mib": round(4 * num_params / MIB), "backend": "fsdp", "stage": 3, "world_size": 2, "runs": {}}
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    for mode in ("rank0", "every_rank"):
        out = work / f"{mode}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               __file__, "--rank-main", mode, str(model_dir), str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            return proc.returncode
        result["runs"][mode] = {"wall_s": round(time.perf_counter() - t0, 1), "ranks": json.loads(out.read_text())}
        print(mode, result["runs"][mode], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(*sys.argv[2:5])
    else:
        sys.exit(main())
