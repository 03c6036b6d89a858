"""Launched under torchrun by test_hf_trainer.py: HF Trainer with a shipped `--hf-auto` DeepSpeed config, then
zerotrain's engine on the micro-batches HF Trainer's first step saw, in the same ranks.

    torchrun --nproc_per_node 2 tests/support/hf_trainer_worker.py MODEL_DIR DS_JSON OUT.json

Both load the same saved weights, so the first step's loss (before any update) must agree: HF Trainer's logged
step-1 loss and zerotrain's mean over every rank's micro-batches of the same step (every row has the same number of
label tokens, so a per-token mean and a mean of micro-batch means coincide).
"""
import gc
import json
import sys
from datetime import timedelta

import deepspeed
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

MICRO, ACCUM, STEPS = 2, 2, 4


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 16, seq: int = 32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_trainer(model_dir: str, ds_json: str, out: str) -> tuple[dict, list[dict]]:
    """HF Trainer's run, and the micro-batches this rank's model saw in its first optimizer step."""
    args = TrainingArguments(output_dir=str(out) + ".trainer", deepspeed=ds_json, use_cpu=True,
                             per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, learning_rate=1e-3,
                             max_steps=STEPS, logging_steps=1, report_to=[], save_strategy="no", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # under zero.Init for a stage-3 config
    seen: list[dict] = []

    def record(_module, _args, kwargs):
        if len(seen) < ACCUM:
            seen.append({k: kwargs[k].detach().clone() for k in ("input_ids", "labels")})

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(model.config.vocab_size))
    trainer.train()
    hook.remove()
    engine = trainer.model_wrapped
    result = {"stage": engine.zero_optimization_stage(), "world": engine.world_size,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "micro": engine.train_micro_batch_size_per_gpu(), "accum": engine.gradient_accumulation_steps()}
    del trainer, engine, model
    gc.collect()
    return result, seen


def zerotrain_step1(model_dir: str, micro_batches: list[dict]) -> float:
    """zerotrain's engine (DeepSpeed ZeRO-3, fp32, the same batch shape) on those micro-batches: the step's loss,
    the mean over every rank's micro-batches."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from zerotrain.config.load import build_config
    from zerotrain.engine import build_engine

    unset_hf_deepspeed_config()  # HF's ZeRO-3 context would otherwise build zerotrain's model too
    cfg = build_config(overrides={"backend": "deepspeed", "zero.stage": 3, "precision.dtype": "fp32",
                                  "batch.micro_batch": MICRO, "batch.grad_accum": ACCUM, "run.seed": 0,
                                  "dist_timeout_s": 180})
    engine = build_engine(lambda: AutoModelForCausalLM.from_pretrained(model_dir), cfg, total_steps=1)
    engine.train()
    losses = engine.train_step(micro_batches)
    local = torch.tensor([sum(float(x) for x in losses) / len(losses)], dtype=torch.float64)
    torch.distributed.all_reduce(local)
    world = engine.world_size
    engine.close()  # barrier + destroy the process group
    return float(local) / world


def main():
    model_dir, ds_json, out = sys.argv[1:4]
    # HF Trainer with use_cpu=True does not initialise deepspeed.comm (it does on GPUs): do it first.
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=180))
    rank = torch.distributed.get_rank()
    result, seen = hf_trainer(model_dir, ds_json, out)
    # the label tokens of the step, as HF Trainer counts them for its divisor (num_items_in_batch: unshifted here,
    # since this GPT-2's loss_type is None) and as the loss sums them (shifted by one)
    counts = torch.tensor([sum(int(b["labels"].ne(-100).sum()) for b in seen),
                           sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in seen)], dtype=torch.float64)
    torch.distributed.all_reduce(counts)
    result["hf_divisor_tokens"], result["loss_tokens"] = counts.tolist()
    result["zerotrain_step1"] = zerotrain_step1(model_dir, seen)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    from zerotrain.distributed import process_group as dist

    dist.exit_cleanly(main())  # flush, then os._exit: no C++ teardown race of gloo's threads
