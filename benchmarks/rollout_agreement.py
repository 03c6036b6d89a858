"""How often batched rollouts sample another token than exact ones (zerotrain/backends/generation.py).

    .venv/bin/python benchmarks/rollout_agreement.py [--prompts 64] [--generations 8] [--new-tokens 64]
        [--prompts-per-call 8,64] [--out-dir benchmarks/results]

Both modes sample every completion with its own generator seeded the same way (RowSampler: Gumbel noise on the
warped scores, argmax), so they draw the same tokens wherever their logits are equal. The exact mode makes one
`generate` call per prompt (its G rows, unpadded); the batched mode puts several prompts in one call, left-padded
to the longest, which moves the fp32 logits in their last bits. A token can then differ only where two perturbed
scores are that close. This script counts it, one process, fp32, on random-init GPT-2 and Llama models (4 layers x
256, vocab 1024) and random prompts of 4-24 tokens, temperature 1 (no top-k / top-p), no EOS (every completion runs
--new-tokens): per family and prompts per call, the completions that differ anywhere, the tokens sampled before the
first difference, and the largest |logit| difference between the two modes at the first step of each completion
(the prefill's last position, read from transformers' output_scores). Writes rollout_agreement.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def model_of(family: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1024, n_positions=256))
    return LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=688, vocab_size=1024,
                                        max_position_embeddings=256))


def run(family: str, prompts: list[torch.Tensor], a: argparse.Namespace, per_call: list[int]) -> dict:
    from zerotrain.backends.generation import GenerationStats, GenerationView, SamplingParams, generation_mode

    model = model_of(family).eval()
    params = SamplingParams(max_new_tokens=a.new_tokens, pad_token_id=0, eos_token_id=None)
    seeds = [1000 + i for i in range(len(prompts))]
    out: dict = {"family": family, "params": sum(p.numel() for p in model.parameters()), "per_call": {}}
    with generation_mode(model):
        view = GenerationView(model, params, torch.device("cpu"), GenerationStats("phase", False, False))
        t0 = time.perf_counter()
        exact = [view.generate(p, a.generations, s) for p, s in zip(prompts, seeds)]
        out["exact_s"] = time.perf_counter() - t0
        for n in per_call:
            t0 = time.perf_counter()
            batched = view.generate_batch(prompts, a.generations, seeds, rows_per_call=n * a.generations)
            seconds = time.perf_counter() - t0
            differ, before_first = 0, []
            for e, b in zip(exact, batched):
                for g in range(a.generations):
                    x, y = e.completion_ids[g], b.completion_ids[g]
                    if torch.equal(x, y):
                        continue
                    differ += 1
                    before_first.append(int((x != y).int().argmax()))
            out["per_call"][n] = {"seconds": seconds, "completions": len(prompts) * a.generations,
                                  "tokens": len(prompts) * a.generations * a.new_tokens,
                                  "differing_completions": differ, "tokens_before_first_difference": before_first}
        view.close()
    out["logit_diff_first_step"] = first_step_logit_diff(model, prompts)
    return out


def first_step_logit_diff(model: torch.nn.Module, prompts: list[torch.Tensor]) -> float:
    """The largest |difference| between the last position's logits of each prompt alone and left-padded in one
    batch of all prompts (what the first sampled token of each mode is drawn from)."""
    width = max(p.numel() for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        padded = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        worst = 0.0
        for i, p in enumerate(prompts):
            alone = model(input_ids=p[None]).logits[0, -1]
            worst = max(worst, float((alone - padded[i]).abs().max()))
    return worst


def how_run(res: dict, script: str, threads: str) -> str:
    """The first sentences of a result's table header: when, where, the command and the prompts."""
    return (f"Run {res['date']} on {res['machine']}, torch {res['torch']}, transformers {res['transformers']}, one "
            f"process, {threads}fp32, zerotrain from commit {res['commit'][:10]}. `benchmarks/{script} "
            f"{' '.join(res['argv'])}`: {res['prompts']} random prompts of 4-24 tokens, G {res['generations']}, "
            f"{res['new_tokens']} new tokens each (no EOS), temperature 1; ")


def markdown(res: dict) -> str:
    lines = ["# Batched vs exact rollouts: how often a sampled token differs", "",
             how_run(res, "rollout_agreement.py", "") + "random-init models, 4 layers x 256, vocab 1024. Exact: one "
             "generate call per prompt; batched: the given prompts per call, left-padded.", "",
             "| family | prompts per call | completions | tokens | differing completions | tokens before the first "
             "difference | seconds (exact: one call per prompt) | max abs logit difference, padded vs alone (first "
             "step) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["runs"]:
        for n, c in r["per_call"].items():
            firsts = c["tokens_before_first_difference"]
            lines.append(f"| {r['family']} | {n} | {c['completions']} | {c['tokens']} | {c['differing_completions']} | "
                         f"{sorted(firsts) if firsts else '-'} | {c['seconds']:.1f} ({r['exact_s']:.1f}) | "
                         f"{r['logit_diff_first_step']:.2e} |")
    lines += ["", "A completion that differs differs from its first differing token on (the rest is sampled from "
              "another prefix). Seconds are wall time on the shared 2-core machine: ratios only, one run."]
    return "\n".join(lines) + "\n"


def random_prompts(count: int) -> list[torch.Tensor]:
    """`count` prompts of 4-24 random tokens (ids 5-1023), the same on every run."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(5, 1024, (int(torch.randint(4, 25, (1,), generator=gen)),), generator=gen)
            for _ in range(count)]


def provenance(argv: list[str]) -> dict:
    """When, where and with what a result was measured (its JSON's first keys)."""
    import platform
    import subprocess

    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit, "argv": argv}


def write_results(res: dict, out: Path, md: str) -> None:
    """The raw JSON at `out`, its table beside it (.md), the table printed."""
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)


def job_parser(description: str, prompts: int, new_tokens: int) -> argparse.ArgumentParser:
    """The flags of a rollout job (prompts, completions per prompt, new tokens, where the results go)."""
    p = argparse.ArgumentParser(description=description.split("\n")[0])
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = job_parser(__doc__, prompts=64, new_tokens=64)
    p.add_argument("--prompts-per-call", default="8,64")
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    prompts = random_prompts(a.prompts)
    per_call = [int(x) for x in a.prompts_per_call.split(",")]
    res = {**provenance(argv), "prompts": a.prompts, "generations": a.generations, "new_tokens": a.new_tokens,
           "runs": [run(f, prompts, a, per_call) for f in ("gpt2", "llama")]}
    write_results(res, Path(a.out_dir) / "rollout_agreement.json", markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
