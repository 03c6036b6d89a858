"""Online RL (--task grpo) through the CLI: 2 real ranks sample and train exactly what one process does.

Each cell runs `zerotrain train --task grpo` on 2 ranks and on one process with the same global batch (fp32, the
toy rewards of tests/support/grpo_rewards.py, prompts of tests/support/make_pref_data.py with a `target` column) and
compares every step's loss, reward, reward_std, kl and completion lengths (1e-5 relative), and every completion
of every rank (--log-completions-every 1 logs the whole generation batch, gathered from every rank, as TRL does:
the same sampled tokens, hence text, as one process). Every completion draws from its own seeded generator; under
--rollout-engine exact each prompt's group is a call of its own, so the shapes, the logits and the tokens do not
depend on the layout bitwise. Under the default (batched) one process pads 2 prompts into one call where each of 2
ranks has one unpadded prompt: the logits then differ in their last bits (~1e-7 relative in fp32), and a token
could differ only where two Gumbel-perturbed scores tie that closely (never seen: docs/rl.md), so the cells compare
tokens exactly in both modes.

CI (6 launches):
- DeepSpeed ZeRO-3 with the batched rollout engine (the default) and the chunked policy loss (--chunked-loss 16:
  the policy's, old and reference log-probs through the head 16 tokens at a time), a full GPT-2, beta > 0 (a partitioned reference copy), Dr. GRPO's loss with GSPO's
  sequence-level ratio and its small clip range, --num-iterations 2 (old log-probs: each generation trained on
  twice; the second pass's ratios leave the clip range, the first's are 1), the 2-rank run stopped after step 3
  (inside the second generation's cycle) and resumed from its checkpoint's rank state (3 launches);
- FSDP2 stage 3 with --rollout-engine exact and grpo's default chunked policy head (the vocabulary's auto chunk,
  named on the banner), a LoRA Llama, beta > 0 (the reference is the base with the adapters off), chat prompts, bnpo's
  loss with batch-scaled rewards, a reward model beside the two functions (2 launches); final/ is the adapter;
- a reward function raising on one rank: one line naming it, every rank ends (1 short launch, FSDP2).
Slow: the whole logits (--chunked-loss 0, the dapo cell), the grpo and dapo loss types, steps_per_generation > 1 (TRL's dapo divisor, a resume inside such a cycle),
the per-forward gather path, top-k / top-p, a mixture of experts, the static KV cache (exact rollouts: each call's
cache sized by its own prompt, so 2 ranks still sample bitwise what one process samples), and the other family on each
backend.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.launch import REPO, rank_env, torchrun
from tests.support.make_pref_data import pairs, tiny_model

pytestmark = pytest.mark.multirank

REWARDS = f"{REPO / 'tests' / 'support' / 'grpo_rewards.py'}:known_words,{REPO / 'tests' / 'support' / 'grpo_rewards.py'}:says_target"
STEPS, PROMPTS, GEN = 4, 16, 4
COMPARED = ("loss", "reward", "reward_std", "kl", "completions/mean_length", "completions/clipped_ratio",
            "rewards/known_words/mean", "rewards/says_target/mean", "entropy")


def write_prompts(path: Path, n: int, conversational: bool = False) -> Path:
    rows = []
    for i, row in enumerate(pairs(n, seed=3)):
        prompt = [{"role": "user", "content": row["prompt"]}] if conversational else row["prompt"]
        rows.append({"prompt": prompt, "target": ["yes", "no", "maybe", "sun"][i % 4]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def rl(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("grpo")
    return {"root": root, "gpt2": tiny_model("gpt2", root / "gpt2"), "llama": tiny_model("llama", root / "llama"),
            "plain": write_prompts(root / "prompts.jsonl", PROMPTS),
            "chat": write_prompts(root / "chat.jsonl", PROMPTS, conversational=True)}


def train(rl: dict, out: Path, family: str, *args: str, nproc: int = 2, data: str = "plain", check: bool = True):
    """`zerotrain train --task grpo` on nproc ranks; the global batch (8 completions: 2 prompts x 4) is the same
    on any nproc (micro-batch 8 / nproc)."""
    return torchrun(["-m", "zerotrain", "train", "--task", "grpo", "--model", rl[family], "--data", rl[data],
                     "--output", out, "--reward-funcs", REWARDS, "--num-generations", GEN, "--max-completion-len", 12,
                     "--global-batch", 8, "--micro-batch", 8 // nproc, "--lr", 1e-3, "--schedule", "constant",
                     "--seed", 7, "--max-steps", STEPS, "--dist-timeout", 60, "--log-completions-every", 1, *args],
                    env=rank_env(), timeout=400, check=check, nproc=nproc)


def records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def completions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def assert_same_samples(ours: list[dict], theirs: list[dict]) -> None:
    """Every completion of every step (the whole generation batch, every rank's: 2 prompts x GEN) sampled as one
    process did (tokens, hence text, exactly); their rewards and advantages to 1e-5 (a reward model scores each
    rank's completions in a batch of its own shape)."""
    per_step = len(ours) // STEPS  # the generation batch: 2 prompts x GEN per step it serves (--steps-per-generation)
    assert per_step % (2 * GEN) == 0 and per_step >= 2 * GEN, len(ours)
    for log in (ours, theirs):
        assert [r["step"] for r in log] == [s for s in range(1, STEPS + 1) for _ in range(per_step)], log
    assert [(r["step"], r["prompt"], r["completion"]) for r in ours] == \
        [(r["step"], r["prompt"], r["completion"]) for r in theirs]
    assert all(len({json.dumps(r["prompt"]) for r in ours if r["step"] == s}) == per_step // GEN
               for s in range(1, STEPS + 1))
    for a, b in zip(ours, theirs):
        for k in ("reward", "advantage"):
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (a, b)


def assert_same_run(ours: list[dict], theirs: list[dict], keys=COMPARED) -> None:
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, len(ours) + 1))
    for a, b in zip(ours, theirs):
        for k in keys:
            if k not in b:
                continue
            assert k in a, (k, a)
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (a["step"], k, a[k], b[k])


SAMPLING = "sampling/sampling_logp_difference"


def _figures_learnt(recs: list[dict]) -> None:
    assert "reward" in recs[0]  # the first step generated; a step of a cycle that did not generate reports none
    for r in recs:
        # the generation's log-probs of the tokens it sampled are the training forward's before any update (TRL's
        # sampling_logp_difference; the KV cache and the padding move only the last bits in fp32)
        assert 0.0 <= r[f"{SAMPLING}/mean"] <= r[f"{SAMPLING}/max"] < 1e-5, r
        if "reward" not in r:
            continue
        assert math.isfinite(r["reward"]) and r["reward_std"] >= 0.0 and r["completions/mean_length"] > 0
        assert 0.0 <= r["rewards/known_words/mean"] <= 1.0
        assert all(k in r for k in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"))


def test_deepspeed_zero3_samples_and_trains_as_one_process_and_resumes(rl, tmp_path):
    """CI: GPT-2 (tied head), ZeRO-3, beta 0.04 against a partitioned frozen copy; Dr. GRPO's loss with GSPO's
    sequence-level ratio (its clip range 3e-4 / 4e-4), 2 iterations per generation (a cycle of 2 steps: old
    log-probs). The 2-rank run stops after step 3, inside the second cycle, and resumes to step 4 from the
    checkpoint's rank state: its 4 steps equal one process's straight run."""
    args = ("--backend", "deepspeed", "--stage", "3", "--beta", "0.04", "--loss-type", "dr_grpo",
            "--importance-sampling-level", "sequence", "--epsilon", "3e-4", "--epsilon-high", "4e-4",
            "--num-iterations", 2, "--save-every", 3, "--chunked-loss", 16)
    alone = train(rl, tmp_path / "one", "gpt2", *args, nproc=1)
    two = tmp_path / "two"
    train(rl, two, "gpt2", *args, "--max-steps", 3)
    assert (two / "checkpoints" / "global_step3" / "rank_state" / "rank1.pt").is_file()
    train(rl, two, "gpt2", *args, "--resume", "auto")
    one, resumed = records(tmp_path / "one"), records(two)
    assert len(one) == STEPS and all(r["kl"] >= 0 for r in resumed) and any(r["kl"] > 0 for r in resumed[1:])
    events = [r for r in map(json.loads, (two / "metrics.jsonl").read_text().splitlines()) if r.get("event")]
    assert any(r["event"] == "resume" for r in events)
    # the batched engine's call: a rank's prompt of the generation batch (2 prompts over 2 ranks, G 4); one process: 2
    rollouts = {"event": "rollouts", "engine": "batched", "rows_per_call": 4, "kv_cache": "dynamic"}
    assert [r for r in events if r["event"] == "rollouts"] == [{**rollouts, "step": 0}, {**rollouts, "step": 3}]
    assert "rollouts: batched engine, 8 rows per call, dynamic KV cache" in alone.stdout
    assert_same_run(resumed, one)
    _figures_learnt(resumed)
    # old log-probs: a generation's first pass samples from the policy it trains (every ratio 1), its second pass
    # trains the updated policy against the sampling one (ratios leave the small clip range); on-policy ratios
    # (no old log-probs kept) would clip nothing there
    assert [r["clip_ratio/region_mean"] > 0 for r in resumed] == [False, True, False, True], resumed
    assert_same_samples(completions(two), completions(tmp_path / "one"))  # the same tokens, before and after the resume
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(two / "final")  # final/ reloads as a HF causal LM


def test_fsdp2_lora_llama_chat_prompts_and_a_reward_model_as_one_process(rl, tmp_path):
    """CI: FSDP2 stage 3, a LoRA Llama (GQA, untied head), chat prompts, beta 0.04 against the base with the
    adapters off (no second copy), bnpo's loss with the advantages scaled by the whole batch's std, and a reward
    model (weight 0.5) beside the two functions. final/ is the adapter alone (peft's files, no merged model)."""
    from tests.support.grpo_rewards import reward_model_dir

    rm = reward_model_dir(tmp_path / "rm")
    args = ("--backend", "fsdp", "--stage", "3", "--lora-r", 4, "--beta", "0.04", "--loss-type", "bnpo",
            "--scale-rewards", "batch", "--reward-model", rm, "--reward-weights", "0.5,1,1", "--rollout-engine", "exact")
    train(rl, tmp_path / "one", "llama", *args, nproc=1, data="chat")
    run = train(rl, tmp_path / "two", "llama", *args, data="chat")
    assert "chunked loss: head + loss over chunks of" in run.stdout + run.stderr  # grpo's default
    assert "rollouts: exact engine, 4 rows per call, dynamic KV cache" in run.stdout  # one prompt's group a call
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert_same_run(two, one, keys=COMPARED + ("rewards/rm/mean", "rewards/rm/std"))
    _figures_learnt(two)
    assert "rewards/rm/mean" in one[0] and two[0]["rewards/rm/std"] > 0  # the model scored, and not alike
    assert_same_samples(completions(tmp_path / "two"), completions(tmp_path / "one"))
    final = tmp_path / "two" / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    assert not (final / "config.json").exists() and not (final / "model.safetensors").exists()
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and Path(adapter["base_model_name_or_path"]) == Path(rl["llama"]), adapter


def test_a_reward_function_failing_on_one_rank_ends_every_rank_in_one_line(rl, tmp_path):
    """CI: the function raises for a prompt whose target is "sun" (in the first step, rank 1's alone): one line
    naming the function and the prompt index, no traceback, and rank 0 stops with it (agreed) instead of waiting at
    the next collective."""
    failing = f"{REPO / 'tests' / 'support' / 'grpo_rewards.py'}:fails_on_sun"
    res = train(rl, tmp_path / "out", "gpt2", "--backend", "fsdp", "--stage", "3", "--reward-funcs", failing,
                "--max-steps", 1, check=False)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if "fails_on_sun" in line]
    ranks = res.stderr.split("torch/distributed/elastic")[0]  # what the ranks printed, before torchrun's own report
    assert len(lines) == 1 and "prompt index" in lines[0] and "Traceback" not in ranks, res.stderr[-3000:]
    assert "another rank failed" in ranks  # the other rank stopped with it (agreed), no hang


SLOW_CELLS = {
    "grpo-sequence-fsdp3-gpt2": ("gpt2", "--backend", "fsdp", "--stage", "3", "--loss-type", "grpo",
                                 "--importance-sampling-level", "sequence", "--rollout-engine", "exact"),
    "bnpo-batch-scale-ds3-llama": ("llama", "--backend", "deepspeed", "--stage", "3", "--loss-type", "bnpo",
                                   "--scale-rewards", "batch", "--top-k", "50", "--top-p", "0.9",
                                   "--rollout-rows", "4"),
    "mu2-two-steps-per-generation-ds2-gpt2": ("gpt2", "--backend", "deepspeed", "--stage", "2", "--num-iterations", "2",
                                              "--steps-per-generation", "2", "--mask-truncated-completions",
                                              "--epsilon-high", "0.28", "--beta", "0.04"),
    "gather-per-forward-ds3-lora-llama": ("llama", "--backend", "deepspeed", "--stage", "3", "--lora-r", "4",
                                          "--generation-gather", "forward", "--temperature", "0.7"),
    "static-cache-exact-ds3-gpt2": ("gpt2", "--backend", "deepspeed", "--stage", "3", "--rollout-engine", "exact",
                                    "--cache-implementation", "static"),
    "dapo-fsdp2-llama-reward-model-chat": ("llama", "--backend", "fsdp", "--stage", "2", "--scale-rewards", "none",
                                           "--reward-model", "{rm}", "--reward-weights", "0.5,1,1",
                                           "--chunked-loss", "0"),
}


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(SLOW_CELLS))
def test_matrix_samples_and_trains_as_one_process(rl, tmp_path, cell):
    family, *args = SLOW_CELLS[cell]
    if "{rm}" in args:  # a 1-label reward model built here, beside the functions
        from tests.support.grpo_rewards import reward_model_dir

        args = [reward_model_dir(tmp_path / "rm") if a == "{rm}" else a for a in args]
    data = "chat" if cell.endswith("chat") else "plain"
    train(rl, tmp_path / "one", family, *args, nproc=1, data=data)
    train(rl, tmp_path / "two", family, *args, data=data)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert len(two) == STEPS
    assert_same_run(two, one)
    _figures_learnt(two)
    assert_same_samples(completions(tmp_path / "two"), completions(tmp_path / "one"))
    if "--reward-model" in args:
        assert "rewards/rm/mean" in two[0] and two[0]["rewards/rm/std"] > 0


@pytest.mark.slow
def test_a_resume_inside_a_generation_cycle_is_exact(rl, tmp_path):
    """A cycle of 4 steps (2 steps per generation x 2 iterations): the 2-rank run stops after step 3 (inside the
    cycle) and resumes: the completions, old log-probs and TRL's dapo divisor come from the checkpoint (each rank's
    rank_state file), so steps 3-4 equal one process's straight run."""
    args = ("--backend", "fsdp", "--stage", "3", "--num-iterations", "2", "--steps-per-generation", "2",
            "--save-every", "1")
    train(rl, tmp_path / "one", "llama", *args, nproc=1)
    two = tmp_path / "two"
    train(rl, two, "llama", *args, "--max-steps", "3")
    assert (two / "checkpoints" / "global_step3" / "rank_state" / "rank1.pt").is_file()
    train(rl, two, "llama", *args, "--resume", "auto")
    assert_same_run(records(two), records(tmp_path / "one"))


@pytest.mark.slow
def test_a_mixture_of_experts_trains_with_its_router_loss(rl, tmp_path):
    """Mixtral (an MoE family no other cell names): --router-aux-coef adds the router's load-balancing loss to the
    policy loss (it is not accepted and ignored): each step's loss is the policy loss + coef x the router loss, and
    the experts' load is reported."""
    from tests.support.make_pref_data import tiny_model

    model = tiny_model("mixtral", tmp_path / "mixtral")
    rl = {**rl, "mixtral": model}
    train(rl, tmp_path / "out", "mixtral", "--backend", "deepspeed", "--stage", "3", "--router-aux-coef", "0.01")
    recs = records(tmp_path / "out")
    assert len(recs) == STEPS
    for r in recs:
        assert r["router_aux_loss"] > 0 and "expert_imbalance" in r
        assert math.isclose(r["loss"], r["lm_loss"] + 0.01 * r["router_aux_loss"], rel_tol=1e-6, abs_tol=1e-9)
