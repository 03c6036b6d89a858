"""A tiny plain-DeepSpeed job for proving a (real or simulated) multi-host launch.

    deepspeed --hostfile H --master_addr 10.231.0.1 tests/support/multihost_probe.py --stage 2 --out losses.jsonl

Trains a two-layer MLP on fixed random data for a few steps at a ZeRO stage; rank 0 writes one
JSON line per step ({"step", "loss"}, loss averaged over ranks) and a final {"world": ...} line
with the world layout. The same losses come out under torchrun on one host.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)  # inserted by the deepspeed launcher
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per step (fault tests)")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps where a rank is stuck

    import deepspeed
    import torch

    from zerotrain.launch.launchers import format_world_layout

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    layout = format_world_layout()
    if rank == 0:
        print(layout, flush=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x_all = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    y_all = x_all.sum(dim=1, keepdim=True)
    micro = 64 // world // 4  # same global batch (16) whatever the world size
    ds_config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10 ** 9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    out = Path(args.out)
    for step in range(1, args.steps + 1):
        i = (step - 1) % 4
        batch = slice(i * 16 + rank * micro, i * 16 + (rank + 1) * micro)
        loss = torch.nn.functional.mse_loss(engine(x_all[batch]), y_all[batch])
        engine.backward(loss)
        engine.step()
        avg = loss.detach().clone()
        torch.distributed.all_reduce(avg)
        if rank == 0:
            with out.open("a") as f:
                f.write(json.dumps({"step": step, "loss": avg.item() / world}) + "\n")
            print(f"step {step} loss {avg.item() / world:.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    if rank == 0:
        with out.open("a") as f:
            f.write(json.dumps({"world": world, "layout": layout}) + "\n")
    # Clean teardown (zerotrain/distributed/process_group.py: objects holding process groups at exit can abort the process).
    del engine, model
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
