"""Serving latency of exported models on this machine's CPU: eager and `torch.compile`d, at a prefill batch and a
decode-like batch, every model timed in interleaved rounds so the machine's noise falls on all of them alike.

Compiled means `torch.compile(model)` with `torch._inductor.config.freezing = True`: inductor freezing treats
the weights as constants, which is what lets it pre-pack them and apply oneDNN's int8 kernels to a quantized
graph (PT2E's int8 pattern is lowered only then; the global config, not torch.compile's options=, is what
reaches that pass on torch 2.13: with options= the prepack op fails under fake tensors). Each shape compiles
its own graph (dynamic=False), as a server that pads to fixed buckets would.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

Forward = Callable[[torch.Tensor], torch.Tensor]
"""input_ids [batch, seq] -> logits."""

MODES = ("eager", "compiled")


@dataclass(frozen=True)
class ServeShape:
    name: str
    """'prefill' or 'decode': the key in the timings."""
    batch: int
    """Rows per forward."""
    seq: int
    """Tokens per row."""


def serve_shapes(batch: int, seq: int) -> tuple[ServeShape, ...]:
    """The prefill batch (batch x seq tokens) and a decode-like step: batch 1, one token, the matmul shapes of one
    generated token (no KV cache: the exported programs compute logits for the tokens they are given)."""
    return ServeShape("prefill", batch, seq), ServeShape("decode", 1, 1)


def compiled(forward: Forward) -> Forward:
    """The compiled serving path; compile happens at the first call, which must run under freezing()."""
    return torch.compile(forward, dynamic=False)


def freezing():
    """Inductor's freezing on for the calls inside (compiles happen at a call, so timed calls go inside too)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True)


def serve_ids(shape: ServeShape, vocab: int) -> torch.Tensor:
    """The token ids every model is timed (and compared) on at a shape: seeded, the same in every process."""
    return torch.randint(0, vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def measure(models: dict[str, Forward], vocab: int, shapes: tuple[ServeShape, ...], modes: tuple[str, ...] = MODES,
            rounds: int = 7) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """{model: {mode: {shape: {median_ms, min_ms, max_ms}}}}: every model in every mode at every shape, timed in
    interleaved rounds after two warm-up calls each (the first call of a compiled model compiles it)."""
    runs = {(name, mode): (compiled(fwd) if mode == "compiled" else fwd) for name, fwd in models.items() for mode in modes}
    out: dict = {name: {mode: {} for mode in modes} for name in models}
    # Every HF model is called through the same forward code (LogitsOnly), and each model and shape is a graph of its
    # own: past dynamo's recompile limit (8) further models would run eager without a word, so the limit is raised
    # to what is compiled here, and a hit raises instead of falling back.
    import torch._dynamo.config as dynamo_config

    with freezing(), dynamo_config.patch(recompile_limit=max(8, len(runs) * len(shapes) + 8),
                                          fail_on_recompile_limit_hit=True):
        _time(runs, vocab, shapes, rounds, out)
    return out


def _time(runs: dict[tuple[str, str], Forward], vocab: int, shapes: tuple[ServeShape, ...], rounds: int,
          out: dict) -> None:
    from tqdm.auto import tqdm

    for shape in tqdm(shapes, desc="timing", unit="shape", leave=False):
        ids = serve_ids(shape, vocab)
        for fwd in runs.values():
            fwd(ids)
            fwd(ids)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        for _ in range(rounds):
            for key, fwd in runs.items():
                t0 = time.perf_counter()
                fwd(ids)
                times[key].append(time.perf_counter() - t0)
        for (name, mode), t in times.items():
            out[name][mode][shape.name] = {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                                           "max_ms": 1e3 * max(t)}


def ratios(latency: dict, model: str, baseline: str) -> dict[str, dict[str, float]]:
    """{mode: {shape: model's median / baseline's median in the same mode}} (< 1: faster)."""
    return {mode: {shape: t["median_ms"] / latency[baseline][mode][shape]["median_ms"] for shape, t in per.items()}
            for mode, per in latency[model].items()}
