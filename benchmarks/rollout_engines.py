"""Rollout engines side by side: zerotrain's batched `generate` with a dynamic or a static KV cache, and
transformers' continuous-batching engine (`model.generate_batch`, paged attention; TRL's
use_transformers_continuous_batching), on the same prompts in one process.

    .venv/bin/python benchmarks/rollout_engines.py [--prompts 8] [--generations 8] [--new-tokens 32] [--rounds 3]
        [--out-dir benchmarks/results]

A random-init Llama (4 layers x 256, vocab 1024), fp32, one thread, random prompts of 4-24 tokens, temperature 1, no
EOS (every completion runs --new-tokens). Each round runs every engine once, in turn (dynamic, static, paged,
paged-sized), after one warm-up call of each; completion tokens/s per engine and round, and the median of the rounds'
ratios to the dynamic cache's. It also
checks what each engine keeps of zerotrain's guarantees: the static cache's tokens against the dynamic cache's (both
sampled by zerotrain's per-row seeded generators), and whether a logits processor handed to `generate_batch` is ever
called (zerotrain's per-row sampling is one: RowSampler). Writes rollout_engines.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINES = ("dynamic", "static", "paged", "paged-sized")
PAGE = 32
"""The paged-sized engine's page (tokens)."""


class Counted:
    """A logits processor that only counts its calls (does generate_batch run the processors it is handed?)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return scores


def run_engine(engine: str, model, prompts: list[torch.Tensor], a: argparse.Namespace, probe: Counted) -> tuple:
    """(completion tokens, seconds, completions as lists of token lists) of one call of the engine."""
    from transformers import GenerationConfig, LogitsProcessorList

    from zerotrain.backends.generation import GenerationStats, GenerationView, SamplingParams

    start = time.perf_counter()
    if engine.startswith("paged"):
        from transformers.generation import ContinuousBatchingConfig

        longest = max(p.numel() for p in prompts) + a.new_tokens  # the pool holds every row whole at once
        pool = ContinuousBatchingConfig(num_blocks=len(prompts) * a.generations * -(-longest // PAGE), page_size=PAGE,
                                        max_batch_tokens=1024) if engine == "paged-sized" else None
        config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=a.new_tokens, eos_token_id=-1,
                                  pad_token_id=0, num_return_sequences=a.generations)
        out = model.generate_batch(inputs=[p.tolist() for p in prompts], generation_config=config,
                                   continuous_batching_config=pool, progress_bar=False,
                                   logits_processor=LogitsProcessorList([probe]))
        seconds = time.perf_counter() - start
        rows = [list(o.generated_tokens) for _, o in sorted(out.items())]
        return sum(len(r) for r in rows), seconds, rows
    params = SamplingParams(max_new_tokens=a.new_tokens, pad_token_id=0, eos_token_id=None,
                            cache_implementation=engine)
    view = GenerationView(model, params, torch.device("cpu"), GenerationStats("phase", False, False))
    groups = view.generate_batch(prompts, a.generations, [1000 + i for i in range(len(prompts))])
    view.close()
    seconds = time.perf_counter() - start
    rows = [c.completion_ids[g].tolist() for c in groups for g in range(a.generations)]
    return sum(int(c.lengths.sum()) for c in groups), seconds, rows


def markdown(res: dict) -> str:
    from rollout_agreement import how_run

    lines = ["# Rollout engines side by side: dynamic cache, static cache, continuous batching", "",
             how_run(res, "rollout_engines.py", "one thread, ") + "a random-init Llama, 4 layers x 256, vocab "
             "1024. dynamic / static: zerotrain's batched `generate` (all prompts in one call, per-row seeded "
             "sampling) with that KV cache; paged: transformers' `generate_batch` (continuous batching, paged "
             "attention, its own sampling), its page pool sized by transformers (paged: from the host's memory) or "
             f"to hold every row whole ({PAGE}-token pages, 1024 tokens a forward: paged-sized). Rounds alternate "
             "the engines after one warm-up call each.", "",
             "| engine | completion tokens/s per round | median | median of the rounds' ratios to dynamic |",
             "| --- | --- | --- | --- |"]
    for e in ENGINES:
        tps = res["tokens_per_s"][e]
        lines.append(f"| {e} | {', '.join(f'{x:.0f}' for x in tps)} | {statistics.median(tps):.0f} | "
                     f"{res['median_ratio_to_dynamic'][e]:.3f} |")
    lines += ["", f"- static vs dynamic: the same tokens in every completion of every round: "
              f"{res['static_same_tokens_as_dynamic']}.",
              "- paged, paged-sized: a logits processor handed to `generate_batch` was called "
              f"{res['paged_processor_calls']} "
              "times: it builds its processors from the GenerationConfig only and samples with torch.multinomial "
              "on one generator for the whole batch, so zerotrain's per-row seeded sampling (RowSampler, "
              "LogpRecorder) cannot run in it.",
              "", "Wall time on a shared 2-core machine: ratios only."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    from rollout_agreement import job_parser, model_of, provenance, random_prompts, write_results

    p = job_parser(__doc__, prompts=8, new_tokens=32)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    from zerotrain.backends.generation import generation_mode

    prompts = random_prompts(a.prompts)
    model, probe = model_of("llama").eval(), Counted()
    tps: dict[str, list[float]] = {e: [] for e in ENGINES}
    same = True
    with generation_mode(model):
        for e in ENGINES:  # warm-up (the paged engine's first call builds its cache and scheduler)
            run_engine(e, model, prompts, a, probe)
        for _ in range(a.rounds):
            rows = {}
            for e in ENGINES:
                tokens, seconds, rows[e] = run_engine(e, model, prompts, a, probe)
                tps[e].append(tokens / seconds)
                print(f"{e}: {tokens} tokens in {seconds:.2f} s", flush=True)
            same = same and rows["static"] == rows["dynamic"]
    res = {**provenance(argv), "prompts": a.prompts, "generations": a.generations, "new_tokens": a.new_tokens,
           "tokens_per_s": tps,
           "median_ratio_to_dynamic": {e: statistics.median(x / d for x, d in zip(tps[e], tps["dynamic"]))
                                       for e in ENGINES},
           "static_same_tokens_as_dynamic": same, "paged_processor_calls": probe.calls}
    write_results(res, Path(a.out_dir) / "rollout_engines.json", markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
