"""Tensor x pipeline parallelism's rules and layout lines, without ranks: accepted on FSDP2 (a capability row),
refused on DeepSpeed with the probe's line (benchmarks/results/tp_pp_deepspeed_probe/), the tp split's checks still
applied inside the stages, LoRA under pp on FSDP only, and the launcher's lines naming every group (warned when a
tensor-parallel group spans hosts)."""
from __future__ import annotations

import pytest

from zerotrain.config.load import build_config
from zerotrain.distributed.layout import WorldLayout
from zerotrain.errors import ConfigError
from zerotrain.model.facts import model_facts
from zerotrain.plan.run_plan import build_plan


def _plan(world: int, **overrides):
    cfg = build_config(overrides={"data.pack": True, **overrides})
    facts = model_facts(cfg.model.from_config or "tiny-llama")
    return build_plan(cfg, world, backend=cfg.backend, device="cpu", facts=facts)


def test_tp_pp_runs_on_fsdp_with_both_splits_named():
    plan = _plan(8, **{"parallel.tp": 2, "parallel.pp": 2, "backend": "fsdp", "zero.stage": 3})
    assert (plan.world.tp, plan.world.pp, plan.world.dp) == (2, 2, 2)
    line = plan.describe()
    assert "tensor-parallel 2 (blocks split by the model's tp_plan)" in line and "pipeline 2 stages" in line, line
    assert plan.engine_kind.module == "zerotrain.backends.fsdp.pipeline", plan.engine_kind


def test_tp_pp_refused_on_deepspeed_with_the_probe_line():
    with pytest.raises(ConfigError) as e:
        _plan(4, **{"parallel.tp": 2, "parallel.pp": 2, "backend": "deepspeed", "zero.stage": 1})
    line = str(e.value)
    assert "\n" not in line and line.startswith("--tp 2 with --pp 2 on the deepspeed backend: DeepSpeed "), line
    assert "AutoTP does not compose with its pipeline engine" in line and "Not able to determine model policy" in line
    assert "benchmarks/results/tp_pp_deepspeed_probe/" in line and line.endswith(
        "pass --backend fsdp for tensor x pipeline parallelism"), line


@pytest.mark.parametrize("overrides,needle", [
    ({"parallel.tp": 8, "parallel.pp": 2}, "--tp 8 does not divide the model's 4 attention heads"),  # 16 ranks
    ({"parallel.tp": 2, "parallel.pp": 2, "model.from_config": "tiny-gpt2"},
     "model type 'gpt2' has no tensor-parallel plan"),
    ({"parallel.tp": 2, "parallel.pp": 4}, "parallel.pp=4 is more stages than the model's 2 transformer blocks"),
    ({"parallel.tp": 2, "parallel.pp": 2, "zero.stage": 0}, "stage 0 is DDP under FSDP"),
])
def test_both_splits_checks_apply_under_tp_pp(overrides, needle):
    world = overrides["parallel.tp"] * overrides["parallel.pp"]
    with pytest.raises(ConfigError) as e:
        _plan(world, **{"backend": "fsdp", "zero.stage": 3, **overrides})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_lora_under_tp_and_pp_runs_on_fsdp_only():
    from zerotrain.distributed.layout import ParallelDegrees
    from zerotrain.plan.parallel_rules import check_parallel

    cfg = build_config(overrides={"data.pack": True, "parallel.pp": 2, "parallel.tp": 2, "lora.r": 4})
    check_parallel(cfg, "fsdp", ParallelDegrees(tp=2, pp=2), 4, model_facts("tiny-llama"))
    cfg = build_config(overrides={"data.pack": True, "parallel.pp": 2, "lora.r": 4})
    with pytest.raises(ConfigError) as e:
        check_parallel(cfg, "deepspeed", ParallelDegrees(pp=2), 2, model_facts("tiny-llama"))
    assert str(e.value).startswith("lora.r=4 with --pp 2 on the deepspeed backend") and \
        str(e.value).endswith("--backend fsdp"), str(e.value)


def _entries(world: int, per_host: int) -> list[dict]:
    return [dict(rank=r, node_rank=r // per_host, host=f"h{r // per_host}", addr=f"10.0.0.{r // per_host}")
            for r in range(world)]


def test_layout_lines_name_every_group_of_tp_pp_dp():
    from zerotrain.launch.launchers import format_world_layout

    lines = format_world_layout(_entries(8, 4), WorldLayout(8, tp=2, pp=2)).splitlines()
    assert lines[-4:] == [
        "  tensor-parallel groups of 2 inside a host: ranks 0-1 on node 0, ranks 2-3 on node 0, ranks 4-5 on node 1, "
        "ranks 6-7 on node 1",
        "  pipeline stages: stage 0 ranks 0-3 (node 0), stage 1 ranks 4-7 (node 1)",
        "  pipeline groups (a micro-batch's path): 0>4 | 1>5 | 2>6 | 3>7",
        "  data-parallel groups (a stage's replicas): 0,2 | 1,3 | 4,6 | 5,7"], lines


def test_a_tp_group_across_hosts_is_warned_by_name():
    """train prints these lines at start too (zerotrain/commands/train.py), so a run warns as the launcher does."""
    from zerotrain.launch.launchers import format_world_layout

    lines = format_world_layout(_entries(4, 1), WorldLayout(4, tp=2, pp=2)).splitlines()
    assert ("  warning: tensor-parallel group ranks 0-1 spans nodes [0, 1]: every layer all-reduces over the network; "
            "give every host a multiple of --tp ranks") in lines, lines
    three = format_world_layout(_entries(12, 3), WorldLayout(12, tp=2, pp=2)).splitlines()  # 3 ranks per host
    warned = "  warning: tensor-parallel group ranks 2-3 spans nodes [0, 1]"
    assert any(line.startswith(warned) for line in three), three


def test_sp_x_tp_layout_lines_name_strided_sp_groups_and_whole_groups_per_host():
    """Under sp x tp an sp group strides over its tp neighbours (ranks 0,2): the lines name its ranks, and a host
    split through it asks for a multiple of sp x tp ranks per host."""
    from zerotrain.launch.launchers import format_world_layout

    lines = format_world_layout(_entries(8, 4), WorldLayout(8, tp=2, sp=2)).splitlines()
    assert "  sequence-parallel groups of 2 inside a host: ranks 0,2 on node 0, ranks 1,3 on node 0, ranks 4,6 on " \
           "node 1, ranks 5,7 on node 1" in lines, lines
    split = format_world_layout(_entries(4, 2), WorldLayout(4, tp=2, sp=2)).splitlines()
    assert ("  warning: sequence-parallel group ranks 0,2 spans nodes [0, 1]: every attention all-to-alls over the "
            "network; give every host a multiple of --sp x --tp ranks") in split, split


def test_backend_auto_takes_fsdp_for_a_feature_only_fsdp_runs_with_the_layout():
    """`backend: auto` with --pp and LoRA or the tiled MLP (FSDP2 only under pp, capabilities.FEATURES) takes FSDP2
    instead of DeepSpeed, which would refuse them; --pp alone stays DeepSpeed's when it imports."""
    from zerotrain.plan.resolve import select_backend

    for extra in ({"lora.r": 4}, {"model.tiled_mlp": 8}):
        backend, why = select_backend(build_config(overrides={"parallel.pp": 2, "data.pack": True, **extra}))
        assert backend == "fsdp" and why == f"backend=auto, {next(iter(extra))} with parallel.pp=2 (it runs on FSDP " \
                                             "only)", why
    assert select_backend(build_config(overrides={"parallel.pp": 2, "data.pack": True}))[0] == "deepspeed"
