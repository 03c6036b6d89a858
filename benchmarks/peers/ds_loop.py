"""Peer (b): a hand-written DeepSpeed loop with DeepSpeed's DEFAULT config values.

    torchrun --nproc_per_node 2 benchmarks/peers/ds_loop.py '{"stage": 3}' /tmp/res [OVERRIDES_JSON]

The config sets only what the job needs: stage, batch sizes, bf16 (when the job is bf16), the optimizer (AdamW, lr 1e-4)
and gradient_clipping 1.0 (part of the job, as zerotrain/HF/Accelerate all clip at 1.0); stage 3
offload adds offload_optimizer/offload_param to cpu. Everything else (buckets, prefetch,
persistence threshold, overlap_comm) is DeepSpeed's default. OVERRIDES_JSON is merged into
zero_optimization (used only for experiments, never by the default benchmark).
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402


def ds_config(job: C.Job, world: int, overrides: dict) -> dict:
    zero: dict = {"stage": job.stage}
    if job.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    zero.update(overrides)
    return {
        **({"bf16": {"enabled": True}} if job.bf16 else {}),
        "train_micro_batch_size_per_gpu": C.MICRO_BATCH,
        "gradient_accumulation_steps": C.GRAD_ACCUM,
        "train_batch_size": C.MICRO_BATCH * C.GRAD_ACCUM * world,
        "gradient_clipping": C.CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": C.LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def run(job: C.Job, overrides: dict) -> tuple[C.Result, float]:
    """The loop on this rank: (its step ends and model-state bytes, the last micro-batch's loss); torn down after.
    benchmarks/profile_step.py runs the same loop with its probes on."""
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mdir = C.model_dir(job.preset)
    train, collate = C.dataset(mdir, job.seq_len)
    torch.manual_seed(C.SEED)
    model = AutoModelForCausalLM.from_pretrained(str(mdir))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(job, world, overrides))
    res, last_loss = C.hand_loop(engine, train, collate, world, rank, job.steps)
    res.model_state_bytes = C.model_state_bytes(engine)
    engine.destroy()
    del engine, model
    C.teardown()
    return res, last_loss


def main() -> None:
    job, out, extra = C.parse_job(sys.argv)
    res, last_loss = run(job, json.loads(extra or "{}"))
    res.extra["last_loss"] = last_loss
    C.write_result(out, res)


if __name__ == "__main__":
    main()
