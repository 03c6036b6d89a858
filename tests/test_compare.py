"""`zerotrain compare`: plan, real 2-rank runs through `zerotrain train`, report files."""
from __future__ import annotations

import argparse
import sys

import pytest

from launch import REPO, rank_env, run
from zerotrain.commands.compare import add_arguments, plan_runs
from zerotrain.report import REPORT_COLUMNS, read_csv


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([*argv, "--output", "x"])


def test_plan_skips_invalid_combinations_in_order() -> None:
    runs = plan_runs(_args("--stages", "0,2,3", "--offload-optimizer", "none,cpu", "--offload-param", "none,cpu",
                           "--backends", "deepspeed,fsdp"))
    names = [(r.backend, r.stage, r.offload_optimizer, r.offload_param) for r in runs]
    assert names[0] == ("deepspeed", 0, "none", "none")
    assert ("deepspeed", 0, "cpu", "none") not in names and ("deepspeed", 2, "none", "cpu") not in names
    assert ("deepspeed", 3, "cpu", "cpu") in names and names[-1] == ("fsdp", 3, "cpu", "cpu")


def test_plan_errors_are_one_line() -> None:
    with pytest.raises(ValueError, match="--stages"):
        plan_runs(_args("--stages", "0,5"))
    with pytest.raises(ValueError, match="--backends"):
        plan_runs(_args("--backends", "deepspeed,megatron"))


def _compare(out, *extra: str, timeout: float = 900):
    # --grad-accum 2 (compare's own default before it took train's, 1): mid-accumulation, where ZeRO-1
    # holds more than ZeRO-2 (at the boundary they hold the same, and the ordering below would not hold)
    cmd = [sys.executable, "-m", "zerotrain", "compare", "--tiny-preset", "tiny-gpt2", "--nproc", "2",
           "--max-steps", "2", "--micro-batch", "2", "--grad-accum", "2", "--seq-len", "64", "--output", str(out),
           *extra]
    return run(cmd, timeout=timeout, env=rank_env(), cwd=REPO)


@pytest.mark.multirank
def test_compare_stages_0_to_3(tmp_path) -> None:
    out = tmp_path / "cmp"
    res = _compare(out, "--stages", "0,1,2,3", "--reduce-bucket-size", "16384")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "4/4 configurations ran" in res.stdout
    assert res.stderr.count("deepspeed-z") >= 4  # one progress line per configuration

    rows = read_csv(out / "report.csv")
    assert list(rows[0]) == list(REPORT_COLUMNS)
    assert [int(r["stage"]) for r in rows] == [0, 1, 2, 3]
    assert all(r["status"] == "ok" and r["world_size"] == "2" for r in rows)
    measured = [int(r["model_state_bytes_measured"]) for r in rows]
    for r in rows:
        m, p = int(r["model_state_bytes_measured"]), int(r["model_state_bytes_predicted"])
        assert abs(m - p) <= 0.05 * p, r
        rss, rss_p = int(r["peak_rss_bytes"]), int(r["peak_rss_predicted"])
        assert abs(rss - rss_p) <= 0.20 * rss, r
        assert float(r["tokens_per_s"]) > 0 and float(r["step_time_s"]) > 0
    assert measured[0] > measured[1] > measured[2] > measured[3], measured
    # Same seed and data: the stages agree on the loss (tests/test_families.py proves it per family).
    losses = [float(r["final_loss"]) for r in rows]
    assert max(losses) - min(losses) < 1e-3 * abs(losses[0]), losses

    md = (out / "report.md").read_text()
    assert md.count("| ds z") == 4 and "model states measured" in md

    import matplotlib.image as mpimg

    img = mpimg.imread(out / "report.png")
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.01  # not a blank canvas


@pytest.mark.multirank
def test_compare_records_a_failed_configuration_and_goes_on(tmp_path) -> None:
    out = tmp_path / "cmp"
    # SGD cannot be offloaded: the cpu-offload run fails at start-up, stage 0 trains.
    res = _compare(out, "--stages", "0,2", "--offload-optimizer", "none,cpu", "--train-arg=--optimizer=sgd")
    assert res.returncode == 1
    rows = read_csv(out / "report.csv")
    assert [(r["stage"], r["offload_optimizer"]) for r in rows] == [("0", "none"), ("2", "none"), ("2", "cpu")]
    assert rows[0]["status"] == "ok"
    assert rows[2]["status"] == "failed" and "sgd" in rows[2]["error"]
    assert "Failed configurations" in (out / "report.md").read_text()
    assert (out / "report.png").stat().st_size > 0
