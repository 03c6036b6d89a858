"""The LR schedule against references that are not zerotrain's own code: transformers' get_scheduler and a
hand-computed table; the DeepSpeed JSON's scheduler stepped as DeepSpeed steps it; and the JSON that has no
scheduler for the asked schedule says so (`zerotrain config` on stderr)."""
from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

from zerotrain.config.schema import RunConfig
from zerotrain.plan.schedule import lr_lambda

TOTAL = 8


def _cfg(name: str, warm: int, floor: float = 0.0) -> RunConfig:
    return RunConfig.model_validate({"schedule": {"name": name, "warmup_steps": warm, "min_lr_ratio": floor}})


def _lrs(scheduler_cls, steps: int, **kw) -> list[float]:
    """The LR each optimizer step 0..steps uses, with the scheduler stepped after every optimizer step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = scheduler_cls(opt, **kw)
    out = []
    for _ in range(steps + 1):
        out.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name,warm,floor,hf_name,hf_kwargs", [
    ("cosine", 0, 0.0, "cosine", {}), ("cosine", 3, 0.0, "cosine", {}),
    ("cosine", 3, 0.1, "cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("linear", 0, 0.0, "linear", {}), ("linear", 3, 0.0, "linear", {}),
    ("constant", 0, 0.0, "constant", {}), ("constant", 3, 0.0, "constant_with_warmup", {}),
])
def test_schedule_equals_transformers_get_scheduler(name, warm, floor, hf_name, hf_kwargs):
    from transformers import get_scheduler

    hf = _lrs(lambda opt: get_scheduler(hf_name, opt, num_warmup_steps=warm, num_training_steps=TOTAL,
                                        scheduler_specific_kwargs=hf_kwargs), TOTAL)
    f = lr_lambda(_cfg(name, warm, floor), TOTAL)
    ours = [f(step) for step in range(TOTAL + 1)]
    assert ours == pytest.approx(hf, rel=1e-12, abs=1e-12)


def test_schedule_equals_a_hand_computed_table():
    """Warmup 2 of 6 steps; linear to a floor of 0.1 (which get_scheduler has no schedule for) and cosine."""
    c = 0.5 * (1 + math.cos(math.pi / 4))
    linear = lr_lambda(_cfg("linear", 2, 0.1), 6)
    cosine = lr_lambda(_cfg("cosine", 2), 6)
    assert [linear(s) for s in range(8)] == pytest.approx([0, 0.5, 1, 0.775, 0.55, 0.325, 0.1, 0.1])
    assert [cosine(s) for s in range(7)] == pytest.approx([0, 0.5, 1, c, 0.5, 1 - c, 0])


@pytest.mark.parametrize("name,warm,floor", [("cosine", 3, 0.0), ("cosine", 4, 0.2), ("linear", 3, 0.0),
                                             ("constant", 3, 0.0)])
def test_deepspeed_json_scheduler_follows_the_schedule(name, warm, floor):
    """DeepSpeed's scheduler named in the raw JSON, stepped as its engine steps it: in warmup one step behind
    zerotrain's (ds_config._scheduler says so), then the same (cosine, constant) or still one step
    behind (WarmupDecayLR's linear decay)."""
    from deepspeed.runtime import lr_schedules

    from zerotrain.plan.ds_config import build_ds_config

    block = build_ds_config(_cfg(name, warm, floor), total_steps=TOTAL)["scheduler"]
    params = {k: (v / 5e-5 if k == "warmup_max_lr" else v) for k, v in block["params"].items()}  # lr 1 here
    ds = _lrs(lambda opt: getattr(lr_schedules, block["type"])(opt, **params), TOTAL)
    f = lr_lambda(_cfg(name, warm, floor), TOTAL)
    ours = [f(step) for step in range(TOTAL + 1)]
    assert ds[1:warm + 1] == pytest.approx(ours[:warm], abs=1e-9)
    lag = 1 if name == "linear" else 0
    assert ds[warm + 1:] == pytest.approx(ours[warm + 1 - lag:TOTAL + 1 - lag], abs=1e-9)


def _config_cli(*args: str) -> tuple[dict, str]:
    from zerotrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(["config", *args]) == 0
    return json.loads(out.getvalue()), err.getvalue()


def test_config_says_when_the_json_has_no_scheduler():
    ds, err = _config_cli("--schedule", "cosine")
    assert "scheduler" not in ds
    assert "schedule.name=cosine: a decay needs the run length, so the JSON has no scheduler block and a raw " \
           "DeepSpeed run keeps the LR constant; pass --max-steps N" in err
    ds, err = _config_cli("--schedule", "cosine", "--max-steps", "100", "--warmup-steps", "10")
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["total_num_steps"] == 100
    assert err == ""
    ds, err = _config_cli("--schedule", "linear", "--min-lr-ratio", "0.1", "--max-steps", "100")
    assert "scheduler" not in ds and "WarmupDecayLR cannot stop at a floor" in err


def test_hf_auto_keeps_cosine_cosine():
    ds, err = _config_cli("--hf-auto", "--schedule", "cosine", "--warmup-steps", "5")
    assert "scheduler" not in ds  # HF's own scheduler runs, from its --lr_scheduler_type
    assert "pass --lr_scheduler_type cosine (and --warmup_steps 5)" in err
    ds, err = _config_cli("--hf-auto", "--schedule", "cosine", "--min-lr-ratio", "0.1")
    assert "--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs '{\"min_lr_rate\": 0.1}'" in err
    ds, err = _config_cli("--hf-auto", "--schedule", "linear")
    assert ds["scheduler"]["type"] == "WarmupDecayLR" and err == ""
