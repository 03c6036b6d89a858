"""Reward models (--task reward) through the CLI on 2 real ranks, against TRL 1.16's RewardTrainer in one process.

Every cell runs `zerotrain train --task reward` under torchrun (2 ranks x micro-batch 4 = the 8 pairs every step)
and compares each of its 4 steps with RewardTrainer on the same one-label classifier (the causal-LM dir with a fresh
score head seeded by --seed), data, batch, AdamW and constant LR (tests/support/trl_reward_reference.py; fp32): the
loss, accuracy and margin within 1e-5 relative; the scores (mean_reward, min_reward, max_reward), whose rounding is
in the head's units and which can sit near 0, within 1e-5 of the largest |score| (at least 1e-5 absolute). The
Llama cells are the ones that found the classifier's pad id set before the model was built (it froze the embedding
row of pad = eos, which every sequence ends with; zerotrain/model/source.py ModelBuilder.head_pad_id). The learning rate is 5e-4: at 1e-3 one process
with TRL's exact batch already drifts to 9e-6 of TRL's loss by step 4 (rounding amplified by the optimizer).
Under LoRA, zerotrain seeds the adapters with --seed + lora.SEED_OFFSET: TRL's args.seed (which RewardTrainer sets
right before get_peft_model) gets that seed, its head the same --seed.

The pairs end with a word that tells chosen (" yes") from rejected (" no"), so 4 steps learn something held-out
pairs show (eval accuracy); some carry a "margin" column (Llama 2's margin, TRL subtracts it in the loss).

CI: one launch per backend. DeepSpeed ZeRO-3 GPT-2 with the margin column, --center-rewards-coef 0.01 and
--eval-data: equals TRL; eval figures; final/ reloads with AutoModelForSequenceClassification and ranks held-out
chosen above rejected; final/ serves as --reward-model to the GRPO reward loader (in this process). FSDP2 stage 3
LoRA Llama: equals TRL with LoRA (the score head trains whole); final/ is an adapter, its export merges. The rest of
the matrix is slow.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, rank_env, run, torchrun
from tests.support.make_pref_data import pairs, tiny_model
from zerotrain.model.lora import SEED_OFFSET

pytestmark = pytest.mark.multirank

STEPS, PAIRS, MICRO, LR, SEED, COEF = 4, 8, 4, 5e-4, 42, 0.01  # 2 ranks x micro-batch 4 = the 8 pairs
TRL_REWARD = str(REPO / "tests" / "support" / "trl_reward_reference.py")
METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")
MARGINS = (0.5, 0.0, 1.0, -0.25)


def reward_pairs(n: int, seed: int, margin: bool = False, conversational: bool = False) -> list[dict]:
    """make_pref_data's pairs, chosen ending " yes" and rejected " no" (a signal 4 steps learn); margin: a
    "margin" column cycling through MARGINS."""
    rows = []
    for i, row in enumerate(pairs(n, seed, conversational)):
        if conversational:
            row["chosen"][0]["content"] += " yes"
            row["rejected"][0]["content"] += " no"
        else:
            row["chosen"] += " yes"
            row["rejected"] += " no"
        if margin:
            row["margin"] = MARGINS[i % len(MARGINS)]
        rows.append(row)
    return rows


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> dict:
    """The module's models (a GPT-2 and a Llama with word-level tokenizers), pair files, and a cache of TRL runs."""
    root = tmp_path_factory.mktemp("reward")
    sets = {"data": reward_pairs(PAIRS, 0), "margin": reward_pairs(PAIRS, 0, margin=True),
            "chat": reward_pairs(PAIRS, 0, conversational=True), "heldout": reward_pairs(16, 1, margin=True)}
    return {"root": root, "gpt2": tiny_model("gpt2", root / "gpt2"), "llama": tiny_model("llama", root / "llama"),
            "trl": {}, **{name: write(root / f"{name}.jsonl", rows) for name, rows in sets.items()}}


def trl_steps(rm: dict, family: str, *args: str, data: str = "data") -> dict:
    """TRL's run for this model and configuration (once per module): {"steps": [...], "score_init", ...}."""
    key = (family, data, *args)
    if key not in rm["trl"]:
        out = rm["root"] / f"trl-{len(rm['trl'])}.json"
        run([sys.executable, TRL_REWARD, "--model", rm[family], "--data", rm[data], "--out", out, "--steps", STEPS,
             "--batch", PAIRS, "--lr", LR, "--seed", SEED, "--max-length", 128, *args], timeout=300, check=True)
        rm["trl"][key] = json.loads(Path(out).read_text())
    return rm["trl"][key]


def train(rm: dict, out: Path, family: str, *args: str, data: str = "data", check: bool = True, nproc: int = 2):
    """`zerotrain train --task reward` on nproc ranks (the micro-batch keeps the global batch of PAIRS); returns the
    completed process."""
    return torchrun(["-m", "zerotrain", "train", "--task", "reward", "--model", rm[family], "--data", rm[data],
                     "--output", out, "--micro-batch", MICRO * 2 // nproc, "--lr", LR, "--schedule", "constant",
                     "--seq-len", 128, "--seed", SEED, "--dist-timeout", 60, *args], env=rank_env(), timeout=400,
                    check=check, nproc=nproc)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps_of(out: Path) -> list[dict]:
    return [r for r in records(out) if "loss" in r and "eval_loss" not in r]


def assert_matches(ours: list[dict], theirs: list[dict]) -> None:
    """Each step's loss and metrics against TRL's (tolerances in the module docstring)."""
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1)) and len(theirs) == STEPS, (ours, theirs)
    for a, b in zip(ours, theirs):
        where = f"step {a['step']}"
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (where, a, b)
        for k in ("accuracy", "margin"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (where, k, a[k], b[k])
        # a score's rounding is in the head's units, not relative to the score (one near 0 has no relative
        # precision): 1e-5 of the largest score, at least 1e-5
        size = max(abs(b["min_reward"]), abs(b["max_reward"]), 1.0)
        for k in ("mean_reward", "min_reward", "max_reward"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5 * size), (where, k, a[k], b[k])
    assert ours[-1]["loss"] < ours[0]["loss"], ours  # it trained


def heldout_accuracy(model_dir: Path, heldout: Path) -> float:
    """The share of held-out pairs whose chosen text (prompt + chosen + eos, as the trainers tokenize it) the
    reloaded classifier scores above the rejected one."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    rows = [json.loads(line) for line in heldout.read_text().splitlines()]

    def score(texts: list[str]) -> torch.Tensor:
        enc = tok([t + tok.eos_token for t in texts], return_tensors="pt", padding=True)
        with torch.no_grad():
            return model(**enc).logits[:, 0]

    chosen = score([r["prompt"] + r["chosen"] for r in rows])
    rejected = score([r["prompt"] + r["rejected"] for r in rows])
    return float((chosen > rejected).float().mean())


# --- CI: one launch per backend -----------------------------------------------------------------------------
def test_reward_deepspeed_zero3_margin_center_equals_trl_and_serves_grpo(rm, tmp_path):
    import torch

    from zerotrain.train.rewards import RewardModel, load_reward_funcs

    out = tmp_path / "run"
    res = train(rm, out, "gpt2", "--stage", "3", "--max-steps", STEPS, "--center-rewards-coef", COEF,
                "--eval-data", rm["heldout"], "--eval-every", 2, data="margin")
    assert "reward model (Bradley-Terry, margin column, center rewards coef 0.01)" in res.stdout, res.stdout
    assert "8 pairs (0 truncated, 0 dropped" in res.stdout, res.stdout
    theirs = trl_steps(rm, "gpt2", "--center-rewards-coef", str(COEF), data="margin")
    assert_matches(steps_of(out), theirs["steps"])
    # evaluation between steps leaves training as it was (the parity above) and reports TRL's eval names
    evals = [r for r in records(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4], evals
    for r in evals:
        assert all(math.isfinite(r[f"eval_{k}"]) for k in ("loss", *METRICS)), r
        assert r["eval_min_reward"] <= r["eval_mean_reward"] <= r["eval_max_reward"], r
    assert evals[-1]["eval_accuracy"] >= 0.75, evals  # held-out pairs: chosen above rejected
    # final/ is a plain HF one-label classifier that ranks the held-out pairs as the run's eval did
    final = out / "final"
    accuracy = heldout_accuracy(final, rm["heldout"])
    print(f"held-out accuracy of final/: {accuracy:.3f} (eval_accuracy {evals[-1]['eval_accuracy']:.3f})")
    assert accuracy == pytest.approx(evals[-1]["eval_accuracy"]), accuracy
    # ... and GRPO's --reward-model loader takes it: it scores completions as the classifier does
    rewards = load_reward_funcs(None, None, str(final))
    assert isinstance(rewards.rewards[0], RewardModel) and rewards.names == ["final"]
    prompts = ["tell me about the red house ?"] * 2
    completions = [" it was built long ago . yes", " it was built long ago . no"]
    scored = rewards.score(prompts, completions, [[1], [1]], {})
    assert scored.shape == (2, 1) and torch.isfinite(scored).all(), scored
    assert scored[0, 0] > scored[1, 0], scored  # the learnt signal


def test_reward_fsdp2_lora_llama_equals_trl_and_exports_merged(rm, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from zerotrain.export.to_hf import export_checkpoint

    out = tmp_path / "run"
    res = train(rm, out, "llama", "--backend", "fsdp", "--stage", "3", "--lora-r", 4, "--max-steps", STEPS)
    assert "reward model (Bradley-Terry)" in res.stdout, res.stdout
    theirs = trl_steps(rm, "llama", "--lora-r", "4", "--lora-seed", str(SEED + SEED_OFFSET))
    check = theirs["lora_init_check"]
    assert check["matches"] and check["score_trains"], check
    assert_matches(steps_of(out), theirs["steps"])
    final = out / "final"
    assert (final / "adapter_config.json").is_file()
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in (adapter.get("modules_to_save") or []), adapter
    ckpt = sorted((out / "checkpoints").glob("global_step*"))[-1]
    merged = export_checkpoint(ckpt, tmp_path / "export", merge_lora=True) / "merged"
    model = AutoModelForSequenceClassification.from_pretrained(str(merged))
    assert model.config.num_labels == 1 and not any("lora" in n for n, _ in model.named_parameters())
    print(f"held-out accuracy of the merged LoRA reward model: {heldout_accuracy(merged, rm['heldout']):.3f}")


# --- slow: the rest of the matrix ---------------------------------------------------------------------------
MATRIX = [("deepspeed", "3", "llama"), ("fsdp", "3", "gpt2"), ("deepspeed", "2", "gpt2"), ("deepspeed", "1", "llama"),
          ("deepspeed", "0", "gpt2"), ("fsdp", "1", "llama")]


@pytest.mark.slow
@pytest.mark.parametrize("backend, stage, family", MATRIX, ids=[f"{b}-z{s}-{f}" for b, s, f in MATRIX])
def test_reward_matrix_equals_trl(rm, tmp_path, backend, stage, family):
    train(rm, tmp_path, family, "--backend", backend, "--stage", stage, "--max-steps", STEPS)
    assert_matches(steps_of(tmp_path), trl_steps(rm, family)["steps"])


@pytest.mark.slow
def test_reward_one_process_equals_trl(rm, tmp_path):
    """zerotrain in one process (the whole batch in one micro-batch, as TRL's), Llama."""
    train(rm, tmp_path, "llama", "--stage", "3", "--max-steps", STEPS, nproc=1)
    assert_matches(steps_of(tmp_path), trl_steps(rm, "llama")["steps"])


@pytest.mark.slow
def test_reward_chat_pairs_equal_trl(rm, tmp_path):
    train(rm, tmp_path, "gpt2", "--stage", "3", "--max-steps", STEPS, data="chat")
    assert_matches(steps_of(tmp_path), trl_steps(rm, "gpt2", data="chat")["steps"])


@pytest.mark.slow
def test_reward_resume_equals_trl(rm, tmp_path):
    train(rm, tmp_path, "gpt2", "--stage", "3", "--max-steps", 2, "--center-rewards-coef", COEF, data="margin")
    train(rm, tmp_path, "gpt2", "--stage", "3", "--max-steps", STEPS, "--center-rewards-coef", COEF, "--resume",
          data="margin")
    assert_matches(steps_of(tmp_path), trl_steps(rm, "gpt2", "--center-rewards-coef", str(COEF),
                                                 data="margin")["steps"])


@pytest.mark.slow
def test_a_trained_reward_model_serves_grpo(rm, tmp_path):
    """`zerotrain train --task grpo --reward-model final/` end to end: the reward model's scores are the reward."""
    train(rm, tmp_path / "rm", "gpt2", "--stage", "3", "--max-steps", STEPS)
    prompts = write(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in pairs(8, seed=3)])
    torchrun(["-m", "zerotrain", "train", "--task", "grpo", "--model", rm["gpt2"], "--data", prompts,
              "--output", tmp_path / "grpo", "--reward-model", tmp_path / "rm" / "final", "--num-generations", 4,
              "--max-completion-len", 8, "--global-batch", 8, "--micro-batch", 4, "--lr", 1e-3, "--schedule",
              "constant", "--seed", 7, "--max-steps", 2, "--dist-timeout", 60], env=rank_env(), timeout=400,
             check=True)
    steps = [r for r in records(tmp_path / "grpo") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], steps
    assert all(math.isfinite(r["rewards/final/mean"]) and r["rewards/final/std"] > 0 for r in steps), steps
