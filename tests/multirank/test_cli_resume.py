"""`zerotrain train --resume` through the CLI with tensor and pipeline parallelism, as a user does it, on
2 CPU ranks under torchrun: a straight 6-step run A that checkpoints at step 3, then a fresh output B
holding only A's step-3 checkpoint (and A's files up to step 3) resumed to step 6. B's steps 4-6 must
be A's, and B must finish (final/ written). --pp 2 and --tp 2, each on DeepSpeed and FSDP; a tiny Llama
(GPT-2 cannot be split by DeepSpeed AutoTP), the embedded corpus and tokenizer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.launch import rank_env, torchrun

pytestmark = pytest.mark.multirank

COMMON = ["--model-config", "tiny-llama", "--seq-len", "32", "--pack", "--micro-batch", "2", "--grad-accum", "2",
          "--lr", "1e-3", "--max-steps", "6", "--save-every", "3", "--dist-timeout", "120"]
CASES = {  # DeepSpeed's pipeline engine runs ZeRO 0-1 (AutoTP 0-2); FSDP tp/pp stage 1-3 (zerotrain.config.rules)
    "pp2-deepspeed": ["--pp", "2", "--backend", "deepspeed", "--stage", "1"],
    "pp2-fsdp": ["--pp", "2", "--backend", "fsdp", "--stage", "3"],
    "tp2-deepspeed": ["--tp", "2", "--backend", "deepspeed", "--stage", "1"],
    "tp2-fsdp": ["--tp", "2", "--backend", "fsdp", "--stage", "3"],
}


def train_rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return rank_env(ZEROTRAIN_CACHE=str(tmp_path_factory.mktemp("cli_resume_cache")))


def keep_until(src: Path, dst: Path, step: int) -> None:
    """dst = src as it was right after step `step`'s checkpoint: that checkpoint only, `latest` naming
    it, metrics.jsonl up to it, no final/."""
    shutil.copytree(src, dst)
    ckpts, tag = dst / "checkpoints", f"global_step{step}"
    for p in ckpts.iterdir():
        if p.is_dir() and p.name != tag:
            shutil.rmtree(p)
    (ckpts / "latest").write_text(tag)
    shutil.rmtree(dst / "final", ignore_errors=True)
    lines = (dst / "metrics.jsonl").read_text().splitlines()
    (dst / "metrics.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= step))


@pytest.mark.parametrize("case", list(CASES))
def test_resume_mid_run_continues_exactly(tmp_path, env, case):
    a, b = tmp_path / "A", tmp_path / "B"
    args = ["-m", "zerotrain", "train", *CASES[case], *COMMON]
    torchrun([*args, "--output", str(a)], env=env, timeout=420)
    straight = train_rows(a / "metrics.jsonl")
    assert [r["step"] for r in straight] == list(range(1, 7))
    assert (a / "checkpoints" / "global_step3").is_dir(), sorted(p.name for p in (a / "checkpoints").iterdir())

    keep_until(a, b, 3)
    torchrun([*args, "--resume", "--output", str(b)], env=env, timeout=420)
    resumed = train_rows(b / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7))  # resumed at step 4, steps 1-3 kept
    assert [r["loss"] for r in resumed[3:]] == pytest.approx([r["loss"] for r in straight[3:]], rel=1e-5)
    assert [r["lr"] for r in resumed[3:]] == pytest.approx([r["lr"] for r in straight[3:]], rel=1e-9)
    assert (b / "final" / "config.json").is_file()
    assert (b / "checkpoints" / "latest").read_text().strip() == "global_step6"
