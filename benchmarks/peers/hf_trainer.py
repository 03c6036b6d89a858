"""Peer (c): HF Trainer with `TrainingArguments(deepspeed=<config>)`, the config HF's docs show.

    torchrun --nproc_per_node 2 benchmarks/peers/hf_trainer.py '{"stage": 3}' /tmp/res [ZERO_OVERRIDES_JSON]

The DeepSpeed config follows the HuggingFace DeepSpeed integration docs' examples: "auto" for batch
sizes, clipping, optimizer params and bf16; stages 1/2 take the docs' ZeRO-2 block (allgather and
reduce buckets 2e8, overlap_comm, reduce_scatter, contiguous_gradients); stage 3 takes the docs'
ZeRO-3 block ("auto" reduce bucket / prefetch / persistence threshold, which HF fills from
hidden_size: h*h, 0.9*h*h, 10*h; max live/reuse 1e9; sub_group_size 1e9). Step ends are taken in
an `on_step_end` callback (after the optimizer step), step starts in `on_step_begin`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402
from peers import harness as H  # noqa: E402


def hf_docs_config(job: C.Job, overrides: dict) -> dict:
    if job.stage == 0:
        zero: dict = {"stage": 0}
    elif job.stage in (1, 2):
        zero = {"stage": job.stage, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                "contiguous_gradients": True}
    else:
        zero = dict(H.ZERO3)
    if job.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero.update(overrides)
    return H.auto_config(zero)


class Clock(TrainerCallback):
    def __init__(self, res: C.Result):
        self.res, self.t0 = res, 0.0

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = C.now()

    def on_step_end(self, args, state, control, **kw):
        self.res.step_ends.append(C.now())
        self.res.in_step.append(self.res.step_ends[-1] - self.t0)


def main() -> None:
    job, out, extra = C.parse_job(sys.argv)
    H.init_gloo()
    rank = torch.distributed.get_rank()
    mdir = C.model_dir(job.preset)
    train, collate = C.dataset(mdir, job.seq_len)
    args = TrainingArguments(
        output_dir=f"{out}.trainer", deepspeed=hf_docs_config(job, json.loads(extra or "{}")), use_cpu=True,
        bf16=job.bf16, per_device_train_batch_size=C.MICRO_BATCH, gradient_accumulation_steps=C.GRAD_ACCUM,
        learning_rate=C.LR, weight_decay=0.0, max_grad_norm=C.CLIP, lr_scheduler_type="constant",
        max_steps=job.steps, seed=C.SEED, logging_steps=10**6, save_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(str(mdir))  # under zero.Init for a stage-3 config
    res = C.Result(rank=rank)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=[Clock(res)])
    del model  # the trainer holds it; teardown must be able to drop every reference
    train_and_write(trainer, res, out)


def train_and_write(trainer: Trainer, res: C.Result, out: str) -> None:
    """Train, measure the DeepSpeed engine's model state, write this rank's result, tear down cleanly."""
    trainer.train()
    engine = trainer.model_wrapped
    res.model_state_bytes = C.model_state_bytes(engine)
    res.extra["zero_config"] = engine.config["zero_optimization"] if isinstance(engine.config, dict) else None
    C.write_result(out, res)
    H.release(trainer)
    del engine
    C.teardown()


if __name__ == "__main__":
    main()
