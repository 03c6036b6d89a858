"""Which world-size / ZeRO-stage changes a resume can follow, and the one-line refusal for the rest.

The conversions themselves run on real ranks in test_engine_contract.py (DeepSpeed's universal
checkpoint, FSDP's DCP resharding); here the rule, and the CLI refusing before any rank starts.
"""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import asdict

import pytest

from zerotrain.checkpoint import store as ck


def meta(fmt: str = "deepspeed", stage: int = 2, world: int = 2, dtype: str = "fp32") -> ck.CheckpointMeta:
    return ck.CheckpointMeta(backend="fsdp" if fmt == "dcp" else "deepspeed", format=fmt, zero_stage=stage,
                             world_size=world, dtype=dtype, model_class="GPT2LMHeadModel",
                             model_config_hash="0" * 16, global_step=3)


# (checkpoint format, dtype, saved stage, saved world, run stage, run world) -> universal conversion?
FOLLOWS = {
    ("deepspeed", "fp32", 2, 2, 2, 2): False,  # same layout: the plain load
    ("deepspeed", "bf16", 3, 2, 3, 2): False,
    ("deepspeed", "fp32", 3, 2, 3, 1): True,
    ("deepspeed", "bf16", 3, 1, 3, 4): True,
    ("deepspeed", "fp32", 2, 2, 1, 1): True,
    ("deepspeed", "bf16", 1, 2, 2, 2): True,   # stage change at the same world size
    ("deepspeed", "fp32", 0, 2, 0, 1): False,  # fp32 stage 0: every rank holds everything
    ("dcp", "fp32", 3, 2, 2, 1): False,        # torch.distributed.checkpoint reshards itself
    ("dcp", "bf16", 0, 1, 3, 2): False,
}

REFUSED = {
    ("deepspeed", "fp32", 2, 2, 3, 2): "not from stage 2 to 3",
    ("deepspeed", "fp32", 3, 2, 1, 1): "not from stage 3 to 1",
    ("deepspeed", "fp32", 1, 2, 0, 2): "not from stage 1 to 0",
    ("deepspeed", "fp32", 0, 2, 2, 2): "not from stage 0 to 2",
    ("deepspeed", "bf16", 0, 2, 0, 1): "stage-0 bf16 optimizer state is partitioned",
}


@pytest.mark.parametrize("case", list(FOLLOWS))
def test_layout_changes_that_resume(case):
    fmt, dtype, s_stage, s_world, stage, world = case
    m = meta(fmt, s_stage, s_world, dtype)
    ck.check_layout(m, "ck", world, stage)
    assert ck.needs_universal(m, world, stage) is FOLLOWS[case]


@pytest.mark.parametrize("case", list(REFUSED))
def test_layout_changes_refused_with_the_fix(case):
    fmt, dtype, s_stage, s_world, stage, world = case
    with pytest.raises(ValueError) as e:
        ck.check_layout(meta(fmt, s_stage, s_world, dtype), "ck/global_step3", world, stage)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--resume ck/global_step3: ")
    assert REFUSED[case] in msg and f"resume with --stage {s_stage}" in msg and "zerotrain export" in msg


def test_nvme_optimizer_offload_cannot_take_a_converted_checkpoint():
    """DeepSpeed skips the universal load with NVMe optimizer offload: refused, not silently fresh."""
    m = meta("deepspeed", 3, 2)
    ck.check_layout(m, "ck", 2, 3, nvme_optimizer=True)  # same layout: the plain load
    with pytest.raises(ValueError, match="with --offload-optimizer nvme: resume with --offload-optimizer cpu"):
        ck.check_layout(m, "ck", 1, 3, nvme_optimizer=True)
    ck.check_layout(meta("dcp", 3, 2), "ck", 1, 3, nvme_optimizer=True)  # not a DeepSpeed checkpoint


def test_cli_refuses_a_stage_change_before_starting(tmp_path, monkeypatch):
    """`zerotrain train --resume` on a stage-2 checkpoint with --stage 3: exit 2, one line, nothing touched."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotrain.assets.demo import build_tiny
    from zerotrain.cli import main

    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))
    model = build_tiny(tmp_path / "tiny", preset="tiny-gpt2")
    with torch.device("meta"):
        cls, h = ck.config_hash(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model))))
    tag = tmp_path / "out" / "checkpoints" / "global_step2"
    tag.mkdir(parents=True)
    saved = ck.CheckpointMeta(backend="deepspeed", format="deepspeed", zero_stage=2, world_size=1, dtype="fp32",
                              model_class=cls, model_config_hash=h, global_step=2)
    (tag / ck.META_FILE).write_text(json.dumps(asdict(saved)))
    (tmp_path / "out" / "checkpoints" / "latest").write_text("global_step2")
    before = sorted(p.name for p in (tmp_path / "out").rglob("*"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["train", "--model", str(model), "--output", str(tmp_path / "out"), "--resume", "--stage", "3"])
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("zerotrain")]
    assert rc == 2 and len(lines) == 1, err.getvalue()[-2000:]
    assert "written by 1 ranks at ZeRO stage 2, this run has 1 ranks at stage 3" in lines[0]
    assert "resume with --stage 2" in lines[0]
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == before
