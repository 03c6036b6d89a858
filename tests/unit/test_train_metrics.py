"""zerotrain.train.metrics and trainer helpers that need no launch: peak RSS, metrics trimming on resume,
step figures, run planning, output-dir refusal."""
from __future__ import annotations

import json

import pytest
import torch

from zerotrain.checkpoint.run_dir import RunDir
from zerotrain.config.load import build_config
from zerotrain.plan.resolve import plan_run
from zerotrain.train.metrics import MetricsWriter, StepTimer, peak_rss_bytes, trim_jsonl
from zerotrain.train.preflight import check_output


def test_peak_rss_is_read_from_proc():
    assert peak_rss_bytes() > 10 * 2**20


def test_trim_keeps_records_up_to_the_checkpoint(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    trim_jsonl(p, 4)
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3, 4]


def test_writer_fresh_vs_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    MetricsWriter(RunDir(tmp_path), main=True, trackers=[], resume_step=1).write({"step": 2, "loss": 0.5})
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1}, {"step": 2, "loss": 0.5}]
    MetricsWriter(RunDir(tmp_path), main=True, trackers=[], resume_step=None)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_step_figures_single_process():
    t = StepTimer("cpu")
    t.add(torch.tensor(2.0), 100, 4)  # the trainer passes the loss tensor: read once per step
    t.add(4.0, 50, 2)
    f = t.figures(dp_size=1).result()
    assert f["loss"] == 3.0 and f["tokens"] == 150 and f["samples"] == 6 and f["peak_mem_bytes"] > 0
    assert f["tokens_per_s"] == pytest.approx(150 / f["step_time_s"])


def test_step_figures_from_the_rows_the_step_boundary_gathers(monkeypatch):
    """Two ranks' rows, as StopSignal.agree hands them over: the loss is the replicas' mean, tokens and samples
    are summed, time and memory are the largest rank's; before the rows arrive there is no result."""
    from zerotrain.train import metrics

    monkeypatch.setattr(metrics, "is_distributed", lambda: True)
    a, b = StepTimer("cpu"), StepTimer("cpu")
    a.add(torch.tensor(2.0), 100, 4)
    b.add(torch.tensor(4.0), 60, 4)
    fa, fb = a.figures(dp_size=2), b.figures(dp_size=2)
    with pytest.raises(RuntimeError, match="before the ranks' rows were gathered"):
        fa.result()
    fb.local[3] = 9.0  # rank 1's step took longer
    fa.take(torch.tensor([fa.local, fb.local]).reshape(-1))
    f = fa.result()
    assert (f["loss"], f["tokens"], f["samples"], f["step_time_s"]) == (3.0, 160, 8, 9.0)
    assert f["tokens_per_s"] == pytest.approx(160 / 9.0)


def test_step_boundary_without_a_process_group_answers_for_this_rank():
    """One process: the exchange is local (no group), sums and rows are this rank's own."""
    from zerotrain.distributed.preemption import StopSignal

    stop = StopSignal(0, 30)
    try:
        agreed = stop.agree(True, False, [12.0], [1.0, 2.0])
        assert (agreed.stopping, agreed.still_writing, agreed.write_failed) == (False, True, False)
        assert agreed.sums == [12.0] and agreed.rows.tolist() == [[1.0, 2.0]]
        assert stop.gather([3.0]).tolist() == [[3.0]]
    finally:
        stop.close()


def test_plan_epochs_steps_and_too_little_data():
    cfg = build_config(overrides={"batch.micro_batch": 4, "batch.grad_accum": 2, "run.epochs": 2.5})
    p = plan_run(cfg, n_train=100, facts=None, world=2, backend="deepspeed", device="cpu")  # 50 per rank -> 12 micro-batches -> 6 steps per epoch
    assert (p.steps_per_epoch, p.total_steps, p.batch.global_batch) == (6, 15, 16)
    with pytest.raises(ValueError, match="fewer than one optimizer step needs"):
        plan_run(cfg, n_train=10, facts=None, world=2, backend="deepspeed", device="cpu")


def test_output_refusal_and_empty_dirs_are_fine(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)  # an empty leftover dir is not "another run"
    check_output(build_config(overrides={"run.output": str(out)}))
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="holds another run"):
        check_output(build_config(overrides={"run.output": str(out)}))
    check_output(build_config(overrides={"run.output": str(out), "run.overwrite": True}))


def test_malloc_tuning_on_glibc_and_user_override(monkeypatch):
    import platform

    from zerotrain.distributed import host_malloc

    monkeypatch.setattr(host_malloc, "_done", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")  # the user's own setting wins
    assert host_malloc.tune() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert host_malloc.tune() is (platform.libc_ver()[0] == "glibc")
