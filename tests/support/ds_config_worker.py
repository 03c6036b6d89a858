"""Launched under torchrun by test_ds_config_train.py: train a tiny GPT-2 with a raw DeepSpeed loop from each
generated JSON in turn (one process group for all), print the per-step losses as JSON on rank 0.

    torchrun --nproc_per_node 2 tests/support/ds_config_worker.py OUT.json ds_configs/zero0.json ds_configs/zero3.json ...
"""
import gc
import json
import sys
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from zerotrain.assets.demo import TINY_PRESETS

STEPS = 3


def batches(rank: int, world: int, micro: int, accum: int):
    """The same deterministic global batches every step (so the loss must fall); each rank takes its slice."""
    g = torch.Generator().manual_seed(0)
    vocab = TINY_PRESETS["tiny-gpt2"]["vocab_size"]
    fixed = [torch.randint(0, vocab, (micro * world, 32), generator=g) for _ in range(accum)]
    for _ in range(STEPS):
        for full in fixed:
            yield full[rank * micro:(rank + 1) * micro]


def train_one(path: str) -> list[float]:
    ds = json.loads(open(path).read())
    torch.manual_seed(0)
    kw = {k: v for k, v in TINY_PRESETS["tiny-gpt2"].items() if k != "model_type"}
    model = GPT2LMHeadModel(GPT2Config(**kw))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    losses, acc = [], 0.0
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    for i, ids in enumerate(batches(engine.global_rank, engine.world_size, micro, accum)):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        acc += loss.item() / accum
        if (i + 1) % accum == 0:
            t = torch.tensor([acc])
            dist.all_reduce(t)
            losses.append(t.item() / engine.world_size)
            acc = 0.0
    stage = engine.zero_optimization_stage()
    assert stage == ds["zero_optimization"]["stage"], (stage, path)
    del engine, model
    gc.collect()
    return losses


def main():
    out, paths = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=180))
    results = {p: train_one(p) for p in paths}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
