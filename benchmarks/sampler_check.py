"""Does RowSampler draw from the softmax? (zerotrain/backends/generation.py: Gumbel noise from each row's generator,
then transformers' greedy argmax.)

    .venv/bin/python benchmarks/sampler_check.py [--prompts 800] [--generations 8] [--steps 4] [--vocab 32]
        [--out benchmarks/results/sampler_check.json]

One fixed softmax (32 logits ~ N(0, 1.5^2), seed 0); rows seeded as a grpo run seeds them (zerotrain/train/grpo.py
_seed(run seed 0, epoch 0, generation, prompt) per prompt, generation_view's row_seed(prompt seed, g) per completion),
each row drawing a token per decoding step from the same scores. Per step: Pearson's chi-square of the token counts
against rows x softmax (vocab - 1 degrees of freedom; its 95% point at 31 is 45.0), beside torch.multinomial's on the
same softmax; and how often two completions of one prompt draw the same token at a step, against sum(p^2) (what
independent rows give). Writes the JSON and prints it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = tokens.numel() * p.double()
    return float(((counts - expected) ** 2 / expected).sum())


def main(argv=None) -> int:
    from zerotrain.backends.generation import RowSampler, row_seed
    from zerotrain.train.grpo import _seed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--prompts", 800), ("--generations", 8), ("--steps", 4), ("--vocab", 32)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", default=str(HERE / "results" / "sampler_check.json"))
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    logits = torch.randn(a.vocab) * 1.5
    p = torch.softmax(logits, 0)
    seeds = [row_seed(_seed(0, 0, gen, j), g) for gen in range(a.prompts // 4) for j in range(4)
             for g in range(a.generations)]
    sampler = RowSampler(seeds, torch.device("cpu"))
    rows = len(seeds)
    drawn = torch.stack([sampler(None, logits.expand(rows, a.vocab).clone()).argmax(1) for _ in range(a.steps)], 1)
    groups = drawn.view(-1, a.generations, a.steps)
    reference = torch.multinomial(p.expand(rows, a.vocab), 1).squeeze(1)
    res = {"rows": rows, "vocab": a.vocab, "steps": a.steps, "degrees_of_freedom": a.vocab - 1,
           "chi_square_per_step": [round(chi_square(drawn[:, s], p), 1) for s in range(a.steps)],
           "chi_square_multinomial": round(chi_square(reference, p), 1),
           "same_token_adjacent_completions": round(float((groups[:, :-1] == groups[:, 1:]).float().mean()), 4),
           "same_token_independent": round(float((p ** 2).sum()), 4)}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
