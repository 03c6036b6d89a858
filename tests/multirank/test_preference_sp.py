"""Preference tasks under sequence parallelism (--sp 2) through the CLI, against one process with the same global batch.

Every cell runs `zerotrain train --task dpo|simpo|orpo|kto|reward --sp 2` on 2 ranks (one data-parallel replica of 2
sequence-parallel ranks: every row cut in two, zerotrain/train/preference.py sequence_logps) and the same command on
one rank, micro-batch 8 (the whole set each step): each step's loss and figures within 1e-5 relative (the rewards,
beta x a difference of two log-probs, within 1e-5 of beta x |log-prob|), the evaluations' likewise, final/ weights
within 1e-4. The one-process path is the one tests/multirank/test_preference.py holds equal to TRL.

CI runs one cell: DPO on a Llama with DeepSpeed ZeRO-3 (a frozen reference partitioned like the policy, cut over
the sp ranks too), with evaluation, a resume from step 2 and final/. The rest is slow: FSDP2 DPO (frozen reference;
LoRA's base as the reference), --precompute-ref under sp, SimPO, ORPO, KTO, the reward model, and a long prompt (a
sequence several times one rank's share).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import rank_env, torchrun
from tests.support.make_pref_data import pairs, tiny_model, write_pairs

pytestmark = pytest.mark.multirank

STEPS, ROWS, LR, SEED = 4, 8, 1e-3, 42
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl",
           "accuracy", "margin", "mean_reward", "min_reward", "max_reward")
"""What a step reports beside the loss, by task (dpo / simpo / orpo; kto adds kl; the reward model's own)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The module's Llama, its pairs (8), unpaired rows for KTO (8) and pairs whose prompt is 15x longer (up to ~200 tokens)."""
    root = tmp_path_factory.mktemp("prefsp")
    rows = pairs(ROWS, 0)
    long_rows = [{**r, "prompt": " ".join([r["prompt"]] * 15)} for r in rows]
    unpaired = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
                for i, r in enumerate(rows)]
    out = {"root": root, "llama": tiny_model("llama", root / "llama"), "pairs": write_pairs(root / "pairs.jsonl", ROWS)}
    for name, data in (("long", long_rows), ("unpaired", unpaired)):
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in data))
    return out


def train(files: dict, out: Path, nproc: int, *args, data: str = "pairs", seq_len: int = 128, sp: int = 1):
    """`zerotrain train` on nproc ranks in groups of sp, the micro-batch the global batch of 8 over the replicas."""
    return torchrun(["-m", "zerotrain", "train", "--model", files["llama"], "--data", files[data], "--output", out,
                     "--micro-batch", ROWS * sp // nproc, "--lr", LR, "--schedule", "constant", "--seq-len", seq_len, "--seed", SEED,
                     "--dist-timeout", 60, *args], env=rank_env(), timeout=400, nproc=nproc)


def records(out: Path) -> list[dict]:
    """metrics.jsonl's steps and evaluations (not its events: a resume's)."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def assert_equal_runs(ours: list[dict], one: list[dict], beta: float) -> dict:
    """Each step's (and evaluation's) loss and figures equal the one-process run's; returns the largest
    deviations (loss_rel, figure_over_scale)."""
    kinds = [("loss" in r, r["step"]) for r in ours]
    assert kinds == [("loss" in r, r["step"]) for r in one] and kinds, (ours, one)
    worst = {"loss_rel": 0.0, "figure_over_scale": 0.0}
    for a, b in zip(ours, one):
        key = "loss" if "loss" in a else "eval_loss"
        where = f"step {a['step']} {key}"
        worst["loss_rel"] = max(worst["loss_rel"], abs(a[key] - b[key]) / abs(b[key]))
        assert a[key] == pytest.approx(b[key], rel=1e-5), where
        prefix = "" if key == "loss" else "eval_"
        shared = [k for k in FIGURES if prefix + k in b]
        assert shared and all(prefix + k in a for k in shared), (where, sorted(a), sorted(b))
        logps = [abs(b[prefix + k]) for k in ("logps/chosen", "logps/rejected") if prefix + k in b]
        scale = beta * max(logps) if logps else 1.0
        for k in shared:
            x, y = a[prefix + k], b[prefix + k]
            worst["figure_over_scale"] = max(worst["figure_over_scale"], abs(x - y) / scale)
            assert x == pytest.approx(y, rel=1e-5, abs=1e-5 * scale), (where, k)
    return worst


def assert_same_weights(ours: Path, one: Path) -> float:
    """final/'s tensors (LoRA: the adapters) equal the one-process run's within 1e-4 (of the largest entry, at least
    1); returns the largest difference relative to that entry."""
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (one / "final" / "adapter_config.json").is_file() else "model.safetensors"
    a, b = load_file(str(ours / "final" / name)), load_file(str(one / "final" / name))
    assert sorted(a) == sorted(b)
    worst = 0.0
    for name in a:
        diff = float((a[name] - b[name]).abs().max())
        worst = max(worst, diff / max(float(b[name].abs().max()), 1e-12))
        assert diff <= 1e-4 * max(float(b[name].abs().max()), 1.0), name
    return worst


def run_pair(files: dict, tmp_path: Path, beta: float, *args, data: str = "pairs", seq_len: int = 128,
             resume_at: int | None = None, nproc: int = 2) -> dict:
    """The --sp 2 run on nproc ranks (dp = nproc / 2; resumed from step resume_at when given) and the one-process
    run; equal figures and final/."""
    one, sp = tmp_path / "one", tmp_path / "sp"
    train(files, one, 1, *args, "--max-steps", STEPS, data=data, seq_len=seq_len)
    kw = dict(data=data, seq_len=seq_len, sp=2)
    if resume_at is not None:
        train(files, sp, nproc, "--sp", 2, *args, "--max-steps", resume_at, **kw)
        res = train(files, sp, nproc, "--sp", 2, *args, "--max-steps", STEPS, "--resume", **kw)
    else:
        res = train(files, sp, nproc, "--sp", 2, *args, "--max-steps", STEPS, **kw)
    assert "sequence-parallel 2" in res.stdout, res.stdout
    figures = assert_equal_runs(records(sp), records(one), beta)
    figures["weights_rel"] = assert_same_weights(sp, one)
    (tmp_path / "figures.json").write_text(json.dumps(figures) + "\n")
    return figures


# --- CI: one cell ----------------------------------------------------------------------------------------
def test_dpo_sp2_deepspeed_zero3_equals_one_process_with_eval_resume_and_final(files, tmp_path):
    run_pair(files, tmp_path, 0.1, "--task", "dpo", "--stage", 3, "--eval-data", files["pairs"], "--eval-every", 2,
             resume_at=2)
    evals = [r for r in records(tmp_path / "sp") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4], evals


# --- slow: the other backend, references, tasks and a long prompt --------------------------------------
SLOW = {
    # name: (zerotrain flags, beta, data, seq-len)
    "dpo-fsdp2": (["--task", "dpo", "--backend", "fsdp", "--stage", 3, "--eval-data", "{pairs}", "--eval-every", 2],
                  0.1, "pairs", 128),
    "dpo-fsdp2-lora-base-reference": (["--task", "dpo", "--backend", "fsdp", "--stage", 2, "--lora-r", 4], 0.1,
                                      "pairs", 128),
    "dpo-deepspeed-precompute-ref-chunked": (["--task", "dpo", "--stage", 2, "--precompute-ref", "--chunked-loss", 16],
                                             0.1, "pairs", 128),
    "simpo-fsdp2": (["--task", "simpo", "--backend", "fsdp", "--stage", 3], 2.0, "pairs", 128),
    "orpo-deepspeed-z2": (["--task", "orpo", "--stage", 2], 0.1, "pairs", 128),
    "kto-deepspeed-z3": (["--task", "kto", "--stage", 3, "--eval-data", "{unpaired}", "--eval-every", 2], 0.1,
                         "unpaired", 128),
    "reward-fsdp2": (["--task", "reward", "--backend", "fsdp", "--stage", 3, "--eval-data", "{pairs}",
                      "--eval-every", 2], 1.0, "pairs", 128),
    "dpo-long-prompt-deepspeed-z3": (["--task", "dpo", "--stage", 3], 0.1, "long", 256),
    # 4 ranks = dp 2 x sp 2 (micro-batch 4 per replica); RPO's NLL term divides by the global chosen tokens
    "rpo-sp2-dp2-deepspeed-z3": (["--task", "dpo", "--rpo-alpha", 0.5, "--stage", 3], 0.1, "pairs", 128),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_preference_sp2_equals_one_process(files, tmp_path, name):
    args, beta, data, seq_len = SLOW[name]
    args = [str(a).format(**{k: v for k, v in files.items() if isinstance(v, Path)}) for a in args]
    figures = run_pair(files, tmp_path, beta, *args, data=data, seq_len=seq_len, nproc=4 if "dp2" in name else 2)
    print(name, json.dumps(figures))
    if name.startswith("dpo-long"):  # the rows are several times one rank's share: the cut is real
        from tests.support.make_pref_data import tiny_tokenizer

        tok = tiny_tokenizer(add_bos=True)
        longest = max(len(tok(json.loads(x)["prompt"])["input_ids"]) for x in files["long"].read_text().splitlines())
        assert longest > 128, longest  # a rank holds 128 of --seq-len 256 (the model's maximum)
