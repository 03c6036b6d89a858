"""Nothing silently ignored: every RunConfig field, set to a value other than its default, on every backend,
ZeRO stage and layout, either changes what the run is given (the DeepSpeed JSON, the FSDP2 arguments, the
resolved plan, the start banner, the LR curve) or is refused / warned in one line that names it.

"Changes" is found by diffing those real outputs between the default and the set value, not by reading
the table that drives the refusals (zerotrain/config/rules.py UNUSED); no ranks are needed.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from zerotrain.config.load import build_config
from zerotrain.config.schema import RunConfig
from zerotrain.errors import ConfigError
from zerotrain.model.facts import ModelFacts
from zerotrain.plan.run_plan import build_plan
from zerotrain.plan.schedule import lr_lambda

REPO = Path(__file__).resolve().parents[2]

READ_OUTSIDE_THE_PLAN: dict[str, str] = {
    # field -> the module that reads it on every backend (checked below: the module names the field)
    "model.name": "zerotrain/model/source.py", "model.task": "zerotrain/model/source.py", "model.from_config": "zerotrain/model/source.py",
    "model.gradient_checkpointing": "zerotrain/model/source.py",
    "model.attn_implementation": "zerotrain/model/source.py",
    "model.offload_activations": "zerotrain/backends/base.py",  # on a GPU; refused on CPU and under pp (rules)
    **{f"data.{f}": "zerotrain/data/datasets.py" for f in ("path", "data_config", "split", "text_column", "eval_path",
                                                  "eval_split", "seq_len", "pack", "format", "chat_template",
                                                  "train_on_prompt", "truncation", "packing", "data_weights")},
    **{f"run.{f}": "zerotrain/train/trainer.py" for f in ("eval_every", "log_every", "save_final")},
    "run.max_steps": "zerotrain/plan/resolve.py", "run.epochs": "zerotrain/plan/resolve.py",
    "data.streaming": "zerotrain/train/preflight.py",  # and zerotrain/data/streaming.py, the training loop
    "run.seed": "zerotrain/train/trainer.py", "run.output": "zerotrain/train/preflight.py", "run.save_every": "zerotrain/train/trainer.py",
    "run.keep_last": "zerotrain/backends/checkpointing.py", "run.resume": "zerotrain/train/preflight.py",
    "run.overwrite": "zerotrain/train/preflight.py", "run.tensorboard": "zerotrain/train/trainer.py",
    "run.report_to": "zerotrain/train/trainer.py", "run.tune_malloc": "zerotrain/distributed/host_malloc.py",
    "dist_timeout_s": "zerotrain/backends/deepspeed/engine.py",  # and each other engine: its process-group timeout
    "hang_timeout_s": "zerotrain/train/trainer.py",  # the hang watchdog of the training loop
    "run.async_save": "zerotrain/backends/checkpointing.py",  # the checkpoint protocol of every engine
    "run.trust_checkpoint": "zerotrain/backends/checkpointing.py",  # how every engine reads a resumed checkpoint
    "data.loader_workers": "zerotrain/train/recipes/sources.py",  # the training loader (map-style, stream) (refused for grpo: rules)
}
"""Fields every backend reads the same way, outside the plan (data, model building, the training loop)."""
OUTSIDE_WHEN: dict[str, tuple[str, dict]] = {
    "model.num_labels": ("zerotrain/model/source.py", {"model.task": "seq-cls"}),
    "data.label_column": ("zerotrain/data/text.py", {"model.task": "seq-cls"}),
}
"""Fields read outside the plan only in some runs (context); elsewhere the walk checks them."""
AXES = {"backend", "zero.stage", "parallel.tp", "parallel.pp"}
"""Set by the walk itself."""

FACTS = ModelFacts(num_params=4_000_000, hidden_size=64, num_layers=2, vocab_size=1024, num_heads=4,
                   intermediate_size=128, block_classes=("LlamaDecoderLayer",), model_type="llama",
                   param_shapes=((1024, 64), (64, 64)), num_kv_heads=2,
                   block_tp_plan=(("self_attn.q_proj", "colwise"), ("self_attn.o_proj", "rowwise")),
                   attention_types=("full_attention",) * 2)


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, typing.Any]:
    out = {}
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_leaves(ann, f"{prefix}{name}."))
        else:
            out[prefix + name] = info
    return out


FIELDS = _leaves(RunConfig)
VALUES: dict[str, typing.Any] = {
    "model.name": "some/model", "model.from_config": "config.json", "model.num_labels": 3,
    "data.path": "data.txt", "data.data_config": "cfg", "data.eval_path": "eval.txt", "data.chat_template": "tpl",
    "zero.offload_optimizer": "cpu", "zero.offload_param": "cpu", "zero.nvme_path": "/nvme",
    "precision.dtype": "bf16", "precision.loss_scale": 128.0, "batch.global_batch": 64,
    "optimizer.betas": [0.8, 0.99], "optimizer.momentum": 0.9, "optimizer.weight_decay": 0.1,
    "schedule.min_lr_ratio": 0.1, "schedule.warmup_steps": 5, "data.eval_split": 0.1,
    "run.max_steps": 50, "run.resume": "latest", "run.report_to": "mlflow",
    "lora.dropout": 0.1, "lora.targets": "q_proj,v_proj", "lora.scope": "all", "quant.qat": "int4-weight",
    "rl.cache_implementation": "static",
    "ds_overrides": {"zero_optimization": {"sub_group_size": 100000000}},
}


def _other_values(path: str, info) -> list:
    """Valid values other than the default: both for a switch whose default is resolved per run (None)."""
    ann = info.annotation
    if info.default is None and bool in typing.get_args(ann):
        return [True, False]
    return [_other_value(path, info)]


def _other_value(path: str, info) -> typing.Any:
    """A valid value other than the default."""
    if path in VALUES:
        return VALUES[path]
    default = info.default
    ann = info.annotation
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Literal:
        return next(a for a in args if a != default)
    if default is None:
        inner = next(a for a in args if a is not type(None))
        return {int: 7, bool: True, str: "x", float: 0.5}[inner]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default * 2 if default else 0.25
    if isinstance(default, str):
        return "x"
    raise AssertionError(f"no test value for {path}")


CELLS = [(b, st, tp, pp) for b in ("deepspeed", "fsdp") for st in (0, 1, 2, 3) for tp, pp in ((1, 1), (2, 1), (1, 2))]
CONTEXTS: list[dict] = [{"optimizer.name": "sgd"}, {"schedule.name": "constant"}, {"model.task": "seq-cls"},
                        {"lora.r": 8}, {"quant.qat": "int4-weight"}, {"precision.dtype": "fp16"}]
"""Other settings a field's meaning depends on; walked on fewer cells (data parallel, stages 1 and 3)."""
WALK = [(cell, {}) for cell in CELLS] + [((b, st, 1, 1), ctx) for ctx in CONTEXTS for b in ("deepspeed", "fsdp")
                                          for st in (1, 3)]


def _outputs(cfg: RunConfig, backend: str, world: int) -> dict:
    """Everything the run is given, in plain values (the plan's cfg itself left out)."""
    from zerotrain.backends.fsdp.engine import fsdp_arguments
    from zerotrain.plan.ds_config import render

    plan = build_plan(cfg, world, backend=backend, device="cuda", facts=FACTS, total_steps=100, steps_per_epoch=100)
    view = {f.name: repr(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name not in ("cfg", "warnings")}
    view["banner"] = [plan.describe(), *plan.notes()]
    f = lr_lambda(cfg, 100)
    view["lr_curve"] = [plan.lr * f(step) for step in range(0, 101, 5)]
    if backend == "deepspeed":
        view["ds_json"] = json.dumps(render(plan), sort_keys=True)
    else:
        view["fsdp"] = repr(fsdp_arguments(plan))
    return view, plan.warnings


def _named(text: str, path: str) -> bool:
    """The line names the config path or its flag (the config's own "flag", else --the-field-name)."""
    extra = FIELDS[path].json_schema_extra or {}
    flag = extra.get("flag") or "--" + path.split(".")[-1].replace("_", "-")
    return path in text or f"{flag} " in text or text.startswith(flag)


def _cell_cfg(backend: str, stage: int, tp: int, pp: int, extra: dict) -> RunConfig:
    return build_config(None, {"backend": backend, "zero.stage": stage, "parallel.tp": tp, "parallel.pp": pp,
                               **extra})


@pytest.mark.parametrize("path", sorted(set(FIELDS) - AXES - set(READ_OUTSIDE_THE_PLAN)))
def test_a_set_field_changes_the_run_or_is_named(path):
    world = 4
    silent, checked = [], 0
    for (backend, stage, tp, pp), ctx in WALK:
        if path in ctx or (path in OUTSIDE_WHEN and OUTSIDE_WHEN[path][1].items() <= ctx.items()):
            continue
        try:
            base = _outputs(_cell_cfg(backend, stage, tp, pp, ctx), backend, world)[0]
        except ConfigError:
            continue  # the layout itself does not run on this backend/stage
        checked += 1
        said = []
        for value in _other_values(path, FIELDS[path]):
            try:
                view, warnings = _outputs(_cell_cfg(backend, stage, tp, pp, {**ctx, path: value}), backend, world)
            except ConfigError as e:
                assert "\n" not in str(e)
                said.append(_named(str(e), path) or f"refused without naming it: {e}")
                continue
            said.append(view != base or any(_named(w, path) for w in warnings) or
                        f"{path}={value!r} changes nothing and nothing says so")
        # a resolved switch (None = per run) may equal the run's own choice for one of its two values
        if not any(s is True for s in said):
            silent.append(f"{backend} stage {stage} tp {tp} pp {pp} {ctx}: {said}")
    assert checked >= 12, checked
    assert not silent, "\n".join(silent)


def test_every_field_is_walked_or_read_by_a_named_module():
    assert set(READ_OUTSIDE_THE_PLAN) <= set(FIELDS)
    for path, module in [*READ_OUTSIDE_THE_PLAN.items(), *((p, m) for p, (m, _) in OUTSIDE_WHEN.items())]:
        section, _, name = path.rpartition(".")
        read = f"{section.split('.')[-1]}.{name}" if section else name  # e.g. cfg.run.seed / d.seed: "run.seed"
        text = (REPO / module).read_text()
        assert read in text or f".{name}" in text, f"{module} does not read {path}"


def test_fsdp_with_a_deepspeed_override_is_refused_and_a_fallback_warns():
    with pytest.raises(ConfigError, match=r"^ds_overrides=\{\"zero_optimization\": \{\"sub_group_size\": 100000000.0\}\} "
                                          r"is a DeepSpeed setting; the FSDP backend has none like it; drop it"):
        build_plan(build_config(None, {"backend": "fsdp", "ds_overrides": {"zero_optimization": {"sub_group_size": 1e8}}}),
                   2, backend="fsdp", device="cpu")
    plan = build_plan(build_config(None, {"backend": "auto", "zero.reduce_bucket_size": 1000}), 2, backend="fsdp",
                      device="cpu")
    assert any(w.startswith("zero.reduce_bucket_size=1000 is a DeepSpeed setting") and
               "(backend auto fell back to fsdp)" in w for w in plan.warnings), plan.warnings


def test_the_cli_refuses_in_one_line(tmp_path, capsys):
    from zerotrain.cli import main

    code = main(["train", "--backend", "fsdp", "--ds-override", "zero_optimization.sub_group_size=1e8",
                 "--output", str(tmp_path / "run"), "--max-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a DeepSpeed setting; the FSDP backend has none like it" in err[0], err


def test_fsdp_optimizer_only_offload_on_a_gpu_is_refused():
    """FSDP2's CPUOffloadPolicy offloads parameters too: optimizer-only offload is not a mode it has (its
    arguments do change, so the walk above cannot see that they change into something else)."""
    cfg = build_config(None, {"backend": "fsdp", "zero.stage": 3, "zero.offload_optimizer": "cpu"})
    with pytest.raises(ConfigError, match=r"^zero.offload_optimizer=cpu alone is not a mode of FSDP2 .*"
                                          r"pass --offload-param cpu as well, or --backend deepspeed"):
        build_plan(cfg, 2, backend="fsdp", device="cuda")
    both = build_config(None, {"backend": "fsdp", "zero.stage": 3, "zero.offload_optimizer": "cpu",
                               "zero.offload_param": "cpu"})
    assert build_plan(both, 2, backend="fsdp", device="cuda").warnings == ()
