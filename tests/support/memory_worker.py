"""One rank of a memory measurement run: a tiny GPT-2, a few steps, model-state bytes and peak RSS.

    torchrun --nproc_per_node 2 tests/support/memory_worker.py --backend deepspeed --stage 2 --out DIR
    torchrun --nproc_per_node 2 tests/support/memory_worker.py --backend fsdp --stage 3 --tp 2 --model tiny-llama --out DIR

Independent of zerotrain's engine and trainer on purpose: it checks the estimator against raw
`deepspeed.initialize` / FSDP2 `fully_shard` with the DeepSpeed config zerotrain generates.
Writes DIR/rank{R}.json with the measurement (zerotrain.memory.measure.measure_model_state_bytes, taken
after the backward of the last step and before its optimizer step) and RSS figures.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["deepspeed", "fsdp"], default="deepspeed")
    p.add_argument("--model", default="tiny-gpt2")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload-optimizer", default="none")
    p.add_argument("--offload-param", default="none")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP: the model's HF tp_plan)")
    p.add_argument("--reduce-bucket-size", type=int, default=None, help="elements; None: zerotrain's rule")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (peft, all-linear; 0 = full fine-tuning)")
    p.add_argument("--out", required=True)
    return p.parse_args()


def build_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from zerotrain.model.facts import load_hf_config
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(load_hf_config(name))


def deepspeed_engine(a: argparse.Namespace):
    from zerotrain.plan.resolve import deepspeed_importable

    deepspeed_importable()  # imports deepspeed as zerotrain does (without its autotuner's mlflow import)
    import deepspeed

    from zerotrain.config.load import build_config
    from zerotrain.model.facts import ModelFacts, model_facts
    from zerotrain.plan.ds_config import build_ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    base = rss()
    cfg = build_config(overrides={"zero.stage": a.stage, "zero.offload_optimizer": a.offload_optimizer,
                                  "zero.offload_param": a.offload_param, "precision.dtype": a.precision,
                                  "batch.micro_batch": a.micro_batch, "batch.grad_accum": a.grad_accum,
                                  "zero.reduce_bucket_size": a.reduce_bucket_size})
    facts = model_facts(a.model)
    ds = build_ds_config(cfg, world_size=dist.get_world_size(),  # buckets sized from the model, no leaf blocks
                         model_facts=ModelFacts(facts.num_params, facts.hidden_size))
    if a.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = build_model(a.model)
    else:
        model = build_model(a.model)
    if a.lora_r:  # outside zero.Init, as zerotrain's engine does; initialize partitions the adapters
        from zerotrain.model.preparation import ModelPreparation

        model = ModelPreparation.from_config(build_config(overrides={"lora.r": a.lora_r})).apply(model)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
    return engine, base, ds


def fsdp_engine(a: argparse.Namespace):
    """zerotrain's own FSDP2/DDP engine (its gradient-sync and sharding choices are what we predict)."""
    from zerotrain.config.load import build_config
    from zerotrain.engine import build_engine

    cfg = build_config(overrides={"backend": "fsdp", "zero.stage": a.stage, "precision.dtype": a.precision,
                                  "batch.micro_batch": a.micro_batch, "batch.grad_accum": a.grad_accum,
                                  "optimizer.lr": 1e-3, "run.tune_malloc": False, "parallel.tp": a.tp,
                                  "lora.r": a.lora_r})
    base = rss()
    engine = build_engine(lambda: build_model(a.model), cfg, total_steps=a.steps)
    return engine, base, None


def rss() -> int:
    from zerotrain.util import rss_bytes
    return rss_bytes()


def main() -> None:
    a = parse()
    from zerotrain.memory.measure import measure_model_state_bytes
    from zerotrain.util import peak_rss_bytes
    rss_imports = rss()
    engine, rss_init, ds = deepspeed_engine(a) if a.backend == "deepspeed" else fsdp_engine(a)
    rank = dist.get_rank()
    rss_engine = rss()
    vocab = 1024
    g = torch.Generator().manual_seed(1000 + rank)
    measured = None
    # Measure after the first backward of the last optimizer step: optimizer states exist (one step
    # done) and gradients are mid-accumulation (see zerotrain.memory.measure.measure_model_state_bytes).
    n_micro = a.steps * a.grad_accum
    measure_at = (a.steps - 1) * a.grad_accum
    for micro in range(n_micro):
        ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if micro == measure_at:
            measured = measure_model_state_bytes(engine)
        engine.step()  # both engines step on the accumulation boundary only
    out = dict(rank=rank, world_size=dist.get_world_size(), backend=a.backend, stage=a.stage, model=a.model, tp=a.tp,
               lora_r=a.lora_r,
               offload_optimizer=a.offload_optimizer, offload_param=a.offload_param, precision=a.precision,
               measured=measured, peak_rss_bytes=peak_rss_bytes(), rss_after_imports=rss_imports,
               rss_after_init=rss_init, rss_after_engine=rss_engine, loss=float(loss))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    # Clean teardown (zerotrain/distributed/process_group.py): drop every object holding process groups, then barrier + destroy.
    if a.backend == "fsdp":
        engine.close()  # barrier + destroy inside
        return
    del engine
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
