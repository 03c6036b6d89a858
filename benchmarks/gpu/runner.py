"""One training job on a GPU (or, for testing, on the CPU over gloo): zerotrain, the hand-written DeepSpeed loop,
or HF Trainer, all on the same model directory, data file, batch, sequence length and precision.

    torchrun --nproc_per_node 1 benchmarks/gpu/runner.py JOB_JSON RESULT.json
    (benchmarks/gpu/drive.py starts it directly with the environment torchrun gives its one worker)

JOB_JSON: {"runner": "zerotrain"|"ds_loop"|"hf_trainer", "stage": 3, "offload": false, "steps": 12, "model": DIR,
"model_config": null (a config.json: zerotrain trains it from scratch, tokenizer from DIR), "data": FILE,
"seq_len": 2048, "micro_batch": 4, "grad_accum": 2, "precision": "bf16", "grad_ckpt": false, "torch_adam": false,
"extra_args": [] (more `zerotrain train` flags, e.g. --compile)}

The GPU counterparts of benchmarks/run_zerotrain.py, peers/ds_loop.py and peers/hf_trainer.py (which are written for
CPU ranks over gloo and are left as they are): the DeepSpeed configs are those scripts' own functions
(peers.ds_loop.ds_config: DeepSpeed's defaults; peers.hf_trainer.hf_docs_config: the HF docs' config), with the batch
sizes of this job. Each runner writes the wall time of every optimizer-step end, taken after
torch.cuda.synchronize() (so the step's device work is included; zerotrain reads its loss once per step anyway),
and the peak GPU memory torch allocated.

zerotrain runs as `zerotrain.cli.main(["train", ...])` (what `python -m zerotrain train` runs), with the two
read-only hooks of benchmarks/run_zerotrain.py and its end-of-run checkpoint skipped (a 1B model's fp32 optimizer
state is ~13 GB to write after the timed steps).
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: common, peers.ds_loop, peers.hf_trainer

import torch  # noqa: E402

SEED, LR, CLIP = 0, 1e-4, 1.0


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def peak_gpu() -> int:
    return int(torch.cuda.max_memory_allocated()) if cuda() else 0


class Clock:
    def __init__(self):
        self.step_ends: list[float] = []
        self.in_step: list[float] = []
        self.t0 = time.perf_counter()

    def begin(self):
        self.t0 = time.perf_counter()

    def end(self):
        sync()
        t = time.perf_counter()
        self.step_ends.append(t)
        self.in_step.append(t - self.t0)


def write(path: str, job: dict, clock: Clock, **extra) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    from zerotrain.util import peak_rss_bytes

    Path(path).write_text(json.dumps({"job": job, "step_ends": clock.step_ends, "in_step": clock.in_step,
                                      "peak_gpu_bytes": peak_gpu(), "peak_rss_bytes": peak_rss_bytes(), **extra}))


def peer_config(ds: dict, job: dict) -> dict:
    """torch_adam: DeepSpeed steps with torch.optim.AdamW instead of its JIT-built FusedAdam (the driver's
    fallback when that build fails on the machine; every runner then gets it)."""
    if job.get("torch_adam") and not job.get("offload"):  # offloaded states step with DeepSpeedCPUAdam anyway
        ds["optimizer"].setdefault("params", {})["torch_adam"] = True
    return ds


def configure_common(job: dict):
    import common as C

    C.MICRO_BATCH, C.GRAD_ACCUM, C.SEQ_LEN = job["micro_batch"], job["grad_accum"], job["seq_len"]
    return C.Job(stage=job["stage"], offload=job.get("offload", False), steps=job["steps"], seq_len=job["seq_len"],
                 precision=job["precision"])


def dataset(job: dict):
    """(train dataset, collate) through zerotrain's own pipeline: the blocks zerotrain trains on."""
    from transformers import AutoTokenizer

    from zerotrain.config.load import build_config
    from zerotrain.data.datasets import prepare_data

    cfg = build_config(None, {"model.name": job["model"], "data.seq_len": job["seq_len"], "data.path": job["data"]})
    data = prepare_data(cfg, AutoTokenizer.from_pretrained(job["model"]))
    return data.train, data.collate


# --- zerotrain -------------------------------------------------------------------------------------------------

def run_zerotrain(job: dict, out: str) -> int:
    from zerotrain import cli
    from zerotrain.plan import ds_config as zt_ds_config
    from zerotrain.train import trainer

    if job.get("torch_adam") and not job.get("offload"):  # see peer_config; zerotrain refuses optimizer.* in --ds-override, so patch here
        make = zt_ds_config._optimizer

        def with_torch_adam(*a, **kw):
            opt = make(*a, **kw)
            opt["params"]["torch_adam"] = True
            return opt

        zt_ds_config._optimizer = with_torch_adam
    clock = Clock()
    train_step, fit = trainer.Trainer._train_step, trainer.Trainer.fit

    def timed_step(self, *args, **kwargs):  # whatever the trainer passes (issue 53: the fetched micro-batches)
        clock.begin()
        rec = train_step(self, *args, **kwargs)
        clock.end()
        return rec

    def measured_fit(self):
        summary = fit(self)
        write(out, job, clock, summary=summary, ds_config=self.engine.ds_config,
              last_loss=self.history[-1]["loss"] if self.history else None)
        return summary

    trainer.Trainer._train_step, trainer.Trainer.fit = timed_step, measured_fit
    trainer.Trainer.save = lambda self: None  # see the docstring
    run_dir = Path(out + ".run")
    argv = ["train", "--model", job["model"], "--data", job["data"], "--seq-len", str(job["seq_len"]),
            "--stage", str(job["stage"]), "--precision", job["precision"], "--micro-batch", str(job["micro_batch"]),
            "--grad-accum", str(job["grad_accum"]), "--lr", str(LR), "--clip", str(CLIP), "--seed", str(SEED),
            "--max-steps", str(job["steps"]), "--schedule", "constant", "--log-every", "1",
            "--output", str(run_dir), "--overwrite", "--no-save-final", "--backend", "deepspeed"]
    if job.get("model_config"):
        argv += ["--model-config", job["model_config"]]
    if job.get("offload"):
        argv += ["--offload-optimizer", "cpu", "--offload-param", "cpu"]
    if job.get("grad_ckpt"):
        argv += ["--gradient-checkpointing"]
    argv += job.get("extra_args", [])
    print("zerotrain", " ".join(argv), flush=True)
    return cli.main(argv)


# --- the hand-written DeepSpeed loop -----------------------------------------------------------------------------

def init_dist():
    import deepspeed

    if cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if cuda() else "gloo", timeout=timedelta(seconds=600))
    return torch.distributed.get_world_size(), torch.distributed.get_rank()


def run_ds_loop(job: dict, out: str) -> int:
    import deepspeed
    from peers.ds_loop import ds_config
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoModelForCausalLM

    cjob = configure_common(job)
    world, rank = init_dist()
    train, collate = dataset(job)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(job["model"])
    if job.get("grad_ckpt"):
        model.gradient_checkpointing_enable()
    config = peer_config(ds_config(cjob, world, {}), job)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dev = engine.device
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=SEED)
    clock, step, epoch, loss = Clock(), 0, 0, None
    engine.train()
    mb, ga = job["micro_batch"], job["grad_accum"]
    while step < job["steps"]:
        sampler.set_epoch(epoch)
        batches = iter(DataLoader(train, batch_size=mb, sampler=sampler, collate_fn=collate, drop_last=True,
                                  pin_memory=cuda()))
        while step < job["steps"]:
            clock.begin()
            try:
                for _ in range(ga):
                    batch = {k: v.to(dev, non_blocking=True) for k, v in next(batches).items()}
                    loss = engine(**batch).loss
                    engine.backward(loss)
                    engine.step()
            except StopIteration:
                break
            float(loss.detach())  # one read per step, as zerotrain does
            clock.end()
            step += 1
        epoch += 1
    write(out, job, clock, last_loss=float(loss.detach()), ds_config=config)
    engine.destroy()
    del engine, model
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


# --- HF Trainer ----------------------------------------------------------------------------------------------

def run_hf_trainer(job: dict, out: str) -> int:
    from peers.hf_trainer import hf_docs_config
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    cjob = configure_common(job)
    if not cuda():
        init_dist()  # HF Trainer on CPU does not initialise deepspeed.comm (peers/hf_trainer.py)
    clock = Clock()

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.end()

    ds = peer_config(hf_docs_config(cjob, {}), job)
    args = TrainingArguments(
        output_dir=out + ".trainer", deepspeed=ds, use_cpu=not cuda(), bf16=job["precision"] == "bf16",
        per_device_train_batch_size=job["micro_batch"], gradient_accumulation_steps=job["grad_accum"],
        learning_rate=LR, weight_decay=0.0, max_grad_norm=CLIP, lr_scheduler_type="constant", max_steps=job["steps"],
        seed=SEED, logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=bool(job.get("grad_ckpt")))
    train, collate = dataset(job)
    model = AutoModelForCausalLM.from_pretrained(job["model"])  # under zero.Init for a stage-3 config
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=[Stamp()])
    del model
    trainer.train()
    engine = trainer.model_wrapped
    write(out, job, clock, ds_config=engine.config if isinstance(engine.config, dict) else None)
    engine.destroy()
    trainer.model = trainer.model_wrapped = None
    del engine
    import gc

    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def main() -> int:
    job, out = json.loads(sys.argv[1]), sys.argv[2]
    fn = {"zerotrain": run_zerotrain, "ds_loop": run_ds_loop, "hf_trainer": run_hf_trainer}[job["runner"]]
    return fn(job, out)


if __name__ == "__main__":
    sys.exit(main())
