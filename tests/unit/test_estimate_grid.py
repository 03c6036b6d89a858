"""estimate / compare / tune over the composed layouts (issue 52): tp x pp (x dp) and sp x tp are planned and
estimated where the capability table lists them (FSDP2) and refused where it does not (DeepSpeed), and the per-rank
model-state bytes of a tp2 x pp2 and an sp2 x tp2 rank are the hand count of what the rank holds."""
from __future__ import annotations

import argparse
import json

import pytest

from zerotrain.plan.capabilities import BACKENDS, COMBINATIONS
from zerotrain.tasks import task_spec

# tiny-llama (zerotrain/assets/demo.py): hidden 64, MLP 176, 2 blocks, 4 query / 2 key-value heads (head dim 16),
# vocab 1024, untied head. Its HF tp_plan splits q, k, v, gate, up by output rows (colwise) and o, down by input
# columns (rowwise); norms, embeddings and the head stay whole.
H, I, V, KV = 64, 176, 1024, 2 * 16
EMBED = HEAD = V * H
BLOCK_TP2 = (H // 2 * H + KV // 2 * H * 2 + H * H // 2  # q, k, v (colwise), o (rowwise)
             + 3 * (I // 2) * H + 2 * H)                  # gate, up (colwise), down (rowwise), two RMSNorms
assert BLOCK_TP2 == 23168


def _plan(backend: str, stage: int, world: int, **degrees: int):
    from zerotrain.config.load import build_config
    from zerotrain.memory.estimate import Setup, setup_plan
    from zerotrain.model.facts import model_facts

    cfg = build_config(overrides={"model.from_config": "tiny-llama", "batch.grad_accum": 2,
                                  **{f"parallel.{d}": n for d, n in degrees.items()}})
    return setup_plan(cfg, Setup(backend, stage), world, facts=model_facts("tiny-llama"), device="cpu")


def test_the_composed_rows_name_their_backends() -> None:
    assert set(COMBINATIONS[frozenset({"tp", "pp"})]) == {"fsdp"}
    assert set(COMBINATIONS[frozenset({"sp", "tp"})]) == {"deepspeed", "fsdp"}  # DeepSpeed: AutoTP x Ulysses, ZeRO 0-2


def test_tp2_x_pp2_bytes_are_the_hand_count() -> None:
    """FSDP2 ZeRO-3 on 4 ranks, tp2 x pp2 (dp 1): stage 0 holds [Embed, Block 0], stage 1 [Block 1, norm, Head],
    each block linear cut in half; a pipeline measures at the accumulation boundary, so every rank holds 4 bytes of
    params + 4 of grads + 8 of Adam per element it holds: 16 x P_stage. The worst rank is the last stage (the
    final norm besides the head); with dp 2 (8 ranks) FSDP2 halves every tensor's rows."""
    from zerotrain.memory.estimate import estimate

    stage0, stage1 = EMBED + BLOCK_TP2, BLOCK_TP2 + H + HEAD
    est = estimate(_plan("fsdp", 3, 4, tp=2, pp=2))
    assert (est.plan.world.tp, est.plan.world.pp, est.plan.world.dp) == (2, 2, 1)
    assert [m for m, _ in est.stages] == [16 * stage0, 16 * stage1] == [1_419_264, 1_420_288]
    assert est.pp_stage == 1 and est.largest_stage_model_states == est.model_states == 16 * stage1
    assert est.by_category() == {"params": 4 * stage1, "grads": 4 * stage1, "optimizer_states": 8 * stage1,
                                 "master": 0, "buffers": 0, "reference": 0}
    dp2 = estimate(_plan("fsdp", 3, 8, tp=2, pp=2))
    assert dp2.plan.world.dp == 2 and [m for m, _ in dp2.stages] == [8 * stage0, 8 * stage1]
    # activations: under GPipe every stage keeps all 2 micro-batches; only the last holds the logits
    assert dp2.stages[1][1] > dp2.stages[0][1]


def test_sp2_x_tp2_bytes_are_the_hand_count() -> None:
    """FSDP2 ZeRO-3 on 4 ranks, sp2 x tp2 (dp 1): the whole model's tp-local tensors sharded over dp x sp = 2 ranks;
    mid-accumulation (grad-accum 2) the gradients are the unsharded tp-local ones."""
    from zerotrain.memory.estimate import estimate

    local = EMBED + 2 * BLOCK_TP2 + H + HEAD
    est = estimate(_plan("fsdp", 3, 4, sp=2, tp=2))
    assert (est.plan.world.sp, est.plan.world.tp, est.plan.world.dp) == (2, 2, 1) and est.stages == ()
    assert est.by_category() == {"params": 4 * local // 2, "grads": 4 * local, "optimizer_states": 8 * local // 2,
                                 "master": 0, "buffers": 0, "reference": 0}
    tp_only = estimate(_plan("fsdp", 3, 2, tp=2))  # the same tp-local model on one dp rank: sp halves its acts
    assert est.activations < tp_only.activations


@pytest.mark.parametrize("degrees,needle", [
    ({"tp": 2, "pp": 2}, "--tp 2 with --pp 2 on the deepspeed backend: DeepSpeed .*AutoTP does not compose with its pipeline engine"),
    ({"sp": 2, "tp": 2, "stage": 3}, "--tp 2 with --stage 3 on the deepspeed backend: DeepSpeed's AutoTP training "
                                     "supports ZeRO 0-2"),
])
def test_deepspeed_refuses_the_composed_layouts_in_one_line(degrees, needle) -> None:
    from zerotrain.errors import ConfigError

    stage = degrees.pop("stage", 1)
    with pytest.raises(ConfigError, match=needle) as e:
        _plan("deepspeed", stage, 4, **degrees)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags,dims,ds_refused", [(["--tp", "2", "--pp", "2"], (2, 2, 1), {0, 1, 2, 3}),
                                                   (["--sp", "2", "--tp", "2"], (2, 1, 1), {3})])
def test_estimate_lists_the_composed_layout_where_the_table_runs_it(capsys, flags, dims, ds_refused) -> None:
    """`zerotrain estimate` lists FSDP's rows (stage 0, DDP, refused as under tp alone) and DeepSpeed's where the
    capability table runs the layout (sp x tp: AutoTP at ZeRO 0-2), naming its refusals."""
    from zerotrain.cli import main

    assert main(["estimate", "--model", "tiny-llama", "--nproc", "4", "--grad-accum", "2", *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["pp"], out["dp"]) == dims
    assert {e["backend"] for e in out["estimates"]} == {"fsdp"} | ({"deepspeed"} if ds_refused != {0, 1, 2, 3} else set())
    assert ("fsdp", 0) in {(r["backend"], r["stage"]) for r in out["refused"]}
    assert not [r for r in out["refused"] if r["backend"] == "fsdp" and "not supported yet" in r["error"]]
    assert {r["stage"] for r in out["refused"] if r["backend"] == "deepspeed"} == ds_refused
    if "--pp" in flags:
        worst = [e for e in out["estimates"] if (e["stage"], e["offload_optimizer"]) == (3, "none")][0]
        assert worst["pp_stage"] == 1 and worst["model_states"] == 16 * (BLOCK_TP2 + H + HEAD)


def _compare_args(*argv: str) -> argparse.Namespace:
    from zerotrain.commands.compare import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([*argv, "--output", "x"])


def test_compare_plans_tp_x_pp_and_sp_x_tp_on_fsdp_and_refuses_them_on_deepspeed() -> None:
    """compare's grid (every --tp x --pp x --sp point x backend) plans what the capability table lists on each
    backend and records the rest as refused, reading the table through the rules (nothing hard-coded)."""
    from zerotrain.commands.compare import _planned, base_config, plan_grid
    from zerotrain.model.facts import model_facts

    args = _compare_args("--backends", "deepspeed,fsdp", "--stages", "1,3", "--tp", "1,2", "--pp", "1,2", "--sp",
                         "1,2", "--model-config", "tiny-llama", "--nproc", "4", "--grad-accum", "2")
    cfg, facts = base_config(args), model_facts("tiny-llama")
    planned = {}
    for tp, pp, sp, ep, s in plan_grid(args):
        plan, err = _planned(cfg, s, 4, facts, tp, pp, sp, ep)
        planned[(s.backend, s.stage, tp, pp, sp)] = plan is not None
        if plan is None:
            assert err.startswith("refused: ") and "\n" not in err
    for backend in BACKENDS:
        for dims, (tp, pp, sp) in ((frozenset({"tp", "pp"}), (2, 2, 1)), (frozenset({"sp", "tp"}), (2, 1, 2))):
            ran = any(planned[(backend, st, tp, pp, sp)] for st in (1, 3))
            assert ran == (backend in COMBINATIONS[dims]), (backend, dims)
    assert planned[("fsdp", 3, 2, 2, 1)] and planned[("fsdp", 3, 2, 1, 2)]
    assert not planned[("fsdp", 3, 1, 2, 2)]  # sp with pp: no row


def test_tune_searches_tp_x_pp_and_sp_x_tp_where_the_table_lists_them() -> None:
    """tune's auto degrees on 4 ranks (1, 2, 4 each) give tp2 x pp2 and, for a long sequence, sp2 x tp2 candidates;
    they are predicted on FSDP (with the hand-counted model states); on DeepSpeed tp x pp is refused with the
    table's line and sp x tp predicted."""
    from zerotrain.commands.tune import _space, add_arguments
    from zerotrain.config.load import build_config
    from zerotrain.model.facts import model_facts
    from zerotrain.search.tune_decisions import predict, search_space

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-o", "x", "--backends", "deepspeed,fsdp", "--stages", "1,3", "--checkpointing", "off",
                         "--micro-batches", "1", "--reducers", "off"])
    space = _space(args, 4, False, 4096)
    assert (2 in space.tps, 2 in space.pps, 2 in space.sps) == (True, True, True)
    cfg = build_config(overrides={"model.from_config": "tiny-llama", "data.seq_len": 4096, "batch.global_batch": 4})
    facts = model_facts("tiny-llama")
    rows = {r["name"]: r for r in (predict(c, cfg, 4, facts, "cpu")[0] for c in search_space(4, 4, space))}
    assert rows["fsdp-tp2-pp2-z3-mb1"]["status"] == ""
    assert rows["fsdp-tp2-pp2-z3-mb1"]["predicted_model_state_bytes"] == 16 * (BLOCK_TP2 + H + HEAD)
    assert rows["fsdp-tp2-sp2-z3-mb1"]["status"] == ""
    assert rows["deepspeed-tp2-pp2-z1-mb1"]["status"] == "refused"
    assert "AutoTP does not compose with its pipeline engine" in rows["deepspeed-tp2-pp2-z1-mb1"]["reason"]
    assert rows["deepspeed-tp2-sp2-z1-mb1"]["status"] == ""  # AutoTP x Ulysses (issue 52)
    assert rows["fsdp-pp2-sp2-z3-mb1"]["status"] == "refused"  # no row for sp with pp


def test_lora_under_tp_x_pp_holds_each_stage_s_share_of_the_base_and_the_adapters() -> None:
    """LoRA inside FSDP2 pipeline stages: the stages' frozen base tensors add up to the whole base, the tp plan halves
    a base linear (peft's base_layer of q_proj) as it halves q_proj; a LoRA tp2 x pp2 rank's parameters are its
    stage's tp-local base plus its adapters, 4 bytes each (FSDP2, dp 1)."""
    import math

    from zerotrain.config.load import build_config
    from zerotrain.memory import parallel as par
    from zerotrain.memory.estimate import Setup, estimate, setup_plan
    from zerotrain.model.source import model_facts_for

    cfg = build_config(overrides={"model.name": "tiny-llama", "lora.r": 4, "lora.targets": "q_proj,v_proj",
                                  "parallel.pp": 2, "parallel.tp": 2})
    facts = model_facts_for(cfg)
    plan = setup_plan(cfg, Setup("fsdp", 3), 4, facts=facts, device="cpu")
    lora = plan.preparation.lora
    layout = par.layout_for(facts, "tiny-llama", task_spec("causal-lm"), lora)
    frozen = par.frozen_layout("tiny-llama", task_spec("causal-lm"), lora)
    assert len(frozen.names) == len(facts.frozen_shapes)
    whole = [par.rank_shapes(frozen, facts, 1, 2, k, shapes=facts.frozen_shapes) for k in range(2)]
    assert sum(math.prod(s) for st in whole for s in st) == facts.frozen_params
    q = next(i for i, n in enumerate(frozen.names) if n.endswith("layers.0.self_attn.q_proj.base_layer.weight"))
    assert par.tp_local_shape(facts.frozen_shapes[q], frozen.block_rel[q], facts.block_tp_plan, 2) == (H // 2, H)
    est = estimate(plan)
    last = par.rank_shapes(frozen, facts, 2, 2, 1, shapes=facts.frozen_shapes) + par.rank_shapes(layout, facts, 2, 2, 1)
    assert len(est.stages) == 2 and est.pp_stage == 1 and est.by_category()["params"] == 4 * sum(map(math.prod, last))
    assert sum(map(math.prod, last)) < (facts.frozen_params + sum(map(math.prod, facts.param_shapes))) / 2


def test_sp_x_tp_all_to_all_sends_each_tp_rank_s_heads_only() -> None:
    """tiny-llama (4 heads, 2 key/value heads of 16, 2 blocks), micro-batch 2 x 64 tokens, fp32: sp 2 sends per block
    32 tokens x 16 x (2 x 4 query/output + 2 x 2 key/value heads) x 4 bytes x 2 (backward) x 1/2 (kept); under tp 2 a
    rank holds 2 query heads and 1 key/value head, repeated up to sp 2: (2 x 2 + 2 x 2)."""
    from zerotrain.memory.activations import all_to_all_bytes
    from zerotrain.model.facts import model_facts

    facts = model_facts("tiny-llama")
    assert all_to_all_bytes(facts, 2, 64, "fp32", 2) == 2 * 2 * (2 * 32 * 16 * 12 * 4) // 2 == 98_304
    assert all_to_all_bytes(facts, 2, 64, "fp32", 2, tp=2) == 2 * 2 * (2 * 32 * 16 * 8 * 4) // 2 == 65_536


@pytest.mark.parametrize("stage", [0, 2])
def test_autoep_ranks_hold_half_the_experts_in_the_estimate(stage) -> None:
    """--ep 2 on DeepSpeed (AutoEP), 2 ranks, fp32: a rank holds its dense weights and 1/2 of the experts, at stage 2
    the dense flat group partitioned over both ranks and the experts' over their one copy (ep 2 x expert_dp 1):
    params + grads + Adam by hand (measured vs predicted by `zerotrain compare`: 0.0% and 0.41%,
    benchmarks/results/ep_deepspeed_estimate.txt)."""
    from zerotrain.config.load import build_config
    from zerotrain.memory.estimate import Setup, estimate, setup_plan
    from zerotrain.model.facts import model_facts

    facts = model_facts("tiny-qwen3-moe")
    cfg = build_config(overrides={"model.from_config": "tiny-qwen3-moe", "parallel.ep": 2})
    est = estimate(setup_plan(cfg, Setup("deepspeed", stage), 2, facts=facts, device="cpu"))
    dense, experts = facts.num_params - facts.expert_params, facts.expert_params // 2
    cats = est.by_category()
    if stage == 0:
        assert (cats["params"], cats["grads"], cats["optimizer_states"]) == (4 * (dense + experts),) * 2 + (
            8 * (dense + experts),)
    else:  # the flat groups padded to 2 x their ranks; the master and Adam states are this rank's partition
        pad = lambda n, k: -(-n // (2 * k)) * (2 * k)  # noqa: E731
        part = pad(dense, 2) // 2 + pad(experts, 1)
        assert (cats["master"], cats["optimizer_states"]) == (4 * part, 8 * part)
        assert cats["params"] == 4 * (pad(dense, 2) + pad(experts, 1))
