"""Runs that finish by themselves, through the CLI as a user runs them, on real CPU ranks: elastic restarts
(`zerotrain launch --elastic`), a lost node re-forming a smaller world, SIGTERM preemption, asynchronous
checkpoint saves and the hang watchdog. Faults are injected with $ZEROTRAIN_FAULT (zerotrain/distributed/faults.py).

Each backend runs its own family: DeepSpeed ZeRO-2 a GPT-2 (Conv1D, tied head), FSDP2 a Llama (RMSNorm, rotary,
GQA, untied head), both from scratch with dropout 0 (the tiny presets), fp32. The reference of every comparison is
the same job run straight through on 2 ranks (global batch 8); a step's loss after a restart must equal the
straight run's within 1e-5. CI runs one cell per test; the other backend's cell is `slow`. The lost node's CI cell
is the single-host one here (every CI runner can run it; the two-host version in tests/multirank/test_multihost.py
needs root and is `slow`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import REPO, free_port, rank_env, run, torchrun
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

BACKENDS = {"deepspeed": ["--backend", "deepspeed", "--stage", "2", "--model-config", "tiny-gpt2"],
            "fsdp": ["--backend", "fsdp", "--stage", "3", "--model-config", "tiny-llama"]}
COMMON = ["--seq-len", "32", "--pack", "--micro-batch", "2", "--grad-accum", "2", "--lr", "1e-3", "--max-steps", "8",
          "--save-every", "2", "--dist-timeout", "60"]


def train_args(backend: str, out: Path, *extra: str) -> list[str]:
    return ["train", *COMMON, *BACKENDS[backend], "--output", str(out), *extra]


def losses(out: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a step recomputed after a restart is logged again)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def events(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "resume"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return rank_env(ZEROTRAIN_CACHE=str(tmp_path_factory.mktemp("elastic_cache")))


STRAIGHT: dict[str, dict[int, float]] = {}
"""backend -> the uninterrupted 2-rank run's losses, once per pytest process: the straight runs of
tests/multirank/test_checkpoint_disk_full.py with these backend and model flags are the same job, and this one (CI
time, issue 50)."""


def straight_losses(backend: str, tmp_path_factory, env: dict) -> dict[int, float]:
    """The straight run of train_args(backend) (8 steps, a checkpoint every 2: saving changes no loss), on first use."""
    if backend not in STRAIGHT:
        out = tmp_path_factory.mktemp(f"straight_{backend}")
        torchrun(["-m", "zerotrain", *train_args(backend, out)], env=env, timeout=420)
        got = losses(out)
        assert sorted(got) == list(range(1, 9))
        STRAIGHT[backend] = got
    return STRAIGHT[backend]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, env):
    """backend -> the uninterrupted 2-rank run's losses (run once per backend and pytest process, on first use)."""
    return lambda backend: straight_losses(backend, tmp_path_factory, env)


def kill_run(job: subprocess.Popen, out: Path) -> None:
    """SIGKILL a torchrun job and its workers (torch's agent starts them in sessions of their own): every
    process whose command line names the run's output dir."""
    os.killpg(job.pid, signal.SIGKILL)
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(out) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    job.communicate()


def launch_elastic(nnodes: str, nproc: int, port: int, args: list[str], host: bool = True,
                   addr: str = "127.0.0.1") -> list[str]:
    """`zerotrain launch --elastic`; host: this agent holds the rendezvous store (torch's is_host; two agents on
    one machine both match 127.0.0.1)."""
    return [sys.executable, "-m", "zerotrain", "launch", "--elastic", nnodes, "--max-restarts", "2",
            "--nproc-per-node", str(nproc), "--rdzv-endpoint", f"{addr}:{port}",
            "--rdzv-conf", f"last_call_timeout=3,is_host={int(host)}", "--", *args]


def assert_same_losses(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    assert [got[s] for s in sorted(ref)] == pytest.approx([ref[s] for s in sorted(ref)], rel=1e-5)


@pytest.mark.parametrize("backend", cells(BACKENDS, {"fsdp"}))
def test_killed_rank_restarts_and_finishes_by_itself(tmp_path, env, straight, backend):
    """`zerotrain launch --elastic 1:1 --max-restarts 2` with --async-save: rank 1's writer of checkpoint 4 is held
    after its first file (training goes on: the save did not stall it), then rank 1 is SIGKILLed after step 5.
    Checkpoint 4 never became `latest`; the agent restarts the worker group, `--resume auto` (added by launch)
    continues from step 2 (the last committed one), the job exits 0 with final/, and every step's loss equals the
    straight run's."""
    out = tmp_path / "run"
    res = run(launch_elastic("1:1", 2, free_port(), train_args(backend, out, "--async-save")), timeout=600,
              env={**env, "ZEROTRAIN_FAULT": "hold-write:rank=1:step=4,kill:rank=1:step=5"})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    assert "--resume auto added" in log
    assert_same_losses(losses(out), straight(backend))
    (ev,) = events(out)
    assert (ev["restart"], ev["world_before"], ev["world_after"], ev["resumed_from_step"]) == (1, 2, 2, 2), ev
    assert ev["steps_recomputed"] == 2  # steps 3 and 4 were logged before the kill (5's record was pending)
    assert "elastic restart 1: resumed from step 2" in log
    assert (out / "final" / "config.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step8"
    saves = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r.get("event") in ("checkpoint", "checkpoint_committed")]
    pairs = [(r["event"], r["step"]) for r in saves]
    # the resume drops the records after step 2 (the held checkpoint 4's among them); every later checkpoint is
    # logged begun, then committed (also one committed by the next save or the end: 8 is the final save's)
    assert pairs == [("checkpoint", 2), ("checkpoint_committed", 2), ("checkpoint", 4), ("checkpoint_committed", 4),
                     ("checkpoint", 6), ("checkpoint_committed", 6), ("checkpoint_committed", 8)], pairs


@pytest.mark.parametrize("backend", cells(BACKENDS, {"deepspeed"}))
def test_lost_node_reforms_a_smaller_world_with_the_same_global_batch(tmp_path, env, straight, backend):
    """Two elastic agents (two nodes of one rank each, one machine); the second node is lost after step 5 (its
    agent and rank SIGKILLed). The agent holding the rendezvous re-forms a world of one node, keeps the global
    batch 8 (grad-accum 2 -> 4), resumes through DeepSpeed's universal conversion / DCP resharding, finishes with
    exit 0, and every step's loss equals the straight 2-rank run's."""
    out, port = tmp_path / "run", free_port()
    first = subprocess.Popen(launch_elastic("1:2", 1, port, train_args(backend, out), host=True), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    time.sleep(2.0)  # the first agent hosts the rendezvous store
    second = run(launch_elastic("1:2", 1, port, train_args(backend, out), host=False), timeout=600,
                 env={**env, "ZEROTRAIN_FAULT": "kill-node:rank=any:step=5"})
    try:
        log, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode != 0  # its node was lost
    assert first.returncode == 0, log[-6000:]
    ev = events(out)[-1]
    assert (ev["world_before"], ev["world_after"], ev["resumed_from_step"], ev["grad_accum"]) == (2, 1, 4, 4), ev
    assert "world 2 -> 1 ranks, global batch 8 kept (grad-accum 4)" in log
    assert_same_losses(losses(out), straight(backend))


@pytest.mark.parametrize("backend", cells(BACKENDS, {"deepspeed"}))
def test_sigterm_checkpoints_at_the_next_step_and_resume_auto_continues(tmp_path, env, straight, backend):
    """SIGTERM to rank 0 after step 3 (a scheduler's preemption): both ranks agree at that step boundary, the
    step-3 checkpoint is committed, the ranks exit 143; `--resume auto` then continues to step 8 exactly."""
    out = tmp_path / "run"
    res = torchrun(["-m", "zerotrain", *train_args(backend, out)], env={**env, "ZEROTRAIN_FAULT": "term:rank=0:step=3"},
                   timeout=420, check=False)
    log = res.stdout + res.stderr
    assert res.returncode != 0
    assert "exitcode  : 143" in log, log[-4000:]
    assert "preempted (SIGTERM) after step 3" in log
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step3"
    assert sorted(losses(out)) == [1, 2, 3]
    torchrun(["-m", "zerotrain", *train_args(backend, out, "--resume", "auto")], env=env, timeout=420)
    assert_same_losses(losses(out), straight(backend))


@pytest.mark.parametrize("backend", cells(BACKENDS, {"deepspeed"}))  # DeepSpeed's: inside the killed-rank test
def test_async_save_trains_on_and_a_kill_mid_write_keeps_the_previous_latest(tmp_path, env, straight, backend):
    """--async-save: rank 1's writer of checkpoint 4 is held after its first file; training goes on past step 4
    (the save did not stall it), checkpoint 4 never becomes `latest`; the job is killed at step 6. `latest`
    is still step 2, step 4 is incomplete, and `--resume auto` continues from step 2 to step 8 exactly."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "zerotrain", *train_args(backend, out, "--async-save")]
    job = subprocess.Popen(cmd, cwd=REPO, env={**env, "ZEROTRAIN_FAULT": "hold-write:rank=1:step=4"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            if (out / "metrics.jsonl").is_file() and 6 in losses(out):
                break
            time.sleep(0.5)
        assert 6 in losses(out), "training did not go on past the held save"
        assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    finally:
        kill_run(job, out)
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    assert not (out / "checkpoints" / "global_step4" / "zerotrain_meta.json").exists()
    res = torchrun(["-m", "zerotrain", *train_args(backend, out, "--resume", "auto", "--async-save")], env=env,
                   timeout=420)
    assert "resumed from step 2" in res.stdout + res.stderr
    assert_same_losses(losses(out), straight(backend))
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step8"


@pytest.mark.parametrize("backend", cells(BACKENDS, {"deepspeed"}))
def test_a_rank_stuck_outside_collectives_is_named_and_the_job_ends(tmp_path, env, backend):
    """Rank 1 stops after step 3 outside any collective; rank 0 waits in the next one. Within --dist-timeout /
    --hang-timeout (15 s) + a few seconds both ranks dumped their stacks and last collectives, rank 0 named
    rank 1 in one line, and the job ended (exit 3)."""
    out = tmp_path / "run"
    res = torchrun(["-m", "zerotrain", *train_args(backend, out, "--dist-timeout", "15", "--hang-timeout", "15")],
                   env={**env, "ZEROTRAIN_FAULT": "hang:rank=1:step=3"}, timeout=300, check=False)
    log = res.stdout + res.stderr
    assert res.returncode != 0  # and it ended by itself: run() fails the test at its 300 s timeout
    assert "zerotrain: hang: rank 1 (step 3) stopped outside any collective" in log, log[-4000:]
    assert "exitcode  : 3" in log
    for rank in (0, 1):
        head = json.loads((out / "hang" / f"rank{rank}.txt").read_text().splitlines()[0])
        assert head["rank"] == rank and head["last_collective"]["op"].startswith("gloo:"), head
    assert "python stacks:" in (out / "hang" / "rank1.txt").read_text()
    assert "faults.py" in (out / "hang" / "rank1.txt").read_text()  # the stack shows where rank 1 is stuck
