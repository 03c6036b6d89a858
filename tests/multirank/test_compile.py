"""`zerotrain train --compile` as a user runs it, on 2 real CPU ranks: every transformer block compiled
(zerotrain/model/compile.py), the losses equal eager's over 4 steps within 4x eager's own reduction-order spread
(eager on 2 ranks vs the same global batch on 1 rank) and at most 1e-5 (fp32); the banner, the compile record
in metrics.jsonl and the summary line say what compiled; variable-length chat batches (padded to the longest row)
compile for any length: over 8 steps and 2 evaluations at most 4 graphs (with and without an attention mask, with
and without gradients), not one per step.

Cells: CI runs one inductor cell per backend, each with one of the two features --compile is documented with
(docs/training.md): DeepSpeed ZeRO-3 on GPT-2 with gradient checkpointing, FSDP2 stage 3 on a LoRA Llama; and the
chat recompile count. The rest (plain ZeRO-3 and FSDP2 under inductor, ZeRO-0, the other family per backend, LoRA
on ZeRO-3, checkpointing on a Llama) are `slow`; all but the two plain inductor cells use torch.compile's aot_eager
backend (traced, eager kernels). One TORCHINDUCTOR_CACHE_DIR for the module.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tests.support.families as families
from tests.support.launch import rank_env, torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

STEPS = 4
COMMON = ["--seq-len", "64", "--micro-batch", "2", "--max-steps", str(STEPS), "--schedule", "constant", "--lr", "1e-3",
          "--save-every", "0", "--no-save-final", "--dist-timeout", "120"]

# (id, family, backend args, extra args, compile backend)
CELLS = [
    ("gc-gpt2-ds3", "gpt2", ["--backend", "deepspeed", "--stage", "3"], ["--gradient-checkpointing"], "inductor"),
    ("lora-llama-fsdp3", "llama", ["--backend", "fsdp", "--stage", "3"], ["--lora-r", "4"], "inductor"),
    ("ds3-gpt2", "gpt2", ["--backend", "deepspeed", "--stage", "3"], [], "inductor"),
    ("fsdp3-llama", "llama", ["--backend", "fsdp", "--stage", "3"], [], "inductor"),
    ("ds0-gpt2", "gpt2", ["--backend", "deepspeed", "--stage", "0"], [], "aot_eager"),
    ("ds0-llama", "llama", ["--backend", "deepspeed", "--stage", "0"], [], "aot_eager"),
    ("ds3-llama", "llama", ["--backend", "deepspeed", "--stage", "3"], [], "aot_eager"),
    ("fsdp3-gpt2", "gpt2", ["--backend", "fsdp", "--stage", "3"], [], "aot_eager"),
    ("lora-gpt2-ds3", "gpt2", ["--backend", "deepspeed", "--stage", "3"], ["--lora-r", "4"], "aot_eager"),
    ("gc-llama-ds3", "llama", ["--backend", "deepspeed", "--stage", "3"], ["--gradient-checkpointing"], "aot_eager"),
]
SLOW = {c[0] for c in CELLS[2:]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile")


@pytest.fixture(scope="module")
def env(workdir):
    return rank_env(TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor-cache"))


def model_dir(workdir: Path, family: str) -> Path:
    """A tiny pretrained-style model directory with its own tokenizer (built once per family)."""
    from zerotrain.assets.demo import build_tokenizer

    d = workdir / family
    if not (d / "config.json").is_file():
        families.make_model_dir(family, d)
        build_tokenizer(vocab_size=families.VOCAB - 24).save_pretrained(str(d))
    return d


def train(out: Path, model: Path, args: list[str], env: dict, nproc: int = 2) -> tuple[list[dict], str]:
    res = torchrun(["-m", "zerotrain", "train", "--model", str(model), "--output", str(out), *args], nproc=nproc,
                   env=env, timeout=420)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return records, res.stdout + res.stderr  # the progress bar and the lines written through it go to stderr


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r and "event" not in r]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name,family,backend,extra,compiler", cells(CELLS, SLOW, ids=lambda c: c[0]))
def test_compiled_losses_equal_eager(name, family, backend, extra, compiler, workdir, env):
    model = model_dir(workdir, family)
    args = [*backend, *extra, *COMMON]
    eager, _ = train(workdir / f"{name}-eager", model, [*args, "--grad-accum", "2"], env)
    one_rank, _ = train(workdir / f"{name}-one-rank", model, [*args, "--grad-accum", "4"], env, nproc=1)
    compiled, stdout = train(workdir / f"{name}-compiled", model,
                             [*args, "--grad-accum", "2", "--compile", "--compile-backend", compiler], env)
    spread = max_rel(losses(eager), losses(one_rank))  # the same global batch of 8 rows, reduced in another order
    diff = max_rel(losses(compiled), losses(eager))
    assert diff <= min(1e-5, max(4 * spread, 1e-6)), (name, diff, spread, losses(compiled), losses(eager))
    assert re.search(rf"compile: \d+ transformer blocks, torch.compile {compiler}", stdout), stdout
    first = [r for r in compiled if r.get("event") == "compile"]
    assert first and first[0]["step"] == 1 and not first[0]["recompile"] and first[0]["compile_s"] > 0, first
    assert "recompile(s) after the first step" in stdout, stdout
    if compiler == "inductor":  # the ranks compiled into the module's cache folder (warm-started ranks honour it)
        assert any(p.is_file() for p in (workdir / "inductor-cache").rglob("*")), "inductor wrote no cache"


def test_variable_length_chat_recompiles_at_most_twice(workdir, env, tmp_path):
    """Chat SFT without packing pads each micro-batch to its longest row: the lengths differ from step to step.
    torch's automatic dynamic shapes recompile once for the second length and never again; evaluation (no
    gradients) compiles once more."""
    from tests.multirank.test_sft_train import chat_rows, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(96))
    records, stdout = train(tmp_path / "run", model_dir(workdir, "llama"),
                            ["--backend", "fsdp", "--stage", "3", "--data", str(data), "--data-format", "chat",
                             "--chat-template", "chatml",
                             "--seq-len", "256", "--micro-batch", "2", "--grad-accum", "1", "--max-steps", "8",
                             "--eval-split", "0.1", "--eval-every", "4", "--save-every", "0", "--no-save-final",
                             "--compile", "--compile-backend", "aot_eager", "--dist-timeout", "120"], env)
    assert "(0 truncated" in stdout, stdout  # rows of their own lengths
    lengths = {r.get("tokens") for r in records if "loss" in r and "event" not in r}
    assert len(lengths) > 2, f"the chat batches should differ in length: {lengths}"
    assert "any sequence length" in stdout, stdout
    compiles = [r for r in records if r.get("event") == "compile"]
    recompiles = [r for r in compiles if r["recompile"]]
    # training: at most one more graph (a batch without padding: no attention mask); evaluation: one per mask kind
    assert compiles[0]["step"] == 1 and sum(r["new_graphs"] for r in compiles) <= 4, compiles
    assert sum(r["new_graphs"] for r in recompiles if r["during"] == "train") <= 1, compiles
    assert all(f"recompiled {r['new_graphs']} graph(s)" in stdout for r in recompiles), stdout
