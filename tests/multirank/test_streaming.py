"""`zerotrain train --streaming` through the CLI on 2 CPU ranks under torchrun, as a user resumes it: a straight
8-step run A (shuffle buffer, checkpoints every 2 steps, several epochs of a small sharded corpus), then B = A's
step-2 checkpoint resumed to step 8, then C = the step-4 checkpoint B wrote, resumed again to step 8 (the second
resume of a stream: datasets#8308 starts it over). B's and C's steps are A's (loss 1e-5, LR 1e-9).
CI: a mixture of streams on a tiny GPT-2 on DeepSpeed (`--data part-*.jsonl,b.parquet --data-weights 0.7,0.3`: two
file types, the .jsonl glob split by rank shard by shard, the one parquet file row by row; both sources run out and
restart within the run and across the resumes): each source's share of A's tokens and samples is its weight within
2%, every step's tokens are the sources' sum, and B's and C's per-source figures are A's; and the same mixture on a
tiny Llama on FSDP2 (one .jsonl file: each rank reads every row and keeps one in two), A and B only. Slow: one
stream on the GPT-2, a tiny Llama on FSDP2 (one file) and chat SFT with packing on FSDP2 (the Llama cell also
evaluates on --eval-data, read whole).
The stream itself (blocks, rank split, mixture schedule, state round trips) is tests/unit/test_streaming.py's.
"""
from __future__ import annotations

import json
import random

import pytest

from tests.multirank.test_cli_resume import keep_until, train_rows
from tests.support.launch import rank_env, torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

WORDS = "the cat sat on a mat while dogs ran far away under bright blue skies and green hills".split()
CHATS = [[{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}],
         [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks, and you"}]]
COMMON = ["--streaming", "--shuffle-buffer", "64", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2",
          "--lr", "1e-3", "--max-steps", "8", "--save-every", "2", "--keep-last", "4", "--dist-timeout", "120"]
MIX = ["--data-weights", "0.7,0.3"]
CASES = {  # name: (model preset, data shards, data kind, backend flags); kind "mix": shards of text + a parquet file
    "gpt2-deepspeed": ("tiny-gpt2", 2, "mix", ["--backend", "deepspeed", "--stage", "2"]),
    "mix-llama-fsdp": ("tiny-llama", 1, "mix", ["--backend", "fsdp", "--stage", "2"]),
    "one-stream-gpt2-deepspeed": ("tiny-gpt2", 2, "text", ["--backend", "deepspeed", "--stage", "2"]),
    "llama-fsdp": ("tiny-llama", 1, "text", ["--backend", "fsdp", "--stage", "3", "--eval-every", "4"]),
    "chat-llama-fsdp": ("tiny-llama", 2, "chat", ["--backend", "fsdp", "--stage", "2", "--chat-template", "chatml",
                                                  "--seq-len", "128", "--packing"]),
}
SLOW = {"one-stream-gpt2-deepspeed", "llama-fsdp", "chat-llama-fsdp"}
ONE_RESUME = {"mix-llama-fsdp"}
"""CI's FSDP2 cell resumes once (two launches, not three): the second resume of a stream is the data layer's, CI on
DeepSpeed; FSDP2's stream position round trip is the first resume's (its slow cells resume twice)."""


def write_corpus(root, shards: int, kind: str) -> str:
    """A corpus of a few epochs' worth for 8 steps, in `shards` .jsonl files; returns the --data glob."""
    rng = random.Random(0)
    if kind == "chat":
        rows = [{"messages": CHATS[i % 2]} for i in range(48)]
    else:
        rows = [{"text": f"doc{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14)))}
                for i in range(60)]
    root.mkdir()
    if kind == "mix":  # small sources: each runs out on every rank within the 8 steps
        rows = rows[:36]
    for s in range(shards):
        (root / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[s::shards]))
    if kind != "mix":
        return str(root / "part-*.jsonl")
    import datasets

    other = [{"text": f"other {i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14)))}
             for i in range(16)]
    datasets.Dataset.from_list(other).to_parquet(str(root / "b.parquet"))
    return f"{root / 'part-*.jsonl'},{root / 'b.parquet'}"


@pytest.mark.parametrize("case", cells(CASES, SLOW))
def test_streaming_stop_resume_stop_resume_continues_exactly(tmp_path, case):
    preset, shards, kind, flags = CASES[case]
    env = rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "data", shards, kind)
    if "--eval-every" in flags:  # the eval set is read whole beside the stream (a shard of the corpus)
        flags = [*flags, "--eval-data", data.replace("*", "0")]
    args = ["-m", "zerotrain", "train", "--model-config", preset, "--data", data, *COMMON, *flags,
            *(MIX if kind == "mix" else [])]
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    torchrun([*args, "--output", str(a)], env=env, timeout=420)
    straight = train_rows(a / "metrics.jsonl")
    assert [r["step"] for r in straight] == list(range(1, 9))
    epochs = [r["epoch"] for r in straight]
    assert epochs == sorted(epochs) and epochs[-1] >= 1, epochs  # the stream ended and began again within the run
    figures = sorted(k for k in straight[0] if k.startswith("source_"))  # a mixture's per-source tokens and rows
    if kind == "mix":  # a mixture's epoch: every source has run out (and restarted) at least once on rank 0
        assert figures == ["source_samples/b", "source_samples/part-*", "source_tokens/b", "source_tokens/part-*"]
        totals = {k: sum(r[k] for r in straight) for k in figures}
        for what in ("tokens", "samples"):
            share = totals[f"source_{what}/part-*"] / (totals[f"source_{what}/part-*"] + totals[f"source_{what}/b"])
            assert share == pytest.approx(0.7, abs=0.02), (what, totals)
        assert all(r["tokens"] == r["source_tokens/part-*"] + r["source_tokens/b"] for r in straight)

    resumes = ((a, b, 2), (b, c, 4))[:1 if case in ONE_RESUME else 2]
    for src, dst, step in resumes:  # stop at step 2, resume; stop at the resumed run's step 4, resume
        keep_until(src, dst, step)
        res = torchrun([*args, "--resume", "--output", str(dst)], env=env, timeout=420)
        assert f"done: {8 - step} steps (to step 8)" in res.stdout + res.stderr, res.stdout[-3000:]
        resumed = train_rows(dst / "metrics.jsonl")
        assert [r["step"] for r in resumed] == list(range(1, 9))
        assert [r["loss"] for r in resumed[step:]] == pytest.approx([r["loss"] for r in straight[step:]], rel=1e-5)
        assert [r["lr"] for r in resumed[step:]] == pytest.approx([r["lr"] for r in straight[step:]], rel=1e-9)
        for key in figures:  # the resumed mixture draws the same sources' rows
            assert [r[key] for r in resumed] == [r[key] for r in straight], key
        assert [r["epoch"] for r in resumed] == epochs
        assert (dst / "final" / "config.json").is_file()
        evals = [[r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
                 for d in (src, dst)]
        assert [r["step"] for r in evals[1]] == ([4, 8] if "--eval-every" in flags else [])
        assert [r["eval_loss"] for r in evals[1]] == pytest.approx([r["eval_loss"] for r in evals[0]], rel=1e-5)
