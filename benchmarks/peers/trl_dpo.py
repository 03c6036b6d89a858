"""Peer of benchmarks/dpo.py: TRL's `DPOTrainer` + DeepSpeed ZeRO-3 on the ranks torchrun starts, one trial.

    torchrun --nproc_per_node 2 benchmarks/peers/trl_dpo.py '<JOB_JSON>'

JOB_JSON: {"model_dir", "data" (.jsonl of {prompt, chosen, rejected}), "seq_len", "micro_batch", "grad_accum",
"steps", "lr", "beta", "seed", "out" (a directory), "zero" ("docs" | "defaults" | a zero_optimization dict),
"order" ("zerotrain" | "trl")}.

The trainer: DPOConfig with everything that zerotrain's run fixes set to the same value (TRL's own defaults differ
for several: bf16=True, gradient_checkpointing=True, learning_rate 1e-6, max_length 1024):
fp32 (bf16=False), no gradient checkpointing, AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0), constant LR,
clip 1.0, beta, sigmoid loss, max_length = seq_len (truncation keep_start), no pad-to-multiple, per-device batch =
micro_batch, grad-accum, max_steps, logging_steps 1, a live reference (precompute_ref_log_probs=False: TRL builds a
second copy of the model with from_pretrained under the same ZeRO-3 config and wraps it with
trl.models.utils.prepare_deepspeed, an engine without optimizer, partitioned like the policy).
DeepSpeed config: zero="docs" is the HF DeepSpeed docs' ZeRO-3 block with "auto" values that HF fills
(benchmarks/peers/harness.py zero3_config: optimizer block "AdamW" with "auto" params, so the optimizer is
DeepSpeed's AdamW as in zerotrain; `optim="adamw_torch"` is set too but HF ignores it when the config has an
optimizer block; HF fills reduce bucket / prefetch / persistence threshold from hidden_size); zero="defaults" is
the same without those three keys (DeepSpeed's own defaults); a dict replaces the whole zero_optimization block
(benchmarks/dpo.py passes zerotrain's own, from the run's ds_config.json: leaf modules, bucket sizes). TRL's
reference engine (prepare_deepspeed) takes the policy's config without its optimizer.

Data order: order="zerotrain" makes the global order the one zerotrain trains on (torch's DistributedSampler per
rank, shuffle seed = --seed, epoch 0, drop_last, the way zerotrain/data/datasets.py ResumableSampler draws), laid out
so that accelerate's BatchSamplerShard (batch i to rank i % world) gives each rank zerotrain's micro-batches: the
same pairs in the same steps on both sides, so their losses and log-probs can be compared step by step.
order="trl" keeps HF's own RandomSampler.

Timing, per rank with time.perf_counter (no barrier added anywhere): a step starts when the trainer starts fetching
its micro-batches (get_batch_samples: the dataloader's next() and the collator, as zerotrain's StepTimer starts
before it draws a step's micro-batches) and ends in on_step_end (after clip, optimizer.step, scheduler, zero_grad;
HF's logging of the step comes after it, outside). "in_step_s" is on_step_begin..on_step_end (HF's own window,
without the data fetch). After training the per-rank lists are all-gathered and each step's figure is the max over
ranks (zerotrain: the max over ranks of each rank's own step time). tokens: non-padding tokens (attention_mask) of
the step's micro-batches, summed over ranks (zerotrain's count).

Writes <out>/metrics.jsonl (rank 0; one line per optimizer step: "step", "loss" (the trainer's logged loss, mean
over ranks), "step_time_s", "in_step_s", "tokens", "tokens_per_s" and every figure TRL logged for the step:
rewards/*, logps/*, logits/*, entropy, ...) and <out>/peer.json (versions, the DeepSpeed configs the policy and
reference engines ran with, the optimizer class, dataset-prep seconds, pairs).
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, peers
import common as C  # noqa: E402
from peers import harness as H  # noqa: E402

FROM_HIDDEN = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
"""The ZeRO-3 keys HF's "auto" derives from hidden_size (zero="defaults" leaves them to DeepSpeed)."""


class ZerotrainOrder(Sampler[int]):
    """The global order that makes accelerate's batch sharding hand each rank zerotrain's micro-batches."""

    def __init__(self, n: int, world: int, micro_batch: int, seed: int):
        per_rank = []
        for r in range(world):
            s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=seed, drop_last=True)
            s.set_epoch(0)
            per_rank.append(list(s))
        batches = len(per_rank[0]) // micro_batch
        self.order = [i for k in range(batches) for r in range(world)
                      for i in per_rank[r][k * micro_batch:(k + 1) * micro_batch]]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


class Clock(H.StepClock):
    """The step clock, plus the seconds inside the step (on_step_begin to on_step_end) and the tokens fetched."""

    def __init__(self):
        super().__init__()
        self.begin_t0: float = 0.0
        self.fetch_tokens: int = 0
        self.in_step_s: list[float] = []
        self.tokens: list[int] = []

    def on_step_begin(self, args, state, control, **kw):
        self.begin_t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        super().on_step_end(args, state, control, **kw)
        self.in_step_s.append(time.perf_counter() - self.begin_t0)
        self.tokens.append(self.fetch_tokens)


def main() -> None:
    job = json.loads(sys.argv[1])
    # torch.distributed's deprecation warnings, printed on every ZeRO-3 collective here (zerotrain filters them too)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    H.init_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)

    import datasets
    from trl import DPOConfig, DPOTrainer

    ds_config = H.zero3_config()
    zero = job.get("zero", "docs")
    if zero == "defaults":
        for k in FROM_HIDDEN:
            ds_config["zero_optimization"].pop(k)
    elif isinstance(zero, dict):  # a whole zero_optimization block, used as it is
        ds_config["zero_optimization"] = dict(zero)
    args = DPOConfig(
        output_dir=str(out / "trainer"), deepspeed=ds_config, disable_dropout=True,
        per_device_train_batch_size=job["micro_batch"], gradient_accumulation_steps=job["grad_accum"],
        dataloader_drop_last=True, **H.pinned(job), beta=job["beta"], loss_type=["sigmoid"],
        max_length=job["seq_len"], truncation_mode="keep_start", pad_to_multiple_of=None,
        precompute_ref_log_probs=False)
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    train = datasets.load_dataset("json", data_files=job["data"], split="train")
    clock = Clock()
    order = job.get("order", "zerotrain")

    class TimedDPOTrainer(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            if order != "zerotrain":
                return super()._get_train_sampler(train_dataset)
            ds = train_dataset if train_dataset is not None else self.train_dataset
            return ZerotrainOrder(len(ds), world, job["micro_batch"], job["seed"])

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            clock.fetch_t0 = time.perf_counter()
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            clock.fetch_tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))
            return batches, n

    # the model is built under zero.Init (ZeRO-3); init seconds: dataset tokenization, reference model, its engine
    trainer, init_s, train_s = H.timed_train(
        TimedDPOTrainer, AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32), ref_model=None,
        args=args, train_dataset=train, processing_class=tok, callbacks=[clock])
    everyone = H.gather({"step_s": clock.step_s, "in_step_s": clock.in_step_s, "tokens": clock.tokens})
    engine = trainer.model_wrapped
    ref = trainer.ref_model
    if rank == 0:
        rows = []
        for k in range(len(clock.step_s)):
            step_time = max(e["step_s"][k] for e in everyone)
            tokens = sum(e["tokens"][k] for e in everyone)
            rows.append(dict(step_time_s=step_time, in_step_s=max(e["in_step_s"][k] for e in everyone), tokens=tokens,
                             tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
                             step_time_s_per_rank=[e["step_s"][k] for e in everyone]))
        H.write_metrics(out / "metrics.jsonl", clock.logs, rows)
        opt = getattr(engine, "optimizer", None)
        inner = getattr(opt, "optimizer", opt)
        meta = {"versions": H.versions("trl", "transformers", "deepspeed", "torch"),
                "job": job, "pairs": len(train), "tokenized_pairs": len(trainer.train_dataset),
                "trainer_init_s": round(init_s, 2), "train_s": round(train_s, 2),
                "policy_ds_config": engine.config if isinstance(getattr(engine, "config", None), dict) else None,
                "ref_ds_config": ref.config if isinstance(getattr(ref, "config", None), dict) else None,
                "ref_engine": type(ref).__name__, "optimizer": f"{type(opt).__name__} / {type(inner).__name__}",
                "first_row_tokenized": {k: v for k, v in trainer.train_dataset[0].items()
                                        if isinstance(v, list)}}
        (out / "peer.json").write_text(json.dumps(meta, indent=1, default=str))

    H.release(trainer, ref)
    del engine, ref, trainer
    C.teardown()


if __name__ == "__main__":
    main()
