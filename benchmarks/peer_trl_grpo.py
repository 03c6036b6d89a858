"""Peer of benchmarks/grpo.py: TRL's `GRPOTrainer` on CPU, one trial, in one process (or on the ranks torchrun
starts, with DeepSpeed ZeRO-3 when the job says so).

    python benchmarks/peer_trl_grpo.py '<JOB_JSON>'
    torchrun --nproc_per_node 2 benchmarks/peer_trl_grpo.py '<JOB_JSON>'      (job "zero3": true)

JOB_JSON: {"model_dir", "data" (.jsonl of {prompt, target}), "reward" ("path.py:fn"), "steps", "lr", "seed",
"num_generations", "global_batch" (completions per optimizer step, all ranks), "max_completion_len", "temperature",
"beta", "loss_type", "scale_rewards", "out" (a directory), "zero3" (bool: DeepSpeed ZeRO-3 with the HF docs' block,
ds3_gather_for_generation=True: the whole model gathered once per generate call)}.

The trainer: GRPOConfig with everything zerotrain's run fixes set to the same value (TRL's GRPOConfig defaults differ
for some: bf16=True, gradient_checkpointing=True, learning_rate 1e-6): fp32, no gradient checkpointing, AdamW
(0.9/0.999, eps 1e-8, weight decay 0), constant LR, clip 1.0, per_device_train_batch_size = global_batch / world,
gradient_accumulation_steps 1 (so steps_per_generation 1: one generation per optimizer step), num_generations,
max_completion_length, temperature, top_p 1, top_k 0, beta, loss_type, scale_rewards, num_iterations 1,
logging_steps 1, use_cpu=True, report_to=[].

Timing, per rank with time.perf_counter (no barrier added): a step runs from the trainer's get_batch_samples (the
dataloader's next()) to on_step_end, so it holds the generation, the rewards, the forward/backward and the
optimizer step; "gen_s" is the time inside GRPOTrainer._generate_single_turn (transformers' generate under TRL's
unwrap_model_for_generation, the ZeRO-3 gather included) and "gen_tokens" the completion tokens it returned (up to
and including EOS). With several ranks each figure is the max (times) or sum (tokens) over ranks.

Writes <out>/metrics.jsonl (rank 0; one line per optimizer step: "step", "step_time_s", "gen_s", "gen_tokens" and
every number TRL logged for the step: reward, reward_std, rewards/<fn>/mean, loss, kl, entropy, ...) and
<out>/peer.json (versions, the job, init and train seconds).
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the reward file imports tests.support


def load_reward(spec: str):
    path, name = spec.rsplit(":", 1)
    s = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return getattr(mod, name)


class Clock(TrainerCallback):
    def __init__(self):
        self.fetch_t0 = 0.0
        self.gen_s = 0.0
        self.gen_tokens = 0
        self.step_s: list[float] = []
        self.gen: list[float] = []
        self.tokens: list[int] = []
        self.logs: list[dict] = []

    def on_step_end(self, args, state, control, **kw):
        self.step_s.append(time.perf_counter() - self.fetch_t0)
        self.gen.append(self.gen_s)
        self.tokens.append(self.gen_tokens)
        self.gen_s, self.gen_tokens = 0.0, 0

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append({"step": state.global_step, **logs})


def main() -> None:
    job = json.loads(sys.argv[1])
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    zero3 = bool(job.get("zero3"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import deepspeed
        from datetime import timedelta

        # HF Trainer with use_cpu=True does not initialise deepspeed.comm (it does on GPUs): do it first.
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)

    import datasets
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    extra = {}
    if zero3:
        from peer_hf_long_context import zero3_config

        extra = {"deepspeed": zero3_config(), "ds3_gather_for_generation": True}
    if job["global_batch"] % world:
        raise SystemExit(f"global_batch {job['global_batch']} is not a multiple of the world size {world}")
    args = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        seed=job["seed"], data_seed=job["seed"], per_device_train_batch_size=job["global_batch"] // world,
        gradient_accumulation_steps=1, num_generations=job["num_generations"],
        max_completion_length=job["max_completion_len"], temperature=job["temperature"], top_p=1.0, top_k=0,
        beta=job["beta"], loss_type=job["loss_type"], scale_rewards=job["scale_rewards"], num_iterations=1,
        max_steps=job["steps"], learning_rate=job["lr"], optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        logging_strategy="steps", logging_steps=1, logging_nan_inf_filter=False, save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, **extra)
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    train = datasets.load_dataset("json", data_files=job["data"], split="train")
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    clock = Clock()
    reward = load_reward(job["reward"])

    class TimedGRPOTrainer(GRPOTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            clock.fetch_t0 = time.perf_counter()
            return super().get_batch_samples(epoch_iterator, num_batches, device)

        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **kw)
            clock.gen_s += time.perf_counter() - t0
            clock.gen_tokens += sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

    t0 = time.perf_counter()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=train,
                               processing_class=tok, callbacks=[clock])
    init_s = time.perf_counter() - t0
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    del model
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    mine = {"step_s": clock.step_s, "gen_s": clock.gen, "gen_tokens": clock.tokens}
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        logs = {rec["step"]: rec for rec in clock.logs}
        with open(out / "metrics.jsonl", "w") as f:
            for k in range(len(clock.step_s)):
                rec = {key: v for key, v in logs.get(k + 1, {}).items() if isinstance(v, (int, float))}
                rec.update(step=k + 1, step_time_s=max(e["step_s"][k] for e in everyone),
                           gen_s=max(e["gen_s"][k] for e in everyone),
                           gen_tokens=sum(e["gen_tokens"][k] for e in everyone))
                f.write(json.dumps(rec) + "\n")
        meta = {"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                             "torch": torch.__version__, "datasets": datasets.__version__},
                "job": job, "world": world, "trainer_init_s": round(init_s, 2), "train_s": round(train_s, 2),
                "generation_batch_size": args.generation_batch_size,
                "steps_per_generation": args.steps_per_generation}
        (out / "peer.json").write_text(json.dumps(meta, indent=1, default=str))
    if world > 1:
        engine = trainer.model_wrapped
        if hasattr(engine, "destroy"):
            engine.destroy()
        trainer.model = trainer.model_wrapped = None
        del engine, trainer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
