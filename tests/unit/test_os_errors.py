"""OS errors in one line (zerotrain/errors.py os_error_line), directories written aside then renamed (staged_dir),
writes that warn once and go on (metrics.jsonl, trackers, hang dumps: a real ENOSPC from /dev/full), and the test
hooks refused when malformed ($ZEROTRAIN_FAULT, $ZEROTRAIN_TUNE_TRIAL_OVERRIDES). The real-rank proofs (final/ and
export on a full disk, a malformed hook refused before step 1) are in tests/multirank/test_os_errors.py."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from zerotrain.checkpoint.run_dir import RunDir
from zerotrain.cli import main
from zerotrain.commands.tune import TRIAL_OVERRIDES_ENV, trial_overrides
from zerotrain.distributed import faults, watchdog
from zerotrain.errors import UserError, os_error_line, staged_dir
from zerotrain.train.metrics import MetricsWriter

DEV_FULL = Path("/dev/full")  # every write fails with ENOSPC: a full disk without filling one
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full on this machine")


def enospc(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_the_line_names_rank_path_errno_text_what_was_kept_and_the_fix() -> None:
    line = os_error_line(enospc("/x/final/config.json"), 0, "writing /x/final", kept="every checkpoint",
                         fix="`zerotrain export CKPT /x/final` writes it")
    assert line == ("rank 0: writing /x/final failed: /x/final/config.json: No space left on device (ENOSPC); "
                    "kept: every checkpoint; fix: free space on that file system (or write to another one), then "
                    "`zerotrain export CKPT /x/final` writes it")
    ro = os_error_line(OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/a"), None, "export")
    assert ro.startswith("export failed: /ro/a: Read-only file system (EROFS); fix: ") and "rank" not in ro
    assert "\n" not in os_error_line(OSError("no errno\nsecond line"), 1, "w")


def test_staged_dir_renames_only_a_complete_directory(tmp_path) -> None:
    out = tmp_path / "final"
    with staged_dir(out) as tmp:
        assert tmp.name == "final" and tmp.parent.parent == tmp_path and not out.exists()
        (tmp / "a.txt").write_text("one")
    assert (out / "a.txt").read_text() == "one" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]

    with pytest.raises(OSError):  # a failed second write: the first final/ stays as it was, nothing partial left
        with staged_dir(out) as tmp:
            (tmp / "b.txt").write_text("two")
            raise enospc(str(tmp / "c.txt"))
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]

    with staged_dir(out) as tmp:  # a complete second write replaces it whole
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@needs_dev_full
def test_a_metrics_write_on_a_full_disk_warns_once_and_training_goes_on(tmp_path, capsys) -> None:
    run_dir = RunDir(tmp_path)
    w = MetricsWriter(run_dir, True, [], None)
    w.write({"step": 1, "loss": 3.0})
    run_dir.metrics.unlink()
    run_dir.metrics.symlink_to(DEV_FULL)
    w.write({"step": 2, "loss": 2.9})  # ENOSPC: warned
    w.write({"step": 3, "loss": 2.8})  # again: not warned twice
    warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("zerotrain train: warning: rank 0: writing ") and "No space left on device" in warned[0]
    assert "training and checkpoints go on" in warned[0]
    run_dir.metrics.unlink()  # room again: the records after it are written (a gap, not an end)
    w.write({"step": 4, "loss": 2.7})
    assert [json.loads(x)["step"] for x in run_dir.metrics.read_text().splitlines()] == [4]
    w.close()


def test_a_tracker_that_cannot_write_is_one_warning_and_metrics_go_on(tmp_path, capsys) -> None:
    pytest.importorskip("tensorboard")
    run_dir = RunDir(tmp_path)
    run_dir.tensorboard.write_text("a file where the tensorboard/ dir should be")  # makedirs fails: EEXIST
    w = MetricsWriter(run_dir, True, ["tensorboard"], None)
    w.write({"step": 1, "loss": 3.0})
    w.close()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("zerotrain: warning: rank 0: --report-to tensorboard: start failed: ")
    assert "(EEXIST)" in err[0] and "metrics.jsonl go on" in err[0], err
    assert json.loads(run_dir.metrics.read_text())["step"] == 1


@needs_dev_full
def test_a_hang_dump_on_a_full_disk_is_one_warning(tmp_path, capsys) -> None:
    path = watchdog.dump_path(tmp_path, 1)
    path.parent.mkdir()
    path.symlink_to(DEV_FULL)
    assert watchdog.write_dump(tmp_path, 1, "test", 3, in_collective=False) is None
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("zerotrain: warning: rank 1: writing the hang dump failed: ")
    assert "No space left on device (ENOSPC)" in err[0] and "still reported" in err[0]


@needs_dev_full
def test_an_os_error_from_a_command_is_one_line_not_a_traceback(capsys) -> None:
    assert main(["config", "--stage", "2", "--max-steps", "10", "-o", str(DEV_FULL)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("zerotrain config: error: config failed: No space left on device (ENOSPC); fix: ")


@pytest.mark.parametrize("spec,why", [
    ("explode:rank=0:step=1", "unknown fault 'explode'"),
    ("kill:rank=1:stpe=3", "must name rank= and step="),
    ("kill:rank=1", "must name rank= and step="),
    ("kill:rank=one:step=3", "rank is a rank number or 'any'"),
    ("term:rank=0:step=0", "step a step number >= 1"),
    ("kill:rank=1:step=3,", "unknown fault ''"),
])
def test_a_malformed_fault_hook_is_one_line_naming_the_variable(spec, why) -> None:
    with pytest.raises(UserError) as e:
        faults.banner({faults.ENV: spec})
    msg = str(e.value)
    assert msg.startswith(f"$ZEROTRAIN_FAULT={spec!r}: ") and why in msg and "unset ZEROTRAIN_FAULT" in msg, msg
    assert "\n" not in msg
    with pytest.raises(UserError):  # an elastic restart does not fire faults, but a malformed value is still refused
        faults.parse(spec)


def test_an_armed_fault_hook_is_named_in_the_banner() -> None:
    env = {faults.ENV: "kill:rank=1:step=5,hold-write:rank=any:step=4"}
    assert faults.banner(env) == ("$ZEROTRAIN_FAULT=kill:rank=1:step=5,hold-write:rank=any:step=4 is set: a test fault "
                                  "hook will SIGKILL rank 1 after step 5; block every rank's asynchronous write of "
                                  "checkpoint 4; unset it (`unset ZEROTRAIN_FAULT`) unless this is a test")
    assert "not on this elastic restart" in faults.banner({**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert faults.banner({}) is None and faults.banner({faults.ENV: " "}) is None


@pytest.mark.parametrize("value,why", [
    ("{not json", "not valid JSON"),
    ('["deepspeed-z2-mb4"]', "expected a JSON object"),
    ('{"deepspeed-z2-mb4": 4}', "expected a JSON object"),
    ('{"deepspeed-z2-mb4": {"batch.micro_bacth": 4}}', "unknown config key 'batch.micro_bacth' (did you mean "
                                                       "'batch.micro_batch'?)"),
])
def test_a_malformed_tune_override_is_one_line_naming_the_variable(value, why) -> None:
    with pytest.raises(UserError) as e:
        trial_overrides({TRIAL_OVERRIDES_ENV: value})
    msg = str(e.value)
    assert msg.startswith(f"${TRIAL_OVERRIDES_ENV}: ") and why in msg and f"unset {TRIAL_OVERRIDES_ENV}" in msg, msg


def test_a_valid_tune_override_is_read() -> None:
    hook = {"deepspeed-z2-mb4": {"batch.micro_batch": 100000}}
    assert trial_overrides({TRIAL_OVERRIDES_ENV: json.dumps(hook)}) == hook
    assert trial_overrides({}) == {}


def test_export_refuses_an_out_dir_it_would_wrongly_replace(tmp_path) -> None:
    from zerotrain.commands.export import _check_replaceable

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "global_step4"
    ckpt.mkdir(parents=True)
    with pytest.raises(UserError, match="holds the checkpoint"):
        _check_replaceable(run, ckpt)  # `zerotrain export runs/a/checkpoints runs/a` must not replace the run
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not a model directory"):
        _check_replaceable(tmp_path / "home", ckpt)
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "config.json").write_text("{}")
    for ok in (tmp_path / "earlier", tmp_path / "new", run / "final"):  # an earlier export, nothing yet
        _check_replaceable(ok, ckpt)


def test_tune_refuses_an_override_for_no_candidate_before_any_trial(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(TRIAL_OVERRIDES_ENV, json.dumps({"deepspeed-z9-mb4": {"batch.micro_batch": 4}}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "tuned"
    assert main(["tune", "--model-config", "tiny-llama", "--nproc", "2", "--global-batch", "8", "--backends",
                 "deepspeed", "--stages", "2,3", "--micro-batches", "4", "--checkpointing", "off", "--tp", "1",
                 "--pp", "1", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"zerotrain tune: error: ${TRIAL_OVERRIDES_ENV}: deepspeed-z9-mb4 is not a candidate of this search "
                   f"(candidates: deepspeed-z2-mb4, deepspeed-z3-mb4); unset it (`unset {TRIAL_OVERRIDES_ENV}`): it "
                   "is a test hook"]
    assert not out.exists()  # refused before any trial wrote anything
