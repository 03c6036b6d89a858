"""Diagnostic runner: zerotrain's engine (build_engine) driven by the hand-written loop of peers/ds_loop.py.

    torchrun --nproc_per_node 2 benchmarks/peers/zt_engine.py '{"stage": 0}' /tmp/res

Splits a zerotrain-vs-loop gap into the engine adapter (this runner vs ds_loop) and the trainer
around it (zerotrain vs this runner).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402


def main() -> None:
    job, out, _ = C.parse_job(sys.argv)
    from transformers import AutoModelForCausalLM

    from zerotrain.config.load import build_config
    from zerotrain.engine import build_engine

    mdir = C.model_dir(job.preset)
    overrides = {"backend": "deepspeed", "zero.stage": job.stage, "precision.dtype": job.precision,
                 "batch.micro_batch": C.MICRO_BATCH, "batch.grad_accum": C.GRAD_ACCUM, "optimizer.lr": C.LR,
                 "optimizer.clip": C.CLIP, "schedule.name": "constant", "run.seed": C.SEED}
    if job.offload:
        overrides.update({"zero.offload_optimizer": "cpu", "zero.offload_param": "cpu"})
    cfg = build_config(None, overrides)
    engine = build_engine(lambda: AutoModelForCausalLM.from_pretrained(str(mdir)), cfg, total_steps=job.steps)
    world, rank = engine.world_size, engine.rank
    train, collate = C.dataset(mdir, job.seq_len)
    res, last_loss = C.hand_loop(engine, train, collate, world, rank, job.steps)
    res.model_state_bytes = C.model_state_bytes(engine._ds)
    res.extra["last_loss"] = last_loss
    C.write_result(out, res)
    engine.close()


if __name__ == "__main__":
    main()
