"""HF Trainer peers of benchmarks/long_context.py: one trial (one sequence length), one torchrun job.

    torchrun --nproc_per_node 2 benchmarks/peers/hf_long_context.py '<JOB_JSON>'

JOB_JSON: {"model_dir", "data", "seq_len", "sp", "steps", "out"}.
- sp 1: HF Trainer + DeepSpeed ZeRO-3 (the HF docs' ZeRO-3 block, as benchmarks/peers/hf_trainer.py), plain
  data parallel: every rank trains its own sample of seq_len tokens (micro-batch 1, grad-accum 1).
- sp 2: HF Trainer + DeepSpeed ZeRO-3 + ALST/Ulysses sequence parallelism through accelerate's
  `ParallelismConfig(sp_backend="deepspeed", sp_size=2)` (TrainingArguments.parallelism_config): the two
  ranks train ONE sample of seq_len tokens, each holding seq_len/2 of it (DeepSpeed's
  UlyssesSPDataLoaderAdapter shards the batch, UlyssesSPAttentionHF swaps heads and sequence around attention).
The text file is tokenized with the model directory's tokenizer and packed into seq_len blocks with EOS
between lines, the way `zerotrain train --pack` does. Each rank writes <out>/peak_rank{R}.json (VmHWM, read
after training) and rank 0 <out>/steps.json (seconds inside each optimizer step).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402
from peers import harness as H  # noqa: E402


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def blocks(model_dir: str, data: str, seq_len: int, n: int) -> list[dict]:
    """n packed blocks of seq_len tokens (input_ids = labels, position_ids 0..seq_len-1)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    with open(data) as f:
        for line in f:
            if line.strip():
                ids.extend(tok(line.rstrip("\n"))["input_ids"])
                ids.append(tok.eos_token_id)
            if len(ids) >= n * seq_len:
                break
    if len(ids) < n * seq_len:
        raise ValueError(f"{data}: {len(ids)} tokens, fewer than {n} blocks of {seq_len}")
    out = []
    for i in range(n):
        x = torch.tensor(ids[i * seq_len:(i + 1) * seq_len], dtype=torch.long)
        out.append({"input_ids": x, "labels": x.clone(), "position_ids": torch.arange(seq_len)})
    return out


class Clock(TrainerCallback):
    def __init__(self):
        self.t0, self.in_step = 0.0, []

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.in_step.append(time.perf_counter() - self.t0)


def main() -> None:
    job = json.loads(sys.argv[1])
    seq_len, sp, steps, out = int(job["seq_len"]), int(job.get("sp", 1)), int(job.get("steps", 2)), job["out"]
    H.init_gloo()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.makedirs(out, exist_ok=True)
    extra: dict = {}
    if sp > 1:
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=seq_len, sp_seq_length_is_variable=True,
                                                       sp_attn_implementation="sdpa"))
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), deepspeed=H.zero3_config(), use_cpu=True, bf16=False,
        per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=1e-4, weight_decay=0.0,
        max_grad_norm=1.0, lr_scheduler_type="constant", max_steps=steps, seed=0, logging_steps=10**6,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, **extra)
    # data-parallel replicas: world / sp; each reads one sample per step
    train = blocks(job["model_dir"], job["data"], seq_len, steps * max(world // sp, 1))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], attn_implementation="sdpa")  # zero.Init (ZeRO-3)
    seen: list = []  # the input_ids shape each rank's model sees (ALST: seq_len / sp)
    model.get_input_embeddings().register_forward_pre_hook(lambda m, a: seen.append(list(a[0].shape)))
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[clock])
    del model
    result = trainer.train()
    with open(os.path.join(out, f"peak_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_rss_bytes": vm_hwm(), "in_step_s": clock.in_step, "input_shapes": seen,
                   "train_loss": result.training_loss}, f)
    if rank == 0:
        with open(os.path.join(out, "steps.json"), "w") as f:
            json.dump({"in_step_s": clock.in_step}, f)
    H.release(trainer)
    del trainer
    C.teardown()


if __name__ == "__main__":
    main()
