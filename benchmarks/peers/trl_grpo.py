"""Peer of benchmarks/grpo.py: TRL's `GRPOTrainer` on CPU, one trial, in one process (or on the ranks torchrun
starts, with DeepSpeed ZeRO-3 when the job says so).

    python benchmarks/peers/trl_grpo.py '<JOB_JSON>'
    torchrun --nproc_per_node 2 benchmarks/peers/trl_grpo.py '<JOB_JSON>'      (job "zero3": true)

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

import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the reward file imports tests.support
import common as C  # noqa: E402
from peers import harness as H  # noqa: E402


def load_reward(spec: str):
    path, name = spec.rsplit(":", 1)
    s = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return getattr(mod, name)


class Clock(H.StepClock):
    """The step clock, plus the seconds inside generation and the completion tokens it returned, per step."""

    def __init__(self):
        super().__init__()
        self.gen_s = 0.0
        self.gen_tokens = 0
        self.gen: list[float] = []
        self.tokens: list[int] = []

    def on_step_end(self, args, state, control, **kw):
        super().on_step_end(args, state, control, **kw)
        self.gen.append(self.gen_s)
        self.tokens.append(self.gen_tokens)
        self.gen_s, self.gen_tokens = 0.0, 0


def main() -> None:
    job = json.loads(sys.argv[1])
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    zero3 = bool(job.get("zero3"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        H.init_gloo()
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)

    import datasets
    from trl import GRPOConfig, GRPOTrainer

    extra = {}
    if zero3:
        extra = {"deepspeed": H.zero3_config(), "ds3_gather_for_generation": True}
    if job["global_batch"] % world:
        raise SystemExit(f"global_batch {job['global_batch']} is not a multiple of the world size {world}")
    args = GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=job["global_batch"] // world,
        gradient_accumulation_steps=1, num_generations=job["num_generations"],
        max_completion_length=job["max_completion_len"], temperature=job["temperature"], top_p=1.0, top_k=0,
        beta=job["beta"], loss_type=job["loss_type"], scale_rewards=job["scale_rewards"], num_iterations=1,
        **H.pinned(job), **extra)
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    train = datasets.load_dataset("json", data_files=job["data"], split="train")
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

    trainer, init_s, train_s = H.timed_train(
        TimedGRPOTrainer, AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32),
        reward_funcs=[reward], args=args, train_dataset=train, processing_class=tok, callbacks=[clock])
    everyone = H.gather({"step_s": clock.step_s, "gen_s": clock.gen, "gen_tokens": clock.tokens})
    if rank == 0:
        H.write_metrics(out / "metrics.jsonl", clock.logs,
                        [dict(step_time_s=max(e["step_s"][k] for e in everyone),
                              gen_s=max(e["gen_s"][k] for e in everyone),
                              gen_tokens=sum(e["gen_tokens"][k] for e in everyone)) for k in range(len(clock.step_s))])
        meta = {"versions": H.versions("trl", "transformers", "torch", "datasets"),
                "job": job, "world": world, "trainer_init_s": round(init_s, 2), "train_s": round(train_s, 2),
                "generation_batch_size": args.generation_batch_size,
                "steps_per_generation": args.steps_per_generation}
        (out / "peer.json").write_text(json.dumps(meta, indent=1, default=str))
    H.release(trainer)
    del trainer
    C.teardown()


if __name__ == "__main__":
    main()
