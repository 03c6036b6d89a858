"""Sequence parallelism without ranks: the plan's rules (one-line refusals of what the all-to-all attention cannot
carry), the layout (which ranks share a sequence, which count for the data), the cut of a batch (labels shifted
before the cut, global positions, padding to a multiple of sp) and the masks the attention rebuilds (sliding
windows, packed documents: equal to the model's own, through a one-rank group). The parity runs: tests/multirank/test_sequence_parallel.py."""
from __future__ import annotations

import pytest
import torch

from zerotrain.config.load import build_config
from zerotrain.model.facts import ModelFacts, model_facts
from zerotrain.model.sequence_parallel import IGNORE, SequenceGroup, label_tokens, shard_batch
from zerotrain.distributed.layout import WorldLayout
from zerotrain.plan.run_plan import build_plan


def _plan(facts: ModelFacts | None = None, world: int = 2, backend: str = "fsdp", **settings):
    cfg = build_config(overrides={"parallel.sp": 2, "backend": backend, "zero.stage": 3,
                                  **{k.replace("__", "."): v for k, v in settings.items()}})
    return build_plan(cfg, world, backend=backend, device="cpu", facts=facts or model_facts("tiny-llama"))


def _facts(**changes) -> ModelFacts:
    from dataclasses import replace

    return replace(model_facts("tiny-llama"), **changes)


def _bloom() -> ModelFacts:
    """A real family whose attention is its own code (BloomPreTrainedModel is not attention-backend compatible)."""
    from transformers import BloomConfig

    from zerotrain.model.facts import facts_of, meta_model

    cfg = BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=256)
    return facts_of(meta_model(cfg), cfg)


@pytest.mark.parametrize("kw,needle", [
    (dict(parallel__tp=2, world=4, facts=_facts(num_heads=2, num_kv_heads=2)),
     "--sp 2 with --tp 2: sp does not divide the 1 attention heads each tensor-parallel rank computes (the model's 2 "
     "/ tp 2"),
    (dict(parallel__tp=2, parallel__sp=4, world=8, facts=_facts(num_heads=16, num_kv_heads=12)),
     "--sp 4 with --tp 2: the 6 key/value heads each tensor-parallel rank computes (the model's 12 / tp 2) must be "
     "divided by sp or divide it"),
    (dict(parallel__tp=2, world=4, facts=_facts(num_heads=4, num_kv_heads=3)),
     "--tp 2 does not divide the model's 3 key/value heads"),
    (dict(parallel__pp=2, world=4), "--pp 2 with --sp 2: pp and sp together are not supported yet on the fsdp backend"),
    (dict(world=3), "--sp 2 does not divide the world of 3 ranks"),
    (dict(model__task="seq-cls"), "--sp 2 needs a causal-lm model (got model.task=seq-cls)"),
    (dict(facts=_facts(attention_types=("chunked_attention", "full_attention"))),
     "--sp 2: the model's blocks use chunked_attention, a mask the sequence-parallel attention does not build (it "
     "builds full_attention, sliding_attention)"),
    (dict(facts="bloom"),
     "--sp 2: model type 'bloom' computes attention in its own code, not through transformers' attention interface"),
    (dict(facts=_facts(attention_extras=("attn_logit_softcapping",))),
     "--sp 2: the model's attention adds attn_logit_softcapping, which the sequence-parallel attention"),
    (dict(facts=_facts(num_heads=3, num_kv_heads=3)), "--sp 2 does not divide the model's 3 attention heads"),
    (dict(parallel__sp=4, world=4, facts=_facts(num_heads=12, num_kv_heads=6)),
     "--sp 4 with the model's 6 key/value heads: sp must divide them or be a multiple of them"),
])
def test_refusals_are_one_line(kw, needle):
    world, backend, facts = kw.pop("world", 2), kw.pop("backend", "fsdp"), kw.pop("facts", None)
    facts = _bloom() if facts == "bloom" else facts
    with pytest.raises(ValueError) as e:
        _plan(facts, world, backend, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sp_with_tp_runs_on_fsdp():
    """sp x tp is a row of the capability table on FSDP2: the heads / tp of a tensor-parallel rank cut over sp (one
    key/value head per tp rank repeated for both sp ranks), the sp groups of ranks with the same tp coordinate, the
    FSDP2 mesh (dp x sp, tp) (tests/unit/test_parallel_owner.py builds it)."""
    plan = _plan(world=4, parallel__tp=2)
    assert plan.world.sp == plan.world.tp == 2 and plan.world.dp == 1 and plan.world.shard_ranks == 2
    assert "4 ranks = data-parallel 1 x tensor-parallel 2 x sequence-parallel 2" in plan.describe()
    assert plan.world.groups("sp") == [[0, 2], [1, 3]] and plan.world.groups("tp") == [[0, 1], [2, 3]]
    assert _plan(world=8, parallel__tp=2).world.shard_ranks == 4  # dp 2 x sp 2
    assert _plan(world=4, parallel__tp=2, facts=_facts(num_kv_heads=2)).world.tp == 2


def test_sp_with_tp_on_deepspeed_runs_autotp_at_zero_0_to_2():
    """DeepSpeed composes AutoTP with the all-to-all attention (benchmarks/results/sp_tp_deepspeed_probe/): a
    default stage resolves to 2 (AutoTP's limit), an explicit stage 3 is refused in one line naming the fix."""
    from zerotrain.plan.ds_config import render

    cfg = build_config(overrides={"parallel.sp": 2, "parallel.tp": 2, "backend": "deepspeed"})
    plan = build_plan(cfg, 4, backend="deepspeed", device="cpu", facts=model_facts("tiny-llama"))
    assert plan.sharding.effective_stage == 2 and "blocks split by DeepSpeed AutoTP" in plan.describe()
    ds = render(plan)
    assert ds["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in ds
    with pytest.raises(ValueError) as e:
        _plan(world=4, backend="deepspeed", parallel__tp=2)
    assert str(e.value) == ("--tp 2 with --stage 3 on the deepspeed backend: DeepSpeed's AutoTP training supports "
                            "ZeRO 0-2; pass --stage 1 or --stage 2 or --backend fsdp")


def test_the_tp_mesh_shards_over_dp_x_sp(monkeypatch):
    """Under sp x tp the FSDP2 mesh is (dp x sp, tp): its rows (the ranks of one dp and sp coordinate, in rank order)
    are the tp groups, its columns the ranks of one tp coordinate that shard the blocks (and the sp groups within
    them); the sp groups stay the layout's."""
    import torch.distributed.device_mesh as dm

    from zerotrain.distributed import mesh

    asked: list[tuple] = []
    monkeypatch.setattr(dm, "init_device_mesh", lambda dev, shape, mesh_dim_names=None: asked.append(
        (shape, mesh_dim_names)) or shape)
    for world, shape in ((4, (2, 2)), (8, (4, 2))):
        assert mesh.ParallelMeshes(WorldLayout(world, tp=2, sp=2), "cpu").get("tp") == shape
    assert asked == [((2, 2), ("dp", "tp")), ((4, 2), ("dp", "tp"))]
    lay = WorldLayout(8, tp=2, sp=2)  # dp 2: ranks (dp, sp, tp) = 4 * dp + 2 * sp + tp
    assert lay.groups("dp", "sp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the mesh's columns: shard ranks of one tp rank
    assert lay.groups("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


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

    # per-token activations (the fused loss's fixed head-gradient buffer aside)
    one = estimate(_plan(world=2, parallel__sp=1, model__fused_loss=False))  # dp 2
    two = estimate(_plan(world=2, model__fused_loss=False))  # sp 2: the same 2 ranks shard the model states (FSDP2 over dp x sp)
    assert two.activations * 2 == pytest.approx(one.activations, rel=0.02)
    assert two.model_states == one.model_states
    assert "sp 2 (largest measured: 1)" in outside_calibration(two.plan, two.plan.facts)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-process gloo world: the all-to-alls are identities, the attention and its masks are what is tested."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                                world_size=1)
    yield SequenceGroup(dist.group.WORLD, 1, 0)
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("family,packed", [("mistral", False), ("qwen2-alternating", False), ("llama", True),
                                           ("mistral", True)])
def test_rebuilt_masks_equal_the_models_own(family, packed, one_rank_group, tmp_path):
    """The sequence-parallel attention's whole-sequence masks (a sliding window of 16 over 40 tokens, Qwen2's full
    and sliding blocks, documents packed into one row by restarting position ids) give the logits the model gives
    with its own masks (SDPA)."""
    import tests.support.families as families
    from zerotrain.model import sequence_parallel as seqpar

    build = families.builder(families.make_model_dir(family, tmp_path / family), "causal-lm")
    x = torch.randint(0, families.VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x}
    if packed:  # row 0: documents of 11, 20, 9 tokens; row 1: one of 40
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(11), torch.arange(20), torch.arange(9)]),
                                             torch.arange(40)])
    with torch.no_grad():
        own = build().eval()(**batch, use_cache=False).logits
        model = build().eval()
        seqpar.install(model, one_rank_group)
        cut = shard_batch(dict(batch), one_rank_group)
        assert (one_rank_group.documents is not None) == packed
        mine = model(**cut, use_cache=False).logits
        # the same cut attended plain causal (no documents, no window): the masks are what made them equal
        one_rank_group.documents, one_rank_group.masks = None, None
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        model.config.sliding_window = None
        unmasked = model(**cut, use_cache=False).logits
    torch.testing.assert_close(mine, own, rtol=1e-5, atol=1e-5)
    assert (unmasked - own).abs().max() > 1e-3
