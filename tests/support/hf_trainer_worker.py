"""Launched under torchrun by test_hf_trainer.py: HF Trainer with a shipped `--hf-auto` DeepSpeed config.

    torchrun --nproc_per_node 2 tests/support/hf_trainer_worker.py MODEL_DIR DS_JSON OUT.json
"""
import json
import sys
from datetime import timedelta

import deepspeed
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 16, seq: int = 32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    model_dir, ds_json, out = sys.argv[1:4]
    # HF Trainer with use_cpu=True does not initialise deepspeed.comm (it does on GPUs): do it first.
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=180))
    args = TrainingArguments(output_dir=str(out) + ".trainer", deepspeed=ds_json, use_cpu=True,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                             max_steps=3, logging_steps=1, report_to=[], save_strategy="no", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # under zero.Init for a stage-3 config
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(model.config.vocab_size))
    trainer.train()
    engine = trainer.model_wrapped
    result = {"stage": engine.zero_optimization_stage(), "world": engine.world_size,
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "micro": engine.train_micro_batch_size_per_gpu(), "accum": engine.gradient_accumulation_steps()}
    if engine.global_rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    del trainer, engine, model
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
