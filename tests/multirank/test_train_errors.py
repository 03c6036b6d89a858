"""`zerotrain train` refuses bad input with one line and exit 2, before touching anything a run saved.

These fail in preflight (before any process group), so most run in-process through the real CLI
entry point (fast: imports are shared); one goes through a real `python -m zerotrain` process.
The multi-rank refusals (every rank exits, none waits) are in test_train.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.support.launch import rank_env, run
from zerotrain.checkpoint.store import CheckpointMeta
from zerotrain.cli import main


def snapshot(root: Path) -> dict[str, tuple[int, str, int]]:
    """Every file under root with size, content hash and mtime: 'nothing lost or replaced'."""
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny model dir, bad inputs, and a previous run's output dir (with a 'complete' checkpoint)."""
    root = tmp_path_factory.mktemp("errors")
    mp = pytest.MonkeyPatch()
    mp.setenv("ZEROTRAIN_CACHE", str(root / "cache"))
    from zerotrain.assets.demo import build_tiny

    model = build_tiny(root / "tiny", preset="tiny-gpt2")
    (root / "empty.jsonl").write_text("")
    (root / "nocol.jsonl").write_text(json.dumps({"body": "hello there"}) + "\n")
    (root / "nolabel.jsonl").write_text(json.dumps({"text": "good", "y": 1}) + "\n")
    (root / "emptydir").mkdir()
    (root / "afile").write_text("x")
    prev = root / "prev"
    tag = prev / "checkpoints" / "global_step2"
    tag.mkdir(parents=True)
    meta = CheckpointMeta(backend="deepspeed", format="deepspeed", zero_stage=2, world_size=1, dtype="fp32",
                          model_class="GPT2LMHeadModel", model_config_hash="0123456789abcdef", global_step=2)
    (tag / "zerotrain_meta.json").write_text(json.dumps(asdict(meta)))
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (prev / "checkpoints" / "latest").write_text("global_step2")
    (prev / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    (prev / "final").mkdir()
    (prev / "final" / "model.safetensors").write_bytes(b"final")
    yield {"root": root, "model": str(model), "prev": prev}
    mp.undo()


CASES = {
    "missing model dir": (["--model", "{root}/nope"], "--model {root}/nope: no such directory"),
    "model dir without config": (["--model", "{root}/emptydir"], "no config.json in it"),
    "hub id while offline": (["--model", "some-org/not-cached"], "the hub is offline"),
    "missing data file": (["--data", "{root}/nope.jsonl"], "--data {root}/nope.jsonl: no such file"),
    "empty dataset": (["--data", "{root}/empty.jsonl"], "the dataset is empty"),
    "missing text column": (["--data", "{root}/nocol.jsonl"], "no column 'text' (columns: body); pass --text-column"),
    "missing label column": (["--task", "seq-cls", "--data", "{root}/nolabel.jsonl"],
                             "no column 'label' (columns: text, y); pass --label-column"),
    "seq-len above the model": (["--seq-len", "512"], "--seq-len 512 is above the model's maximum of 256"),
    "fp16 on cpu": (["--precision", "fp16"], "fp16 is not supported on CPU"),
    "unwritable output": (["--output", "{root}/afile/out"], "is a file, not a directory"),
    "resume with nothing": (["--output", "{root}/fresh", "--resume"], "--resume: no complete checkpoint"),
    "resume path with nothing": (["--resume", "{root}/emptydir"], "no complete checkpoint found"),
    "another run's output": (["--output", "{prev}"], "holds another run (checkpoints, final, metrics.jsonl)"),
    "checkpoint of another model": (["--output", "{prev}", "--resume"],
                                    "checkpoint is of GPT2LMHeadModel (config 0123456789abcdef)"),
}


def _call(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["train", *argv])
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("zerotrain")]
    return rc, lines


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_one_line_nonzero_nothing_lost(env, case):
    argv, expected = CASES[case]
    fill = {"root": env["root"], "prev": env["prev"]}
    argv = [a.format(**fill) for a in argv]
    if "--model" not in argv:
        argv += ["--model", env["model"]]
    if "--output" not in argv:
        argv += ["--output", str(env["root"] / "out")]
    before = snapshot(env["prev"])
    rc, lines = _call(argv)
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("zerotrain train: error: "), lines
    assert expected.format(**fill) in lines[0]
    assert snapshot(env["prev"]) == before  # nothing the previous run saved was lost or replaced
    assert not (env["root"] / "out").exists() and not (env["root"] / "fresh").exists()


def test_real_process_exit_code(env):
    """The console path: a separate process, exit status 2, the error as the last stderr line."""
    res = run([sys.executable, "-m", "zerotrain", "train", "--model", env["model"], "--data",
               str(env["root"] / "nope.jsonl"), "--output", str(env["root"] / "out")],
              timeout=120, env=rank_env(ZEROTRAIN_CACHE=str(env["root"] / "cache")))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (f"zerotrain train: error: --data {env['root']}/nope.jsonl: no such "
                                                   "file; pass an existing .json/.jsonl/.csv/.txt/.parquet file")


@pytest.mark.multirank
def test_a_library_bug_keeps_its_traceback_and_ends_every_rank(tmp_path):
    """A plain ValueError raised by a library (not a zerotrain user error) inside `zerotrain train`, on
    rank 1 only, mid-training: its traceback is printed (not turned into a one-line "error:"), and the
    job ends with a non-zero exit instead of leaving rank 0 waiting in a collective."""
    from tests.support.launch import torchrun

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import transformers.models.gpt2.modeling_gpt2 as m\n"
        "    def forward(self, *args, **kwargs):\n"
        "        raise ValueError('simulated library bug')\n"
        "    m.GPT2Model.forward = forward\n")
    env = rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache"), PYTHONPATH=f"{hook}:{rank_env()['PYTHONPATH']}")
    res = torchrun(["-m", "zerotrain", "train", "--output", str(tmp_path / "run"), "--max-steps", "2",
                    "--dist-timeout", "60"], env=env, timeout=300, check=False)
    assert res.returncode != 0
    assert "Traceback (most recent call last)" in res.stderr and "ValueError: simulated library bug" in res.stderr, \
        res.stderr[-4000:]
    assert "error: simulated library bug" not in res.stderr  # not dressed up as a user error
