"""`zerotrain data prepare`, a mixture and map-style resume twice in a row, through the CLI on 2 ranks, as a user runs
them (one launch per backend holds all of it, for CI time):
- `data prepare --data a.jsonl,b.parquet --data-weights 0.7,0.3` (two file types) writes the shards and manifest;
- run A trains 6 steps from the raw files (tokenizing them), crossing an epoch of the mixture: each source's share of
  tokens and samples in metrics.jsonl is its weight within 2%, and every step's tokens are the sources' sum;
- run B trains from the prepared directory with 0 rows tokenized, is preempted (SIGTERM) after step 2, resumed
  (`--resume auto`), preempted after step 4, resumed again to step 6: its losses, learning rates and per-source
  figures are A's (loss 1e-5 relative), so the prepared rows, the mixture order and the resumed data position are
  the raw run's.
GPT-2 on DeepSpeed ZeRO-2 in CI; a Llama on FSDP2 stage 3 slow.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.launch import rank_env, run, torchrun
from tests.support.matrix import cells
from zerotrain.data.mixture import epoch_length

pytestmark = pytest.mark.multirank

CASES = {"gpt2-deepspeed": ("tiny-gpt2", ["--backend", "deepspeed", "--stage", "2"]),
         "llama-fsdp": ("tiny-llama", ["--backend", "fsdp", "--stage", "3"])}
SLOW = {"llama-fsdp"}
"""CI: GPT-2 on DeepSpeed; the Llama on FSDP2 is slow (the mixture and the prepared rows are the data layer's,
the same for every engine; FSDP2's map-style resume is in CI in tests/multirank/test_cli_resume.py)."""
COMMON = ["--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--lr", "1e-3", "--max-steps", "6",
          "--dist-timeout", "120"]
MIX = ["--data-weights", "0.7,0.3"]
WORDS = ["Anna walked to the garden", "Ben found a red apple", "the dog slept by the door", "rain fell all day"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return rank_env(ZEROTRAIN_CACHE=str(tmp_path_factory.mktemp("mixture_cache")))


def _sources(tmp_path: Path) -> tuple[Path, Path]:
    import datasets

    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"text": f"alpha {i}: {WORDS[i % 4]}. {WORDS[(i + 1) % 4]}."}) + "\n"
                         for i in range(36)))
    b = tmp_path / "b.parquet"
    datasets.Dataset.from_list([{"text": f"beta {i}: {WORDS[(i + 2) % 4]}."} for i in range(30)]).to_parquet(str(b))
    return a, b


def _records(path: Path) -> dict[int, dict]:
    """step -> its training record (the last one per step wins, as after a resume)."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


@pytest.mark.parametrize("case", cells(CASES, SLOW))
def test_prepared_mixture_resumes_twice_like_the_raw_run(tmp_path, env, case):
    preset, flags = CASES[case]
    a, b = _sources(tmp_path)
    prepared = tmp_path / "prepared"
    run([sys.executable, "-m", "zerotrain", "data", "prepare", "--data", f"{a},{b}", *MIX, "--seq-len", "32",
         "--output", str(prepared)], env=env, timeout=300, check=True)
    manifest = json.loads((prepared / "zerotrain-data.json").read_text())
    sizes = [s["rows"] for s in manifest["sources"]]
    assert epoch_length(sizes, manifest["weights"]) // 8 < 6, sizes  # 6 steps of 8 rows cross an epoch

    args = ["-m", "zerotrain", "train", "--model-config", preset, *COMMON, *flags]
    raw = tmp_path / "raw"
    torchrun([*args, "--data", f"{a},{b}", *MIX, "--output", str(raw)], env=env, timeout=420)
    straight = _records(raw / "metrics.jsonl")
    assert sorted(straight) == list(range(1, 7))
    totals = {k: sum(r[k] for r in straight.values()) for k in straight[1] if k.startswith("source_")}
    for what in ("tokens", "samples"):
        share = totals[f"source_{what}/a"] / (totals[f"source_{what}/a"] + totals[f"source_{what}/b"])
        assert share == pytest.approx(0.7, abs=0.02), (what, totals)
    assert all(r["tokens"] == r["source_tokens/a"] + r["source_tokens/b"] for r in straight.values())

    out = tmp_path / "from-prepared"
    from_dir = [*args, "--data", str(prepared), "--output", str(out)]
    for stop, resume in ((2, []), (4, ["--resume", "auto"])):
        res = torchrun([*from_dir, *resume], env={**env, "ZEROTRAIN_FAULT": f"term:rank=0:step={stop}"},
                       timeout=420, check=False)
        log = res.stdout + res.stderr
        assert res.returncode != 0 and f"preempted (SIGTERM) after step {stop}" in log, log[-4000:]
        assert "; 0 rows tokenized before step 1" in log, log[-4000:]
        assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{stop}"
    res = torchrun([*from_dir, "--resume", "auto"], env=env, timeout=420)
    assert "done: 2 steps (to step 6)" in res.stdout + res.stderr, res.stdout[-3000:]
    resumed = _records(out / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, 7))
    for key in ("loss", "lr", "source_tokens/a", "source_tokens/b", "source_samples/a", "source_samples/b"):
        assert [resumed[s][key] for s in range(1, 7)] == pytest.approx([straight[s][key] for s in range(1, 7)],
                                                                       rel=1e-5), key
