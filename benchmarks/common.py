"""Shared by every benchmark runner: the job (model, data, batch), the step clock, the result file.

Every runner (zerotrain and the peers) trains the same job: the embedded `small-gpt2` HF model
directory (4 layers x 256, vocab 4096, built locally by zerotrain.assets.demo), the embedded corpus packed
into 128-token blocks, micro-batch 4, grad-accum 2, bf16 (fp32 on a CPU without native bf16 kernels),
AdamW lr 1e-4 (constant), clip 1.0, seed 0,
2 ranks. Each runner writes one JSON per rank: the wall-clock time of every optimizer-step end,
and per-rank model-state bytes counted from the tensors the DeepSpeed engine/optimizer hold.
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

SEQ_LEN = 128
MICRO_BATCH = 4
GRAD_ACCUM = 2
LR = 1e-4
CLIP = 1.0
SEED = 0
PRESET = "small-gpt2"


@dataclass
class Job:
    """What one runner is asked to do (passed on its command line as JSON)."""

    stage: int
    offload: bool = False
    """Stage 3 with optimizer and parameters offloaded to CPU."""
    steps: int = 12
    warmup: int = 4
    preset: str = PRESET
    seq_len: int = SEQ_LEN
    precision: str = "bf16"
    """"bf16" (fp32 master weights in the optimizer) or "fp32"; the same for every runner."""

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"


@dataclass
class Result:
    """One rank's figures."""

    rank: int
    step_ends: list[float] = field(default_factory=list)
    """perf_counter() at the end of every optimizer step (after the optimizer stepped)."""
    in_step: list[float] = field(default_factory=list)
    """Seconds inside each optimizer step, where the runner can see its start (else empty)."""
    model_state_bytes: dict[str, Any] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def default_precision() -> str:
    """bf16 where the CPU has oneDNN bf16 kernels (AVX-512 and newer); fp32 elsewhere, where torch's
    fallback bf16 matmul is ~50x slower than fp32 (benchmarks/results/bf16_matmul.json) and would time that kernel,
    not the frameworks."""
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def model_dir(preset: str = PRESET) -> Path:
    """The locally built HF model + tokenizer directory (same one for every runner)."""
    from zerotrain.assets.demo import ensure_tiny_model

    return ensure_tiny_model(preset)


def dataset(mdir: Path, seq_len: int = SEQ_LEN):
    """(train dataset, collate) from zerotrain's own pipeline, so every runner sees the same blocks."""
    from transformers import AutoTokenizer

    from zerotrain.config.load import build_config
    from zerotrain.data.datasets import prepare_data

    cfg = build_config(None, {"model.name": str(mdir), "data.seq_len": seq_len})
    data = prepare_data(cfg, AutoTokenizer.from_pretrained(str(mdir)))
    return data.train, data.collate


def model_state_bytes(engine: Any) -> dict[str, Any]:
    """zerotrain.memory.measure.measure_model_state_bytes of the engine, less its per-tensor "sources"."""
    from zerotrain.memory.measure import measure_model_state_bytes

    out = measure_model_state_bytes(engine)
    return {k: v for k, v in out.items() if k != "sources"}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_result(path: str | Path, res: Result) -> None:
    """Each rank writes PATH.rank<N>.json (bench.py reads them all)."""
    from zerotrain.util import peak_rss_bytes

    res.peak_rss_bytes = peak_rss_bytes()
    Path(f"{path}.rank{res.rank}.json").write_text(json.dumps(asdict(res)))


def teardown() -> None:
    """gc, then barrier + destroy (avoids the exit-time abort: zerotrain/distributed/process_group.py); the caller drops its
    engine and model references first."""
    gc.collect()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def now() -> float:
    return time.perf_counter()


def parse_job(argv: list[str]) -> tuple[Job, str, Optional[str]]:
    """`runner.py JOB_JSON RESULT_PREFIX [EXTRA_JSON]`."""
    job = Job(**json.loads(argv[1]))
    return job, argv[2], argv[3] if len(argv) > 3 else None


def hand_loop(engine: Any, train, collate, world: int, rank: int, steps: int) -> tuple[Result, float]:
    """The hand-written DeepSpeed loop every peer-style runner shares: DistributedSampler batches,
    engine(**batch) / engine.backward(loss) / engine.step() per micro-batch (DeepSpeed's contract),
    a time stamp at every optimizer-step end. Returns (result, last micro-batch loss)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=SEED)
    res = Result(rank=rank)
    engine.train()
    step, epoch, loss = 0, 0, None
    while step < steps:
        sampler.set_epoch(epoch)
        batches = iter(DataLoader(train, batch_size=MICRO_BATCH, sampler=sampler, collate_fn=collate, drop_last=True))
        while step < steps:
            t0 = now()
            try:
                for _ in range(GRAD_ACCUM):
                    loss = engine(**next(batches)).loss
                    engine.backward(loss)
                    engine.step()
            except StopIteration:
                break
            step += 1
            res.step_ends.append(now())
            res.in_step.append(res.step_ends[-1] - t0)
        epoch += 1
    return res, float(loss.detach())
