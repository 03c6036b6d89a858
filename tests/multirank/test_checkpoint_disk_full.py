"""A full disk on one rank, injected from outside zerotrain (tests/support/disk_full/sitecustomize.py on the ranks'
PYTHONPATH): a checkpoint is `latest` only when every rank wrote all of its files, sync and async, DeepSpeed ZeRO-2
and FSDP2, through `python -m zerotrain train` under torchrun as a user runs it (2 CPU ranks).

Each cell (backend x save mode x family), `--save-every 2 --max-steps 8`, rank 1's writes of checkpoint 4 failing
with ENOSPC ("rank=1:path=global_step4"), in two launches (the CI cell: the first sync, the second async):
1. the job is killed right after step 5 ($ZEROTRAIN_FAULT kill, only the kill: the disk fault is the
   sitecustomize's): checkpoint 4 failed first (a sync save: with one warning line naming rank 1, its file and the
   errno text, before the kill);
2. `--resume auto` on the same output, the disk still full for checkpoint 4: it resumes from global_step2 (the failed
   tag never wins), fails checkpoint 4 again and goes on: exit 0, no global_step4 left, `latest` = global_step8,
   global_step2/6/8 complete, a checkpoint_failed record, and its steps 3..8 equal the straight run's (1e-5).
One straight run per backend and family (no fault) is shared by the module (and with tests/multirank/test_elastic.py,
which runs the same jobs).
Every save failing ("rank=1:path=global_step"): the run stops after ck.MAX_FAILED_SAVES with one error line, exit
non-zero, no traceback, `latest` never names an incomplete tag. The final checkpoint failing: exit non-zero, the line
names the last complete checkpoint, final/ is written from memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.multirank.test_elastic as elastic
from tests.support.launch import disk_full_env, rank_env, torchrun
from zerotrain.checkpoint import store as ck

pytestmark = pytest.mark.multirank

COMMON = ["-m", "zerotrain", "train", "--seq-len", "32", "--pack", "--micro-batch", "2", "--grad-accum", "2",
          "--lr", "1e-3", "--max-steps", "8", "--dist-timeout", "60"]
BACKENDS = {"deepspeed": ["--backend", "deepspeed", "--stage", "2"], "fsdp": ["--backend", "fsdp", "--stage", "3"]}
FAMILIES = {"gpt2": ["--model-config", "tiny-gpt2"], "llama": ["--model-config", "tiny-llama"]}
"""The tiny presets from scratch (the embedded demo model, 20x larger, only made every checkpoint slower to write: CI
time, issue 50); the runs without a family train the GPT-2."""
CI_CELLS = [pytest.param("deepspeed", "sync-then-async", "gpt2", id="deepspeed-sync-then-async-gpt2")]
"""CI: the cheapest cell with the whole proof of both save modes in its two launches: the first saves synchronously
(its failed checkpoint 4 warned of at once, before the kill), the resumed one with --async-save (FSDP2's failing
write is CI through test_every_save_failing_stops_the_run_in_one_line[fsdp-async]); the matrix is slow (CI time)."""
CELLS = CI_CELLS + [pytest.param(b, m, f, id=f"{b}-{m}-{f}", marks=pytest.mark.slow)
                    for f in FAMILIES for b in BACKENDS for m in ("async", "sync")]


def _rows(output: Path) -> dict[int, float]:
    """step -> loss of metrics.jsonl's training records (a resumed run's own records replace the attempt's)."""
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _events(output: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == kind]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("disk_full_cache"))


def _job(args: list[str]) -> list[str]:
    """The flags that decide the losses: all but --save-every N (saving changes no loss)."""
    i = args.index("--save-every") if "--save-every" in args else len(args)
    return args[:i] + args[i + 2:]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """(backend, family) -> the losses of a straight 8-step run (no fault), run once: test_elastic.py's where it is
    the same job (DeepSpeed GPT-2, FSDP2 Llama), else one without checkpoints."""
    done: dict[tuple[str, str], dict[int, float]] = {}

    def get(backend: str, family: str) -> dict[int, float]:
        if _job([*COMMON[3:], *BACKENDS[backend], *FAMILIES[family]]) == _job([*elastic.COMMON,
                                                                                 *elastic.BACKENDS[backend]]):
            return elastic.straight_losses(backend, tmp_path_factory, rank_env(ZEROTRAIN_CACHE=cache))
        if (backend, family) not in done:
            out = tmp_path_factory.mktemp(f"straight-{backend}-{family}")
            torchrun([*COMMON, *BACKENDS[backend], *FAMILIES[family], "--no-save-final", "--output", str(out)],
                     env=rank_env(ZEROTRAIN_CACHE=cache), timeout=300)
            done[backend, family] = _rows(out)
        return done[backend, family]

    return get


def _ranks_stderr(stderr: str) -> str:
    """The ranks' stderr: without torchrun's own report of a non-zero exit (its ChildFailedError traceback, which
    any failed rank gets from the launcher)."""
    cut = stderr.rfind("Traceback (most recent call last)")
    return stderr[:cut] if cut >= 0 and "ChildFailedError" in stderr[cut:] else stderr


def _warning_lines(stderr: str) -> list[str]:
    return [line.split("zerotrain train: warning: ", 1)[1] for line in stderr.replace("\r", "\n").splitlines()
            if "zerotrain train: warning: checkpoint" in line]


@pytest.mark.parametrize("backend, mode, family", CELLS)
def test_a_failed_checkpoint_is_never_latest_and_resume_auto_continues_exactly(backend, mode, family, tmp_path,
                                                                                 cache, straight):
    want = straight(backend, family)
    out = tmp_path / "run"
    first_async, then_async = mode == "async", mode != "sync"  # sync-then-async: the attempt sync, the resume async
    args = [*COMMON, *BACKENDS[backend], *FAMILIES[family], "--save-every", "2", "--keep-last", "3",
            "--resume", "auto", "--output", str(out)]
    full = "rank=1:path=global_step4"
    ckpts = out / ck.CHECKPOINTS_DIR
    failed_line = (f"checkpoint {ckpts / 'global_step4'} was not saved (rank 1: ", "[Errno 28] No space left on device",
                   str(ckpts / "global_step4") + "/", f"`latest` stays at {ckpts / 'global_step2'}")

    killed = torchrun([*args, "--no-save-final", *(["--async-save"] if first_async else [])],
                      env=disk_full_env(full, ZEROTRAIN_CACHE=cache, ZEROTRAIN_FAULT="kill:rank=1:step=5"),
                      timeout=300, check=False)
    assert killed.returncode != 0, killed.stdout[-2000:]
    if not first_async:  # a failed synchronous save is reported when it returns, before step 5's kill
        warnings = _warning_lines(killed.stderr)
        assert len(warnings) == 1 and all(s in warnings[0] for s in failed_line), killed.stderr[-4000:]
    assert (ckpts / "global_step2" / ck.META_FILE).is_file() and not ck.is_complete(ckpts / "global_step4")
    assert ck.newest_complete(ckpts) == ckpts / "global_step2"  # what --resume auto will land on
    before = _rows(out)
    assert all(_close(before[s], want[s]) for s in range(1, 5)), (before, want)

    res = torchrun([*args, *(["--async-save"] if then_async else [])], env=disk_full_env(full, ZEROTRAIN_CACHE=cache),
                   timeout=300, check=False)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert f"resuming from {ckpts / 'global_step2'}" in res.stdout
    warnings = _warning_lines(res.stderr)
    assert len(warnings) == 1, res.stderr[-4000:]
    assert all(s in warnings[0] for s in failed_line), warnings[0]
    assert "Traceback" not in res.stderr
    assert not (ckpts / "global_step4").exists()
    assert ck.read_latest(ckpts) == "global_step8"
    assert [d.name for d in ck.list_complete(ckpts)] == ["global_step2", "global_step6", "global_step8"]
    for tag in ("global_step6", "global_step8"):
        assert ck.missing_files(ckpts / tag, ck.read_meta(ckpts / tag)) == []
    failed = _events(out, "checkpoint_failed")
    assert [(r["step"], r["last_complete"]) for r in failed] == [(4, str(ckpts / "global_step2"))], failed
    assert "rank 1: [Errno 28]" in failed[0]["error"]
    got = _rows(out)
    assert sorted(got) == list(range(1, 9))
    assert all(_close(got[s], want[s]) for s in range(3, 9)), (got, want)
    assert (out / "final" / "config.json").is_file()


@pytest.mark.parametrize("backend, mode", [pytest.param("fsdp", "async", id="fsdp-async"),
                                           pytest.param("deepspeed", "sync", id="deepspeed-sync",
                                                        marks=pytest.mark.slow)])
def test_every_save_failing_stops_the_run_in_one_line(backend, mode, tmp_path, cache):
    out = tmp_path / "run"
    res = torchrun([*COMMON, *BACKENDS[backend], *FAMILIES["gpt2"], "--save-every", "2", "--no-save-final", "--output",
                    str(out), *(["--async-save"] if mode == "async" else [])],
                   env=disk_full_env("rank=1:path=global_step", ZEROTRAIN_CACHE=cache), timeout=300, check=False)
    assert res.returncode != 0
    assert "Traceback" not in _ranks_stderr(res.stderr), res.stderr[-4000:]
    errors = [line for line in res.stderr.replace("\r", "\n").splitlines() if "zerotrain train: error:" in line]
    ckpts = out / ck.CHECKPOINTS_DIR
    assert len(errors) == 1, res.stderr[-4000:]
    assert f"{ck.MAX_FAILED_SAVES} checkpoint saves in a row failed; the last, {ckpts / 'global_step6'}, " in errors[0]
    assert "rank 1: [Errno 28] No space left on device" in errors[0] and "no complete checkpoint" in errors[0]
    assert len(_warning_lines(res.stderr)) == ck.MAX_FAILED_SAVES - 1
    assert [r["step"] for r in _events(out, "checkpoint_failed")] == [2, 4, 6]
    assert ck.read_latest(ckpts) is None and ck.list_complete(ckpts) == []
    assert not any(ckpts.glob("global_step*"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_a_failed_final_checkpoint_exits_non_zero_naming_the_last_complete_one(backend, tmp_path, cache):
    out = tmp_path / "run"
    res = torchrun([*COMMON, *BACKENDS[backend], *FAMILIES["gpt2"], "--save-every", "3", "--output", str(out)],
                   env=disk_full_env("rank=1:path=global_step8", ZEROTRAIN_CACHE=cache), timeout=300, check=False)
    ckpts = out / ck.CHECKPOINTS_DIR
    errors = [line for line in res.stderr.replace("\r", "\n").splitlines() if "zerotrain train: error:" in line]
    assert res.returncode != 0 and "Traceback" not in _ranks_stderr(res.stderr), res.stderr[-4000:]
    assert len(errors) == 1 and f"the final checkpoint of step 8, {ckpts / 'global_step8'}, was not saved" in errors[0]
    assert f"the last complete checkpoint is {ckpts / 'global_step6'}" in errors[0]
    assert "final/ was written" in errors[0]
    assert ck.read_latest(ckpts) == "global_step6" and not (ckpts / "global_step8").exists()
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow
def test_a_failed_preemption_checkpoint_exits_non_zero_naming_the_last_complete_one(tmp_path, cache):
    """SIGTERM after step 5 (a scheduler's preemption), and rank 1 cannot write checkpoint 5: not exit 143 (which
    says "committed, requeue me"), but one line naming checkpoint 4, the last complete one."""
    out = tmp_path / "run"
    res = torchrun([*COMMON, *BACKENDS["deepspeed"], *FAMILIES["gpt2"], "--save-every", "2", "--output", str(out)],
                   env=disk_full_env("rank=1:path=global_step5", ZEROTRAIN_CACHE=cache,
                                     ZEROTRAIN_FAULT="term:rank=0:step=5"), timeout=300, check=False)
    ckpts = out / ck.CHECKPOINTS_DIR
    errors = [line for line in res.stderr.replace("\r", "\n").splitlines() if "zerotrain train: error:" in line]
    assert res.returncode not in (0, 143) and "Traceback" not in _ranks_stderr(res.stderr), res.stderr[-4000:]
    assert len(errors) == 1 and f"the preemption checkpoint of step 5, {ckpts / 'global_step5'}, was not saved" in \
        errors[0] and f"the last complete checkpoint is {ckpts / 'global_step4'}" in errors[0], errors
    assert ck.read_latest(ckpts) == "global_step4" and not (ckpts / "global_step5").exists()
