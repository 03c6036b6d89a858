"""Preference tuning through the CLI on 2 real ranks, against TRL 1.16 in one process.

Every cell runs `zerotrain train --task dpo|simpo|orpo` under torchrun (2 ranks x micro-batch 4 = the whole
set of 8 pairs every step, so both sides see the same pairs each step) and compares each of its 4 steps with
TRL's DPOTrainer (CPOTrainer for SimPO, ORPOTrainer for ORPO) on the same model, data, batch, AdamW and
constant LR, built once per configuration (tests/support/trl_reference.py; fp32): the loss and the
log-probs within 1e-5 relative; the rewards, which are beta x a difference of two log-probs, within 1e-5 of
the size of those terms (beta x |log-prob|). TRL seeds LoRA adapters with its seed right before peft builds
them, zerotrain with --seed + lora.SEED_OFFSET: the TRL side gets that seed.

CI runs every loss once: DPO on DeepSpeed ZeRO-3 (full GPT-2, with the memory check), RPO (DPO + 0.5 x the chosen
NLL) on FSDP2 stage 3 (LoRA Llama, with the no-second-copy check), DPO with --precompute-ref and a resume (DeepSpeed
ZeRO-3, GPT-2: it shares the first cell's TRL run), IPO (DeepSpeed ZeRO-2), SimPO against CPOTrainer (FSDP2) and ORPO
against ORPOTrainer (DeepSpeed ZeRO-3);
folding IPO into the precomputed-reference launch cost more (its own TRL run on Llama) than its own cell; the rest of
the matrix
(DPO per backend x family x LoRA, the other variants) is marked slow.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, rank_env, run, torchrun
from tests.support.make_pref_data import tiny_model, write_pairs
from tests.support.matrix import cells
from zerotrain.model.lora import SEED_OFFSET

pytestmark = pytest.mark.multirank

STEPS, PAIRS, MICRO, LR, SEED = 4, 8, 4, 1e-3, 42  # 2 ranks x micro-batch 4 = the 8 pairs
TRL_REFERENCE = str(REPO / "tests" / "support" / "trl_reference.py")
PAIR_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected")


@pytest.fixture(scope="module")
def pref(tmp_path_factory) -> dict:
    """The module's models (a GPT-2 and a Llama with word-level tokenizers), pairs, and a cache of TRL runs."""
    root = tmp_path_factory.mktemp("pref")
    return {"root": root, "gpt2": tiny_model("gpt2", root / "gpt2"), "llama": tiny_model("llama", root / "llama"),
            "data": write_pairs(root / "pairs.jsonl", PAIRS), "chat": write_pairs(root / "chat.jsonl", PAIRS,
                                                                                   conversational=True),
            "trl": {}}


def trl_steps(pref: dict, family: str, *args: str, data: str = "data") -> list[dict]:
    """TRL's per-step figures for this model and configuration (run once per module)."""
    key = (family, data, *args)
    if key not in pref["trl"]:
        out = pref["root"] / f"trl-{len(pref['trl'])}.json"
        run([sys.executable, TRL_REFERENCE, "--model", pref[family], "--data", pref[data], "--out", out,
             "--steps", STEPS, "--batch", PAIRS, "--lr", LR, "--seed", SEED, "--max-length", 128, *args],
            timeout=300, check=True)
        pref["trl"][key] = json.loads(Path(out).read_text())["steps"]
    return pref["trl"][key]


def train(pref: dict, out: Path, family: str, *args: str, data: str = "data", env: dict | None = None,
          check: bool = True, nproc: int = 2):
    """`zerotrain train` on nproc ranks (the global batch stays the 8 pairs); returns the completed process."""
    return torchrun(["-m", "zerotrain", "train", "--model", pref[family], "--data", pref[data], "--output", out,
                     "--micro-batch", PAIRS // nproc, "--lr", LR, "--schedule", "constant", "--seq-len", 128,
                     "--seed", SEED, "--dist-timeout", 60, *args], env=env or rank_env(), timeout=400, check=check,
                    nproc=nproc)


def steps_of(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def assert_matches(ours: list[dict], theirs: list[dict], beta: float, record: Path | None = None) -> None:
    """Each step's figures against TRL's (tolerances in the module docstring); record: also write the largest
    deviations found there as JSON (the slow pass's figures: benchmarks/results/ci_history/slow_cells_preference.txt)."""
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1)) and len(theirs) == STEPS
    if record is not None:
        worst = {"loss_rel": 0.0, "logps_rel": 0.0, "rewards_over_scale": 0.0}
        for a, b in zip(ours, theirs):
            scale = beta * max(abs(b["logps/chosen"]), abs(b["logps/rejected"]))
            worst["loss_rel"] = max(worst["loss_rel"], abs(a["loss"] - b["loss"]) / abs(b["loss"]))
            worst["logps_rel"] = max(worst["logps_rel"], *(abs(a[k] - b[k]) / abs(b[k])
                                                          for k in ("logps/chosen", "logps/rejected")))
            worst["rewards_over_scale"] = max(worst["rewards_over_scale"], *(
                abs(a[k] - b[k]) / scale for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")))
        record.write_text(json.dumps(worst) + "\n")
    for a, b in zip(ours, theirs):
        where = f"step {a['step']}"
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), where
        for k in ("logps/chosen", "logps/rejected"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (where, k)
        scale = beta * max(abs(b["logps/chosen"]), abs(b["logps/rejected"]))
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5 * scale), (where, k)
        assert a["rewards/accuracies"] == b["rewards/accuracies"], where


def measured_state(state_dir: Path) -> dict:
    return json.loads((state_dir / "model_state_rank0.json").read_text())["measured"]


def estimated_state(pref: dict, family: str, backend: str, stage: int, *args: str) -> dict:
    """`zerotrain estimate --json`'s row for this backend and stage (in this process: no ranks, no weights)."""
    import contextlib
    import io

    from zerotrain.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["estimate", "--model", str(pref[family]), "--nproc", "2", "--micro-batch", str(MICRO),
                     "--seq-len", "128", "--backends", backend, "--json", *args]) == 0
    rows = json.loads(printed.getvalue())["estimates"]
    return next(r for r in rows if r["stage"] == stage and r["offload_optimizer"] == "none"
                and r["offload_param"] == "none")


# --- CI: one representative cell per backend --------------------------------------------------------------
def test_dpo_deepspeed_zero3_equals_trl_and_holds_a_partitioned_reference(pref, tmp_path):
    out, state = tmp_path / "run", tmp_path / "state"
    res = train(pref, out, "gpt2", "--task", "dpo", "--stage", "3", "--max-steps", STEPS, "--eval-data", pref["data"],
                "--eval-every", 2, env=rank_env(ZEROTRAIN_MODEL_STATE_DIR=str(state)))
    assert "reference: a frozen copy of the starting weights" in res.stdout, res.stdout
    assert "8 pairs (0 truncated, 0 dropped" in res.stdout, res.stdout
    assert_matches(steps_of(out), trl_steps(pref, "gpt2"), beta=0.1, record=tmp_path / "parity.json")
    # evaluation between steps leaves training as it was (the parity above) and reports the preference metrics
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(r["eval_loss"]) for r in evals), evals
    assert all(k in evals[-1] for k in ("eval_rewards/margins", "eval_rewards/accuracies")), evals[-1]
    assert (out / "final" / "model.safetensors").is_file()
    # the reference is a ZeRO-3 partition on each rank, as estimated; the policy's states are as without one
    measured = measured_state(state)
    est = estimated_state(pref, "gpt2", "deepspeed", 3, "--task", "dpo")
    assert measured["reference"] == pytest.approx(est["reference"], rel=0.05), (measured, est)
    assert measured["total"] == pytest.approx(est["model_states"], rel=0.05), (measured, est)


def test_rpo_fsdp_lora_equals_trl_without_a_second_copy(pref, tmp_path):
    """RPO (--rpo-alpha: DPO's sigmoid loss + alpha x the chosen NLL) against TRL's loss_type [sigmoid, sft] with
    weights [1, alpha]: the DPO part and the LoRA reference (the adapters disabled) in one launch."""
    out, state = tmp_path / "run", tmp_path / "state"
    res = train(pref, out, "llama", "--task", "dpo", "--rpo-alpha", "0.5", "--backend", "fsdp", "--stage", "3",
                "--lora-r", 4, "--max-steps", STEPS, env=rank_env(ZEROTRAIN_MODEL_STATE_DIR=str(state)))
    assert "reference: the policy with its LoRA adapters disabled" in res.stdout, res.stdout
    theirs = trl_steps(pref, "llama", "--lora-r", "4", "--seed", str(SEED + SEED_OFFSET), "--loss-type", "sigmoid,sft",
                       "--loss-weights", "1,0.5")
    assert_matches(steps_of(out), theirs, beta=0.1, record=tmp_path / "parity.json")
    assert (out / "final" / "adapter_config.json").is_file()
    measured = measured_state(state)
    est = estimated_state(pref, "llama", "fsdp", 3, "--task", "dpo", "--lora-r", "4")
    assert measured["reference"] == 0 and est["reference"] == 0, (measured, est)
    assert measured["total"] == pytest.approx(est["model_states"], rel=0.05), (measured, est)


def test_dpo_precomputed_reference_equals_the_live_one_and_resumes(pref, tmp_path):
    # GPT-2: TRL's run is the ZeRO-3 cell's above (the module's cache), no TRL run of its own (CI time, issue 50)
    out = tmp_path / "run"
    res = train(pref, out, "gpt2", "--task", "dpo", "--stage", "3", "--precompute-ref", "--max-steps", 2)
    assert "reference: precomputed log-probs" in res.stdout, res.stdout
    assert (out / "reference_logps.pt").is_file()
    train(pref, out, "gpt2", "--task", "dpo", "--stage", "3", "--precompute-ref", "--max-steps", STEPS, "--resume")
    assert_matches(steps_of(out), trl_steps(pref, "gpt2"), beta=0.1,  # TRL's live reference
                   record=tmp_path / "parity.json")


def test_simpo_fsdp_equals_trl_cpo(pref, tmp_path):
    # CPOTrainer adds BOS itself where DPOTrainer leaves it to the tokenizer: on the Llama tokenizer (which
    # adds BOS) both tokenize alike; on GPT-2's they differ by that token, so SimPO is compared on the Llama
    out = tmp_path / "run"
    res = train(pref, out, "llama", "--task", "simpo", "--backend", "fsdp", "--stage", "3", "--max-steps", STEPS)
    assert "simpo beta 2.0 gamma 0.5; reference: none" in res.stdout, res.stdout
    assert_matches(steps_of(out), trl_steps(pref, "llama", "--method", "simpo", "--beta", "2.0",
                                            "--simpo-gamma", "0.5"), beta=2.0, record=tmp_path / "parity.json")


# --- slow: the rest of the matrix ---------------------------------------------------------------------------
@pytest.mark.slow  # CI resumes a DPO run with the precomputed reference; this one rebuilds the live frozen copy
def test_dpo_live_reference_resumes(pref, tmp_path):
    train(pref, tmp_path, "gpt2", "--task", "dpo", "--stage", "3", "--max-steps", 2)
    train(pref, tmp_path, "gpt2", "--task", "dpo", "--stage", "3", "--max-steps", STEPS, "--resume")
    assert_matches(steps_of(tmp_path), trl_steps(pref, "gpt2"), beta=0.1, record=tmp_path / "parity.json")


MATRIX = [("deepspeed", "llama", False), ("deepspeed", "gpt2", True), ("deepspeed", "llama", True),
          ("fsdp", "gpt2", False), ("fsdp", "llama", False), ("fsdp", "gpt2", True)]


@pytest.mark.slow
@pytest.mark.parametrize("backend, family, lora", MATRIX, ids=[f"{b}-{f}-{'lora' if lo else 'full'}"
                                                               for b, f, lo in MATRIX])
def test_dpo_matrix_equals_trl(pref, tmp_path, backend, family, lora):
    args = ["--lora-r", "4"] if lora else []
    train(pref, tmp_path, family, "--task", "dpo", "--backend", backend, "--stage", "3", "--max-steps", STEPS, *args)
    theirs = trl_steps(pref, family, *args, *(["--seed", str(SEED + SEED_OFFSET)] if lora else []))
    assert_matches(steps_of(tmp_path), theirs, beta=0.1, record=tmp_path / "parity.json")


VARIANTS = {
    # zerotrain flags, TRL flags, beta
    "orpo-deepspeed": (["--task", "orpo", "--stage", "3"], ["--method", "orpo"], 0.1),
    "rpo-fsdp": (["--task", "dpo", "--rpo-alpha", "0.5", "--backend", "fsdp", "--stage", "3", "--chunked-loss", "16"],
                 ["--loss-type", "sigmoid,sft", "--loss-weights", "1,0.5"], 0.1),
    "ipo-deepspeed-z2": (["--task", "dpo", "--dpo-loss", "ipo", "--stage", "2"], ["--loss-type", "ipo"], 0.1),
    "split-forward-chunked-loss-checkpointing": (["--task", "dpo", "--stage", "3", "--dpo-split-forward",
                                                  "--chunked-loss", "16", "--gradient-checkpointing"], [], 0.1),
    "offload-zero3": (["--task", "dpo", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"],
                      [], 0.1),
    "deepspeed-z0": (["--task", "dpo", "--stage", "0"], [], 0.1),
    "ddp": (["--task", "dpo", "--backend", "fsdp", "--stage", "0"], [], 0.1),
    "chat-deepspeed": (["--task", "dpo", "--stage", "3"], [], 0.1),
    "moe-qwen3-deepspeed": (["--task", "dpo", "--stage", "3"], ["--router-logits"], 0.1),
}


@pytest.mark.parametrize("name", cells(VARIANTS, slow=set(VARIANTS) - {"orpo-deepspeed", "ipo-deepspeed-z2"}))
def test_variants_equal_trl(pref, tmp_path, name):
    ours, theirs, beta = VARIANTS[name]
    data = "chat" if name.startswith("chat") else "data"
    family, nproc = "llama", 2
    if name.startswith("moe"):
        # a mixture of experts: the router's load-balancing loss in both losses. transformers computes it inside
        # each forward, over that forward's tokens (not linear in them): 2 ranks average two such losses where one
        # process takes one over all 16 rows, so the step-for-step comparison runs one rank (the 2-rank DPO path is
        # the rest of this file's)
        family, nproc = "qwen3-moe", 1
        pref.setdefault(family, tiny_model(family, pref["root"] / family))
    train(pref, tmp_path, family, *ours, "--max-steps", STEPS, data=data, nproc=nproc)
    ours_steps = steps_of(tmp_path)
    assert_matches(ours_steps, trl_steps(pref, family, *theirs, data=data), beta=beta,
                   record=tmp_path / "parity.json")
    if name.startswith("moe"):
        assert all(r["router_aux_loss"] > 0 and r["loss"] > r["lm_loss"] for r in ours_steps)


@pytest.mark.slow
def test_bf16_eval_and_metrics(pref, tmp_path):
    train(pref, tmp_path, "gpt2", "--task", "dpo", "--stage", "3", "--precision", "bf16", "--max-steps", 6,
          "--eval-data", str(pref["data"]), "--eval-every", 3)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert len(train_rows) == 6 and all(math.isfinite(r["loss"]) for r in train_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert len(evals) == 2 and all(k in evals[-1] for k in ("eval_rewards/margins", "eval_rewards/accuracies"))


@pytest.mark.slow
def test_reference_from_an_sft_adapter(pref, tmp_path):
    """The common workflow: an SFT LoRA run, then DPO from its merged model with the adapter dir as the
    reference (merged into its base when loaded): the reference equals the policy's start, so the first step's
    rewards are 0 and its loss is ln 2."""
    sft = tmp_path / "sft"
    rows = [{"prompt": json.loads(x)["prompt"], "completion": json.loads(x)["chosen"]}
            for x in Path(pref["data"]).read_text().splitlines()]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    torchrun(["-m", "zerotrain", "train", "--model", pref["llama"], "--data", data, "--output", sft, "--lora-r", 4,
              "--merge-lora", "--max-steps", 3, "--micro-batch", 4, "--lr", 1e-2, "--seq-len", 64], env=rank_env(),
             timeout=400)
    out = tmp_path / "dpo"
    torchrun(["-m", "zerotrain", "train", "--model", sft / "final" / "merged", "--data", pref["data"], "--output", out,
              "--task", "dpo", "--ref-model", sft / "final", "--stage", "3", "--max-steps", 2, "--micro-batch", 4,
              "--seq-len", 128], env=rank_env(), timeout=400)
    first = steps_of(out)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
