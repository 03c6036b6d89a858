"""Peer (d): Accelerate with its DeepSpeed plugin, the loop Accelerate's docs show.

    torchrun --nproc_per_node 2 benchmarks/peers/accelerate_loop.py '{"stage": 3}' /tmp/res

`DeepSpeedPlugin(zero_stage, gradient_accumulation_steps=2, gradient_clipping=1.0, offload_*_device)`
and `Accelerator(mixed_precision="bf16" (or "no" for fp32), deepspeed_plugin=...)`: the plugin's generated config sets no
bucket/prefetch/persistence keys, so those are DeepSpeed's defaults. A torch AdamW is passed to
`prepare` (Accelerate swaps in DeepSpeedCPUAdam when the optimizer is offloaded). The loop is
`with accelerator.accumulate(model): backward; optimizer.step(); zero_grad()`; a step ends when
`accelerator.sync_gradients` is true after optimizer.step().
"""
from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402


def main() -> None:
    job, out, _ = C.parse_job(sys.argv)
    off = "cpu" if job.offload else "none"
    plugin = DeepSpeedPlugin(zero_stage=job.stage, gradient_accumulation_steps=C.GRAD_ACCUM,
                             gradient_clipping=C.CLIP, offload_optimizer_device=off, offload_param_device=off,
                             zero3_init_flag=job.stage == 3)
    # On a machine without an accelerator, Accelerate picks no backend (world size 1) unless told
    # gloo; cpu=True would turn the DeepSpeed path off altogether.
    acc = Accelerator(mixed_precision="bf16" if job.bf16 else "no", deepspeed_plugin=plugin, gradient_accumulation_steps=C.GRAD_ACCUM,
                      kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=300))])
    mdir = C.model_dir(job.preset)
    train, collate = C.dataset(mdir, job.seq_len)
    torch.manual_seed(C.SEED)
    model = AutoModelForCausalLM.from_pretrained(str(mdir))  # zero.Init under stage 3 (zero3_init_flag)
    opt = torch.optim.AdamW(model.parameters(), lr=C.LR, weight_decay=0.0)
    dl = DataLoader(train, batch_size=C.MICRO_BATCH, shuffle=True, collate_fn=collate, drop_last=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    res = C.Result(rank=acc.process_index)
    model.train()
    step, t0 = 0, C.now()
    while step < job.steps:
        for batch in dl:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                step += 1
                res.step_ends.append(C.now())
                res.in_step.append(res.step_ends[-1] - t0)
                t0 = res.step_ends[-1]
                if step >= job.steps:
                    break
    res.model_state_bytes = C.model_state_bytes(model)
    res.extra["zero_config"] = model.config["zero_optimization"]
    res.extra["distributed_type"] = str(acc.distributed_type)
    C.write_result(out, res)
    model.destroy()
    del acc, opt, dl, model
    C.teardown()


if __name__ == "__main__":
    main()
