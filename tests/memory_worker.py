"""One rank of a memory measurement run: a tiny GPT-2, a few steps, model-state bytes and peak RSS.

    torchrun --nproc_per_node 2 tests/memory_worker.py --backend deepspeed --stage 2 --out DIR

Independent of zerotrain's engine and trainer on purpose: it checks the estimator against raw
`deepspeed.initialize` / FSDP2 `fully_shard` with the DeepSpeed config zerotrain generates.
Writes DIR/rank{R}.json with the measurement (zerotrain.memory.measure_model_state_bytes, taken
after the backward of the last step and before its optimizer step) and RSS figures.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


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
    p.add_argument("--reduce-bucket-size", type=int, default=None, help="elements; None: zerotrain's rule")
    p.add_argument("--out", required=True)
    return p.parse_args()


def build_model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from zerotrain.model_info import load_hf_config
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(load_hf_config(name))


def deepspeed_engine(a: argparse.Namespace):
    import deepspeed

    from zerotrain.config import build_config
    from zerotrain.ds_config import ModelSize, build_ds_config
    from zerotrain.model_info import model_shape

    deepspeed.init_distributed(dist_backend="gloo")
    base = rss()
    cfg = build_config(overrides={"zero.stage": a.stage, "zero.offload_optimizer": a.offload_optimizer,
                                  "zero.offload_param": a.offload_param, "precision.dtype": a.precision,
                                  "batch.micro_batch": a.micro_batch, "batch.grad_accum": a.grad_accum,
                                  "zero.reduce_bucket_size": a.reduce_bucket_size})
    shape = model_shape(a.model)
    ds = build_ds_config(cfg, world_size=dist.get_world_size(),
                         model_size=ModelSize(shape.num_params, shape.hidden_size))
    if a.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = build_model(a.model)
    else:
        model = build_model(a.model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine, base, ds


def fsdp_engine(a: argparse.Namespace):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    base = rss()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(a.model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if a.precision == "bf16" else MixedPrecisionPolicy()
    reshard = a.stage == 3  # FSDP2: reshard_after_forward=True is ZeRO-3, False is ZeRO-2
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class Eng(SimpleNamespace):
        def __call__(self, **kw):
            return self.module(**kw)

        def backward(self, loss):
            loss.backward()

        def step(self):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    return Eng(module=model, optimizer=opt), base, None


def rss() -> int:
    from zerotrain.memory import rss_bytes
    return rss_bytes()


def main() -> None:
    a = parse()
    from zerotrain.memory import measure_model_state_bytes, peak_rss_bytes
    rss_imports = rss()
    engine, rss_init, ds = deepspeed_engine(a) if a.backend == "deepspeed" else fsdp_engine(a)
    rank = dist.get_rank()
    rss_engine = rss()
    vocab = 1024
    g = torch.Generator().manual_seed(1000 + rank)
    measured = None
    # Measure after the first backward of the last optimizer step: optimizer states exist (one step
    # done) and gradients are mid-accumulation (see zerotrain.memory.measure_model_state_bytes).
    n_micro = a.steps * a.grad_accum
    measure_at = (a.steps - 1) * a.grad_accum
    for micro in range(n_micro):
        ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if micro == measure_at:
            measured = measure_model_state_bytes(engine)
        boundary = (micro + 1) % a.grad_accum == 0
        if a.backend == "deepspeed" or boundary:
            engine.step()
    out = dict(rank=rank, world_size=dist.get_world_size(), backend=a.backend, stage=a.stage,
               offload_optimizer=a.offload_optimizer, offload_param=a.offload_param, precision=a.precision,
               measured=measured, peak_rss_bytes=peak_rss_bytes(), rss_after_imports=rss_imports,
               rss_after_init=rss_init, rss_after_engine=rss_engine, loss=float(loss))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    # Clean teardown (FACTS.md): drop every object holding process groups, then barrier + destroy.
    del engine
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
