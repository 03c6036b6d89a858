"""Experiment trackers (zerotrain/train/trackers.py): MLflow's own client reads back every logged step and the run
config; a resumed run continues the same MLflow run; a failing or missing tracker is one warning line and
metrics.jsonl is still complete."""
from __future__ import annotations

import json

from pathlib import Path

import pytest

from zerotrain.checkpoint.run_dir import RunDir
from zerotrain.train.metrics import MetricsWriter

RECORDS = [{"step": s, "epoch": s / 4, "loss": 3.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 0.5} for s in (1, 2, 3)]


def test_mlflow_metrics_and_params_read_back_through_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    w = MetricsWriter(run_dir, True, ["mlflow"], None, params={"zero.stage": "3", "lora.r": "8"})
    for r in RECORDS[:2]:
        w.write(r)
    w.close()
    # resume at step 2: the same MLflow run goes on
    w = MetricsWriter(run_dir, True, ["mlflow"], 2, params={"zero.stage": "3", "lora.r": "8"})
    w.write({**RECORDS[2], "expert_tokens": [5, 7], "expert_imbalance": 1.17})  # a mixture of experts' load
    w.write({"step": 3, "epoch": 0.75, "eval_loss": 2.5, "eval_perplexity": 12.2})
    w.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.mlflow_db}")
    runs = client.search_runs([client.get_experiment_by_name("zerotrain").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == run_dir.mlflow_run_id.read_text().strip()
    run = runs[0]
    assert run.data.params == {"zero.stage": "3", "lora.r": "8"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 2.9), (2, 2.8), (3, 2.7)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [3]
    # a list of numbers (tokens per expert) is one scalar per entry
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "expert_tokens/1")] == [(3, 7.0)]
    assert run.info.status == "FINISHED"


def test_sampled_completions_are_a_jsonl_and_an_mlflow_table_that_grows(tmp_path, monkeypatch):
    """Online RL's --log-completions-every: the rows go to the run's completions file and to the trackers that keep
    tables (MLflow: one table artifact, appended to at every logging step; a chat completion as its JSON text)."""
    pytest.importorskip("mlflow")
    import json

    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    path = run_dir.root / "completions.jsonl"
    w = MetricsWriter(run_dir, True, ["mlflow"], None)
    w.table("completions", [{"prompt": "why ?", "completion": "because .", "reward": 0.5}], 1, path)
    w.table("completions", [{"prompt": "why ?", "completion": [{"role": "assistant", "content": "so"}],
                             "reward": 1.0}], 2, path)
    w.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in lines] == [(1, 0.5), (2, 1.0)]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.mlflow_db}")
    run_id = run_dir.mlflow_run_id.read_text().strip()
    table = json.loads(Path(client.download_artifacts(run_id, "completions.json", str(tmp_path))).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"]
    assert table["data"] == [[1, "why ?", "because .", 0.5],
                             [2, "why ?", '[{"role": "assistant", "content": "so"}]', 1.0]]


def test_a_failing_tracker_is_one_warning_and_metrics_go_on(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    run_dir = RunDir(tmp_path)
    w = MetricsWriter(run_dir, True, ["mlflow"], None)
    for r in RECORDS:
        w.write(r)
    w.close()
    err = [line for line in capsys.readouterr().err.splitlines() if "--report-to mlflow" in line]
    assert len(err) == 1 and "continuing without it" in err[0], err
    assert [json.loads(x)["step"] for x in run_dir.metrics.read_text().splitlines()] == [1, 2, 3]


def test_a_tracker_that_breaks_mid_run_is_dropped_after_one_warning(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = RunDir(tmp_path)
    w = MetricsWriter(run_dir, True, ["mlflow"], None)
    w.write(RECORDS[0])
    run_dir.mlflow_db.unlink()  # the store vanishes under the run
    run_dir.mlflow_db.mkdir()  # ... and a directory takes its name: every write now fails
    for r in RECORDS[1:]:
        w.write(r)
    w.close()
    err = [line for line in capsys.readouterr().err.splitlines() if "--report-to mlflow" in line]
    assert len(err) == 1, err
    assert len(run_dir.metrics.read_text().splitlines()) == 3


def test_a_tracker_that_is_not_installed_is_one_warning(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    w = MetricsWriter(RunDir(tmp_path), True, ["wandb"], None)
    w.write(RECORDS[0])
    w.close()
    err = capsys.readouterr().err
    assert "--report-to wandb: import (wandb is not installed: pip install wandb)" in err


def test_report_to_names_are_checked():
    from zerotrain.config.rules import report_targets
    from zerotrain.errors import ConfigError

    assert report_targets("none") == [] and report_targets("mlflow, tensorboard") == ["mlflow", "tensorboard"]
    with pytest.raises(ConfigError, match="unknown tracker 'comet'"):
        report_targets("mlflow,comet")
