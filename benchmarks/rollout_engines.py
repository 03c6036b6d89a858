"""Rollout engines side by side: zerotrain's batched `generate` with a dynamic or a static KV cache, and
transformers' continuous-batching engine (`model.generate_batch`, paged attention; TRL's
use_transformers_continuous_batching), on the same prompts in one process.

    .venv/bin/python benchmarks/rollout_engines.py [--prompts 8] [--generations 8] [--new-tokens 32] [--rounds 3]
        [--out-dir benchmarks/results]

A random-init Llama (4 layers x 256, vocab 1024), fp32, one thread, random prompts of 4-24 tokens, temperature 1, no
EOS (every completion runs --new-tokens). Each round runs every engine once, in turn (dynamic, static, paged), after one
warm-up call of each; completion tokens/s per engine and round, and the median ratio to the dynamic cache's. It also
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
ENGINES = ("dynamic", "static", "paged")


def model_of() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=688, vocab_size=1024,
                                        max_position_embeddings=256)).eval()


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
    if engine == "paged":
        config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=a.new_tokens, eos_token_id=-1,
                                  pad_token_id=0, num_return_sequences=a.generations)
        out = model.generate_batch(inputs=[p.tolist() for p in prompts], generation_config=config,
                                   progress_bar=False, logits_processor=LogitsProcessorList([probe]))
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
    lines = ["# Rollout engines side by side: dynamic cache, static cache, continuous batching", "",
             f"Run {res['date']} on {res['machine']}, torch {res['torch']}, transformers {res['transformers']}, one "
             f"process, one thread, fp32, zerotrain from commit {res['commit'][:10]}. `benchmarks/rollout_engines.py "
             f"{' '.join(res['argv'])}`: {res['prompts']} random prompts of 4-24 tokens, G {res['generations']}, "
             f"{res['new_tokens']} new tokens each (no EOS), temperature 1; a random-init Llama, 4 layers x 256, "
             "vocab 1024. dynamic / static: zerotrain's batched `generate` (all prompts in one call, per-row seeded "
             "sampling) with that KV cache; paged: transformers' `generate_batch` (continuous batching, paged "
             "attention, its own sampling). Rounds alternate the engines after one warm-up call each.", "",
             "| engine | completion tokens/s per round | median | median of the rounds' ratios to dynamic |",
             "| --- | --- | --- | --- |"]
    for e in ENGINES:
        tps = res["tokens_per_s"][e]
        lines.append(f"| {e} | {', '.join(f'{x:.0f}' for x in tps)} | {statistics.median(tps):.0f} | "
                     f"{res['median_ratio_to_dynamic'][e]:.3f} |")
    lines += ["", f"- static vs dynamic: the same tokens in every completion of every round: "
              f"{res['static_same_tokens_as_dynamic']}.",
              f"- paged: a logits processor handed to `generate_batch` was called {res['paged_processor_calls']} "
              "times: it builds its processors from the GenerationConfig only and samples with torch.multinomial "
              "on one generator for the whole batch, so zerotrain's per-row seeded sampling (RowSampler, "
              "LogpRecorder) cannot run in it.",
              "", "Wall time on a shared 2-core machine: ratios only."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    import platform
    import subprocess

    import transformers

    from zerotrain.backends.generation import generation_mode

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 1024, (int(torch.randint(4, 25, (1,), generator=gen)),), generator=gen)
               for _ in range(a.prompts)]
    model, probe = model_of(), Counted()
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
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit, "argv": argv,
           "prompts": a.prompts, "generations": a.generations, "new_tokens": a.new_tokens, "tokens_per_s": tps,
           "median_ratio_to_dynamic": {e: statistics.median(x / d for x, d in zip(tps[e], tps["dynamic"]))
                                       for e in ENGINES},
           "static_same_tokens_as_dynamic": same, "paged_processor_calls": probe.calls}
    out = Path(a.out_dir) / "rollout_engines.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
