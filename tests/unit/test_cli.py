"""The run-config flags are generated from RunConfig's fields: one per leaf, the old names kept, typed
from the annotation, help from the docstring; estimate and compare take them with train's defaults."""
from __future__ import annotations

import argparse
import ast
from typing import Any

import pytest

from zerotrain.cli import build_parser
from zerotrain.config.flags import _field, add_run_flags, config_from_args, overrides_from_args, run_flags
from zerotrain.config.schema import RunConfig, field_paths

# Every flag `zerotrain train` had before the flags were generated: "flag dotted.key [argument]". The
# value the flag must give: the argument as a Python literal (else the string); a bare flag gives True,
# or its BARE value.
OLD_FLAGS = """
--model model.name gpt2
--task model.task seq-cls
--model-config model.from_config tiny-gpt2
--num-labels model.num_labels 3
--gradient-checkpointing model.gradient_checkpointing
--data data.path train.jsonl
--data-config data.data_config sst2
--split data.split validation
--text-column data.text_column sentence
--label-column data.label_column y
--eval-data data.eval_path eval.jsonl
--eval-split data.eval_split 0.1
--seq-len data.seq_len 64
--stage zero.stage 3
--offload-optimizer zero.offload_optimizer cpu
--offload-param zero.offload_param cpu
--nvme-path zero.nvme_path /nvme
--precision precision.dtype bf16
--micro-batch batch.micro_batch 2
--grad-accum batch.grad_accum 4
--global-batch batch.global_batch 32
--optimizer optimizer.name sgd
--lr optimizer.lr 1e-4
--weight-decay optimizer.weight_decay 0.01
--clip optimizer.clip 0.5
--schedule schedule.name linear
--warmup-steps schedule.warmup_steps 10
--max-steps run.max_steps 100
--epochs run.epochs 2.5
--seed run.seed 7
--output run.output runs/x
--save-every run.save_every 5
--keep-last run.keep_last 3
--eval-every run.eval_every 5
--log-every run.log_every 2
--resume run.resume
--overwrite run.overwrite
--tensorboard run.tensorboard
--backend backend fsdp
--dist-timeout dist_timeout_s 60.0
"""
BARE = {"--resume": "latest"}


def _old_flags() -> dict[str, tuple[str, list[str], Any]]:
    """flag -> (dotted key, its arguments, the value it must give)."""
    out = {}
    for line in OLD_FLAGS.split("\n"):
        if line:
            flag, dotted, *argv = line.split()
            out[flag] = (dotted, argv, _literal(argv[0]) if argv else BARE.get(flag, True))
    return out


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_run_flags(p, **kw)
    return p


def _overrides(*argv: str, **kw) -> dict:
    return overrides_from_args(_parser(**kw).parse_args(list(argv)))


def test_every_leaf_field_has_exactly_one_flag_and_names_are_unique() -> None:
    flags = run_flags()
    by_key = {}
    for f in flags:
        by_key.setdefault(f.dotted, []).append(f.flag)
    leaves = [p for p in field_paths() if p != "ds_overrides"]  # a dict: set by --ds-override KEY=JSON
    assert sorted(by_key) == sorted(leaves)
    assert all(len(v) == 1 for v in by_key.values()), by_key
    names = [f.flag for f in flags]
    assert len(names) == len(set(names)) and "--ds-override" not in names
    _parser()  # argparse accepts them all together (no clashing option strings)


@pytest.mark.parametrize("flag", list(_old_flags()))
def test_old_flag_parses_to_the_same_key_and_value(flag: str) -> None:
    dotted, argv, value = _old_flags()[flag]
    got = _overrides(flag, *argv)
    assert got == {dotted: value} and type(got[dotted]) is type(value)


def test_all_old_flags_together_build_a_config() -> None:
    argv = [a for flag, (_, rest, _) in _old_flags().items() for a in (flag, *rest)
            if flag not in ("--resume", "--offload-optimizer", "--optimizer", "--global-batch", "--nvme-path")]
    cfg = config_from_args(_parser().parse_args(argv))
    assert (cfg.zero.stage, cfg.optimizer.lr, cfg.run.overwrite, cfg.dist_timeout_s) == (3, 1e-4, True, 60.0)


def test_help_is_the_field_docstring_and_key() -> None:
    for f in run_flags():
        info = _field(f.dotted)
        shown = "" if info.default is None else ", default: "
        assert f.kwargs["help"].startswith(f"{info.description} [{f.dotted}{shown}"), f.flag
        assert f.kwargs["help"].endswith("]") and f.kwargs["default"] is None  # None: YAML / config default apply
    helptext = " ".join(_parser().format_help().split())
    assert "[zero.stage, default: 2]" in helptext and "[precision.dtype, default: fp32]" in helptext


def test_literal_field_refuses_a_bad_choice(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--precision", "fp8"])
    assert e.value.code == 2
    assert "argument --precision: invalid choice: 'fp8'" in capsys.readouterr().err


def test_types_come_from_the_annotation() -> None:
    assert _overrides("--lr", "1e-4", "--stage", "3", "--betas", "0.9", "0.95") == \
        {"optimizer.lr": 1e-4, "zero.stage": 3, "optimizer.betas": [0.9, 0.95]}
    cfg = config_from_args(_parser().parse_args(["--betas", "0.9", "0.95", "--min-lr-ratio", "0.1"]))
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.schedule.min_lr_ratio == 0.1
    with pytest.raises(SystemExit):
        _parser().parse_args(["--stage", "two"])


def test_new_fields_get_flags_and_bools_can_be_turned_off() -> None:
    assert _overrides("--reduce-bucket-size", "16384", "--loss-scale", "128", "--no-pack") == \
        {"zero.reduce_bucket_size": 16384, "precision.loss_scale": 128.0, "data.pack": False}
    assert _overrides("--no-save-final", "--no-tune-malloc") == {"run.save_final": False, "run.tune_malloc": False}
    assert _overrides("--leaf-blocks") == {"zero.leaf_blocks": True}
    assert _overrides("--no-leaf-blocks") == {"zero.leaf_blocks": False}
    assert _overrides() == {}  # nothing given: nothing overrides the YAML or the defaults
    assert _overrides("--resume", "ckpt/step_4") == {"run.resume": "ckpt/step_4"}


def test_skip_leaves_a_key_to_the_command() -> None:
    p = _parser(skip=("zero.stage", "run.output"))
    p.add_argument("--output", required=True)  # the command's own flag of that name
    args = p.parse_args(["--output", "report", "--micro-batch", "2"])
    assert args.output == "report" and overrides_from_args(args) == {"batch.micro_batch": 2}
    with pytest.raises(SystemExit):
        p.parse_args(["--output", "x", "--stage", "3"])


def test_estimate_and_compare_take_trains_flags_and_defaults() -> None:
    parser = build_parser()
    defaults = RunConfig()
    for argv in (["estimate"], ["compare", "--output", "x"]):
        cfg = config_from_args(parser.parse_args(argv))
        assert (cfg.batch.micro_batch, cfg.batch.grad_accum, cfg.data.seq_len, cfg.precision.dtype) == \
            (defaults.batch.micro_batch, defaults.batch.grad_accum, defaults.data.seq_len, defaults.precision.dtype)
    est = parser.parse_args(["estimate", "--model", "tiny-gpt2", "--precision", "fp16", "--task", "seq-cls",
                             "--reduce-bucket-size", "8", "--grad-accum", "2"])
    assert overrides_from_args(est) == {"model.name": "tiny-gpt2", "precision.dtype": "fp16", "model.task": "seq-cls",
                                        "zero.reduce_bucket_size": 8, "batch.grad_accum": 2}
    cmp = parser.parse_args(["compare", "--output", "rep", "--offload-optimizer", "none,cpu", "--precision", "fp16",
                             "--task", "seq-cls", "--max-steps", "3"])
    # compare's own flags keep their names and meaning: comma lists, the report directory, steps per run
    assert (cmp.offload_optimizer, cmp.output, cmp.max_steps) == ("none,cpu", "rep", 3)
    assert overrides_from_args(cmp) == {"precision.dtype": "fp16", "model.task": "seq-cls"}


@pytest.mark.parametrize("argv, expected", [
    (["train", "--spli", "2"], "unknown flag --spli; flags are not abbreviated: did you mean --split?"),
    (["train", "--seq", "64"], "unknown flag --seq; flags are not abbreviated: did you mean --seq-len?"),
    (["config", "--stag", "3"], "unknown flag --stag; flags are not abbreviated: did you mean --stage?"),
    (["estimate", "--modle", "gpt2"], "unknown flag --modle; did you mean --model?"),
    (["train", "--bogus", "1"], "unknown flag --bogus; see `zerotrain train --help` for the flags"),
])
def test_flags_are_exact_and_an_unknown_one_names_the_closest(argv, expected, capsys) -> None:
    """argparse's prefix matching is off on every parser: `train --sp 2` once trained as `--split 2` (before --sp existed)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [f"zerotrain {argv[0]}: error: {expected}"]
    ok = build_parser().parse_args(["train", "--split", "2", "--seq-len", "64"])  # exact flags still parse
    assert (ok.command, ok.cfg__data__split, ok.cfg__data__seq_len) == ("train", "2", 64)


def test_compare_train_args_are_exact_too() -> None:
    from zerotrain.commands.compare import _train_flags
    from zerotrain.errors import UserError

    with pytest.raises(UserError, match="--train-arg --sched=cosine: not a `zerotrain train` flag"):
        _train_flags(argparse.Namespace(train_arg=["--sched=cosine"]))  # once taken as --schedule cosine
