"""--task grpo refuses what it does not run with, in one line naming the setting and the fix, before any rank
starts (in-process `zerotrain train`, no process group); and the cycle arithmetic that assigns prompts to steps
and ranks does not depend on the layout."""
from __future__ import annotations

import json

import pytest

from zerotrain.cli import main
from zerotrain.config.load import build_config
from zerotrain.errors import ConfigError
from zerotrain.plan.rl_cycle import cycle_of

REWARD = "tests/support/grpo_rewards.py:known_words"


@pytest.fixture(scope="module")
def model_and_prompts(tmp_path_factory):
    from tests.support.make_pref_data import tiny_model

    root = tmp_path_factory.mktemp("grpo_rules")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"why do birds sing {i} ?"}) + "\n"
                                                for i in range(8)))
    return str(tiny_model("gpt2", root / "gpt2")), str(root / "prompts.jsonl"), root


@pytest.mark.parametrize("args,needle", [
    ((), "--reward-funcs"),
    (("--reward-funcs", "tests/support/grpo_rewards.py:nope"), "nope"),
    (("--reward-funcs", "tests/support/missing.py:fn"), "missing.py"),
    (("--reward-funcs", REWARD, "--loss-type", "cispo"), "--loss-type cispo is TRL's"),
    (("--reward-funcs", REWARD, "--use-vllm"), "--use-vllm"),
    (("--reward-funcs", REWARD, "--global-batch", 6, "--micro-batch", 1), "--global-batch 6 with --num-generations 4"),
    (("--reward-funcs", REWARD, "--eval-split", 0.25), "--eval-split"),
    (("--reward-funcs", REWARD, "--tp", 2), "--task grpo with --tp 2"),
    (("--reward-funcs", REWARD, "--sp", 2), "--task grpo with --sp 2: online RL under sequence parallelism is not built"),
    (("--reward-funcs", REWARD, "--packing", "separate"), "--packing"),
    (("--reward-funcs", REWARD, "--dpo-loss", "ipo"), "pref.loss"),
    (("--reward-funcs", REWARD, "--dpo-split-forward"), "pref.split_forward=True splits a pair's forward"),
    (("--reward-funcs", REWARD, "--steps-per-generation", 3, "--micro-batch", 4), "--steps-per-generation 3 with --grad-accum 2"),
])
def test_refused_in_one_line(model_and_prompts, capsys, args, needle):
    model, data, root = model_and_prompts
    code = main(["train", "--task", "grpo", "--model", model, "--data", data, "--output", str(root / "out"),
                 "--global-batch", "8", "--num-generations", "4", "--max-steps", "1", *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_beta_zero_is_grpos_only_and_rl_settings_are_grpos_only():
    assert build_config(overrides={"model.task": "grpo", "pref.beta": 0.0}).pref.beta == 0.0
    with pytest.raises(ConfigError, match="--beta 0 with --task dpo"):
        build_config(overrides={"model.task": "dpo", "pref.beta": 0.0})
    from zerotrain.config.rules import unused_settings

    cfg = build_config(overrides={"model.task": "causal-lm", "rl.num_generations": 4})
    with pytest.raises(ConfigError, match="rl.num_generations=4 is an online-RL setting"):
        unused_settings(cfg, "deepspeed", 3, "cpu")
    # the per-forward gather means something only where the weights are sharded: warned by name elsewhere (a
    # stage-dependent setting, as the ZeRO stage rules: compare/tune sweep stages with it)
    cfg = build_config(overrides={"model.task": "grpo", "rl.generation_gather": "forward"})
    assert unused_settings(cfg, "deepspeed", 3, "cpu") == [] and unused_settings(cfg, "fsdp", 1, "cpu") == []
    for backend, stage in (("deepspeed", 2), ("fsdp", 0)):
        (warning,) = unused_settings(cfg, backend, stage, "cpu")
        assert warning.startswith("rl.generation_gather=forward chooses how sharded weights reach generation")
    # a batched call's size means nothing where each prompt's group is generated alone
    assert unused_settings(build_config(overrides={"model.task": "grpo", "rl.rollout_rows": 16}), "fsdp", 2, "cpu") == []
    exact = build_config(overrides={"model.task": "grpo", "rl.rollout_engine": "exact", "rl.rollout_rows": 16})
    with pytest.raises(ConfigError, match="rl.rollout_rows=16 sizes a batched rollout call; rl.rollout_engine exact"):
        unused_settings(exact, "deepspeed", 3, "cpu")


@pytest.mark.parametrize("dp,micro,accum", [(1, 16, 1), (2, 8, 1), (4, 2, 2), (2, 2, 4)])
def test_each_prompt_belongs_to_the_same_step_on_every_layout(dp, micro, accum):
    """A generation batch of 2 steps x 4 prompts: prompt j trains in step j // 4 whatever the ranks, and each
    rank's share of a step is whole prompts (its completions fill its micro-batches exactly)."""
    cfg = build_config(overrides={"model.task": "grpo", "rl.num_generations": 4, "rl.steps_per_generation": 2 * accum})
    c = cycle_of(cfg, 16, accum, dp)
    assert (c.prompts_per_step, c.prompts_per_generation, c.steps) == (4, 8, 2)
    assert [c.owner(j)[0] for j in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for step in range(2):
        for rank in range(dp):
            mine = [j for j in range(8) if c.owner(j) == (step, rank)]
            assert len(mine) * 4 == micro * accum
    assert c.steps_per_epoch(17) == 4  # 2 whole generation batches of 8 prompts, 2 steps each


def test_estimate_counts_the_generation_phase():
    """The generation column: the KV cache of one prompt's completions always; the weights gathered for the phase
    only where they are sharded and gathered once (ZeRO-3 / FSDP2), not per forward; never with the activations."""
    from zerotrain.model.facts import model_facts
    from zerotrain.memory.estimate import Setup, estimate, setup_plan

    facts = model_facts("tiny-gpt2")

    def generation(stage: int, **rl) -> tuple[int, int]:
        cfg = build_config(overrides={"model.task": "grpo", "rl.num_generations": 8, "rl.max_completion_len": 64,
                                      "batch.global_batch": 16, "batch.micro_batch": 8,
                                      **{f"rl.{k}": v for k, v in rl.items()}})
        e = estimate(setup_plan(cfg, Setup("deepspeed", stage), 2, facts=facts, device="cpu"))
        assert e.device_bytes == sum(p.nbytes for p in e.parts if p.where == "device") + max(e.activations,
                                                                                               e.generation)
        return e.generation, facts.num_params
    kv_only, n = generation(2)
    gathered, _ = generation(3)
    per_forward, _ = generation(3, generation_gather="forward")
    assert kv_only > 0 and per_forward == kv_only and gathered == kv_only + 4 * (n - n // 2)
    longer, _ = generation(2, max_completion_len=128)
    assert longer > kv_only


def test_estimate_sizes_the_rollout_engines_generate_calls():
    """The KV cache and last-position logits of one generate call: the batched engine's call holds the rank's prompts of
    a generation batch (2 prompts x G 8 here), --rollout-rows caps it in whole groups, the exact engine holds one
    prompt's group."""
    from zerotrain.model.facts import model_facts
    from zerotrain.memory.estimate import Setup, estimate, setup_plan

    facts = model_facts("tiny-llama")

    def generation(**rl) -> int:
        cfg = build_config(overrides={"model.task": "grpo", "rl.num_generations": 8, "rl.max_completion_len": 64,
                                      "batch.global_batch": 32, "batch.micro_batch": 16,
                                      **{f"rl.{k}": v for k, v in rl.items()}})
        return estimate(setup_plan(cfg, Setup("deepspeed", 2), 2, facts=facts, device="cpu")).generation

    exact = generation(rollout_engine="exact")
    assert exact > 0 and generation() == 2 * exact
    assert generation(rollout_rows=8) == generation(rollout_rows=12) == exact  # whole groups of 8 a call
    assert generation(rollout_rows=64) == 2 * exact  # never more than the rank's prompts


def test_the_rollout_cache_is_transformers_named_one_and_grpos_only():
    from zerotrain.config.rules import unused_settings

    cfg = build_config(overrides={"model.task": "grpo", "rl.cache_implementation": "static"})
    assert cfg.rl.cache_implementation == "static" and unused_settings(cfg, "deepspeed", 3, "cpu") == []
    with pytest.raises(ConfigError, match="rl.cache_implementation': Input should be 'dynamic' or 'static'"):
        build_config(overrides={"model.task": "grpo", "rl.cache_implementation": "paged"})
    sft = build_config(overrides={"model.task": "causal-lm", "rl.cache_implementation": "static"})
    with pytest.raises(ConfigError, match="rl.cache_implementation=static is an online-RL setting; model.task is not "
                                          "grpo; drop it, or pass --task grpo"):
        unused_settings(sft, "deepspeed", 3, "cpu")


def test_a_static_cache_is_refused_before_launch_where_transformers_builds_none(model_and_prompts, capsys):
    """RWKV keeps a recurrent state of its own (transformers builds it no Cache, so it would ignore the setting):
    --cache-implementation static is refused by the plan, in one line naming the setting, the model type and the fix,
    from train's preflight (before any rank starts), estimate and config alike; GPT-2 (the fixture) has one."""
    from transformers import RwkvConfig, RwkvForCausalLM

    from tests.support.families import VOCAB
    from tests.support.make_pref_data import tiny_tokenizer
    from zerotrain.model.facts import model_facts
    from zerotrain.plan.run_plan import build_plan

    gpt2, data, root = model_and_prompts
    rwkv = root / "rwkv"
    RwkvForCausalLM(RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                               intermediate_size=64, context_length=128)).save_pretrained(str(rwkv))
    tiny_tokenizer().save_pretrained(str(rwkv))
    capsys.readouterr()
    line = ("rl.cache_implementation=static: RwkvForCausalLM (model type 'rwkv') has a cache of its own; "
            "drop --cache-implementation")
    static = ["--task", "grpo", "--model", str(rwkv), "--cache-implementation", "static"]
    for command in (["train", *static, "--data", data, "--output", str(root / "out"), "--reward-funcs", REWARD,
                     "--global-batch", "8", "--num-generations", "4", "--max-steps", "1"],
                    ["estimate", *static, "--nproc", "2"], ["config", *static]):
        code = main(command)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and line in err[0], (command[0], err)
    assert model_facts(gpt2).static_cache_refusal == ""
    cfg = build_config(overrides={"model.task": "grpo", "rl.cache_implementation": "dynamic"})
    assert build_plan(cfg, 2, device="cpu", facts=model_facts(str(rwkv))).facts.model_type == "rwkv"


def test_the_banner_and_metrics_name_the_rollouts_engine_rows_per_call_and_kv_cache(model_and_prompts):
    """A rank's largest rollout call: the batched engine's holds its prompts of a generation batch (2 prompts x G 8
    here), --rollout-rows caps it in whole groups, the exact engine's one prompt's group (as the estimate sizes it);
    the KV cache is transformers' dynamic one by default, the static one asked for, or a model's own (RWKV)."""
    from transformers import RwkvConfig

    from zerotrain.model.facts import kv_cache_of, load_hf_config, meta_model
    from zerotrain.train.grpo import Rollouts

    cfg = build_config(overrides={"model.task": "grpo", "rl.num_generations": 8})
    c = cycle_of(cfg, 32, 1, 2)
    assert [c.rows_per_call("batched", n) for n in (0, 8, 12, 64)] == [16, 8, 8, 16]
    assert c.rows_per_call("exact", 0) == 8
    gpt2 = meta_model(load_hf_config(model_and_prompts[0]))
    rwkv = meta_model(RwkvConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, attention_hidden_size=16,
                                 intermediate_size=32, context_length=32))
    assert [kv_cache_of(gpt2, None), kv_cache_of(gpt2, "dynamic"), kv_cache_of(gpt2, "static")] == \
        ["dynamic", "dynamic", "static"]
    assert kv_cache_of(rwkv, None) == "own"
    r = Rollouts("batched", 16, "dynamic")
    assert r.phrase() == "rollouts: batched engine, 16 rows per call, dynamic KV cache"
    assert r.record(3) == {"event": "rollouts", "step": 3, "engine": "batched", "rows_per_call": 16, "kv_cache": "dynamic"}
