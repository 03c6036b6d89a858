"""Sequence parallelism without ranks: the plan's rules (one-line refusals of what the all-to-all attention cannot
carry), the layout (which ranks share a sequence, which count for the data), and the cut of a batch (labels shifted
before the cut, global positions, padding to a multiple of sp). The parity runs: tests/multirank/test_sequence_parallel.py."""
from __future__ import annotations

import pytest
import torch

from zerotrain.config.load import build_config
from zerotrain.model.facts import ModelFacts, model_facts
from zerotrain.model.sequence_parallel import IGNORE, SequenceGroup, label_tokens, shard_batch
from zerotrain.plan.run_plan import WorldLayout, build_plan


def _plan(facts: ModelFacts | None = None, world: int = 2, backend: str = "fsdp", **settings):
    cfg = build_config(overrides={"parallel.sp": 2, "backend": backend, "zero.stage": 3,
                                  **{k.replace("__", "."): v for k, v in settings.items()}})
    return build_plan(cfg, world, backend=backend, device="cpu", facts=facts or model_facts("tiny-llama"))


def _facts(**changes) -> ModelFacts:
    from dataclasses import replace

    return replace(model_facts("tiny-llama"), **changes)


@pytest.mark.parametrize("kw,needle", [
    (dict(parallel__tp=2, world=4), "--sp 2 with --tp 2: sp and tp together are not supported yet on the fsdp backend"),
    (dict(world=3), "--sp 2 does not divide the world of 3 ranks"),
    (dict(model__task="seq-cls"), "--sp 2 needs a causal-lm model (got model.task=seq-cls)"),
    (dict(data__packing="separate"), "--packing separate with --sp 2: documents packed into one row need"),
    (dict(facts=_facts(attention_types=("sliding_attention", "sliding_attention"))),
     "--sp 2: the model's blocks use sliding_attention, a mask the sequence-parallel attention does not build"),
    (dict(facts=_facts(num_heads=3, num_kv_heads=3)), "--sp 2 does not divide the model's 3 attention heads"),
    (dict(parallel__sp=4, world=4, facts=_facts(num_heads=12, num_kv_heads=6)),
     "--sp 4 with the model's 6 key/value heads: sp must divide them or be a multiple of them"),
])
def test_refusals_are_one_line(kw, needle):
    world, backend, facts = kw.pop("world", 2), kw.pop("backend", "fsdp"), kw.pop("facts", None)
    with pytest.raises(ValueError) as e:
        _plan(facts, world, backend, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_layout_groups_counting_and_banner():
    layout = WorldLayout(4, sp=2)
    assert layout.dp == 2 and [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # sp ranks share a replica
    assert [layout.coordinate(r, "sp") for r in range(4)] == [0, 1, 0, 1]
    assert [layout.counts_for_data(r) for r in range(4)] == [True, False, True, False]
    plan = _plan(world=4)
    assert plan.batch.global_batch == plan.cfg.batch.micro_batch * 2  # dp = 2 replicas, not 4 ranks
    assert "4 ranks = data-parallel 2 x sequence-parallel 2" in plan.describe()
    assert "Ulysses all-to-all attention" in plan.describe()
    assert _plan(facts=_facts(num_kv_heads=1)).world.sp == 2  # one key/value head: repeated, not refused


def test_deepspeed_json_leaves_the_batch_to_deepspeed_under_sp():
    """ZeRO's data-parallel world is dp x sp (no mpu): DeepSpeed derives train_batch_size = micro x accum x all
    ranks itself; the plan's global batch (dp replicas only) would fail its check."""
    from zerotrain.plan.ds_config import render

    ds = render(_plan(backend="deepspeed"))
    assert "train_batch_size" not in ds and ds["train_micro_batch_size_per_gpu"] == 4
    assert render(_plan(backend="deepspeed", parallel__sp=1))["train_batch_size"] == 8


def test_the_cut_shifts_labels_first_and_pads_to_a_multiple_of_sp():
    ids = torch.arange(10, 17).unsqueeze(0).repeat(2, 1)  # 7 tokens: padded to 8 for sp=2
    labels = ids.clone()
    labels[1, :3] = IGNORE  # a prompt the loss skips
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "use_cache": False}
    halves = [shard_batch(batch, SequenceGroup(None, 2, r), pad_id=0) for r in range(2)]
    assert "attention_mask" not in halves[0] and halves[0]["use_cache"] is False
    ids_cat = torch.cat([h["input_ids"] for h in halves], dim=1)
    assert ids_cat[:, :7].equal(ids) and ids_cat[:, 7].eq(0).all()
    assert torch.cat([h["position_ids"] for h in halves], dim=1).equal(torch.arange(8).expand(2, 8))
    shifted = torch.cat([h["shift_labels"] for h in halves], dim=1)
    assert shifted[0, :6].equal(ids[0, 1:]) and shifted[:, 6:].eq(IGNORE).all()  # the edge token keeps its label
    assert shifted[1, :2].eq(IGNORE).all() and shifted[1, 2:6].equal(ids[1, 3:])
    assert all(h["labels"] is h["shift_labels"] for h in halves)
    assert int((shifted != IGNORE).sum()) == label_tokens(labels) == 6 + 4


def test_estimate_knows_sp():
    from zerotrain.memory.estimate import estimate
    from zerotrain.memory.runtime import outside_calibration

    one = estimate(_plan(world=2, parallel__sp=1))  # dp 2
    two = estimate(_plan(world=2))  # sp 2: the same 2 ranks shard the model states (FSDP2 over dp x sp)
    assert two.activations * 2 == pytest.approx(one.activations, rel=0.02)
    assert two.model_states == one.model_states
    assert "sp 2 (largest measured: 1)" in outside_calibration(two.plan, two.plan.facts)
