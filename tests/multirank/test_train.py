"""`zerotrain train` through real launchers, 2 CPU ranks (launch once, check much).

- the embedded demo (no --model, no --data) at ZeRO-3 through the `deepspeed` launcher with a
  hostfile: outputs, falling loss, eval, TensorBoard, `final/` == the trained weights;
- the same run as 4 steps + `--resume` + 4 steps under torchrun, with a loader worker reading ahead: identical losses;
- a corrupted shard that only rank 1 reads: both ranks exit 2 with one line, none waits;
- a bad --data under the deepspeed launcher: both ranks refuse before any process group;
- seq-cls on the embedded labelled set (string labels) at ZeRO-2: loss falls, accuracy, final reloads.
Steps use a constant LR after warmup so the half run follows the full run's LR exactly.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import free_port, rank_env, run, torchrun

pytestmark = pytest.mark.multirank

COMMON = ["--stage", "3", "--schedule", "constant", "--warmup-steps", "6", "--eval-split", "0.1",
          "--eval-every", "4", "--save-every", "4", "--dist-timeout", "60"]


def records(path: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def deepspeed_launch(tmp: Path, args: list[str], env: dict, timeout: float = 420):
    """The README's command: the deepspeed launcher, one node, no ssh, a hostfile."""
    hostfile = tmp / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
           "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "--module", "zerotrain", "train", *args]
    return run(cmd, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    env = rank_env(ZEROTRAIN_CACHE=str(root / "cache"))
    return root, env


@pytest.fixture(scope="module")
def full(ws):
    root, env = ws
    out = root / "full"
    env = {k: v for k, v in env.items() if k != "TRANSFORMERS_VERBOSITY"}  # transformers' warnings as a user sees them
    res = deepspeed_launch(root, ["--output", str(out), "--max-steps", "8", "--tensorboard", *COMMON], env)
    assert res.returncode == 0, res.stderr[-6000:]
    return out, res


def test_demo_zero3_outputs_and_final_matches(full):
    out, res = full
    steps, evals = records(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 9))
    for key in ("epoch", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "peak_mem_bytes"):
        assert all(r[key] is not None for r in steps), key
    assert all(r["peak_mem_bytes"] > 50e6 and r["tokens_per_s"] > 0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, [r["loss"] for r in steps]
    assert [e["step"] for e in evals] == [4, 8] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[1]["eval_perplexity"] == pytest.approx(torch.tensor(evals[1]["eval_loss"]).exp().item(), rel=1e-6)
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_batch_size"] == 8  # micro 4 x 2 ranks
    from zerotrain.config.load import build_config

    cfg = build_config(out / "run_config.yaml")
    assert cfg.zero.stage == 3 and cfg.optimizer.lr == 1e-3  # the demo's resolved LR is recorded
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step8"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "done: 8 steps" in res.stdout and "train:" in res.stderr  # summary + progress bar
    # log noise silenced at its source (zerotrain/__init__.py, model.ModelBuilder._finish): lines that say
    # nothing about the run (torchao's CUDA kernels on a CPU build, torch's enum note, GPT-2's loss name)
    for noise in ("Failed to load", "is an Enum subclass", "loss_type=None"):
        assert noise not in res.stderr + res.stdout, noise

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"))
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    state = final.state_dict()
    for k, v in trained.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    ids = tok("Anna walked to the garden.", return_tensors="pt")["input_ids"]
    assert final(ids).logits.shape[-1] == final.config.vocab_size


def stopped_at_step4(run_dir: Path, out: Path) -> Path:
    """A run dir holding run_dir's step-4 checkpoint as `latest` and its metrics (a resume drops the records after
    step 4): a run stopped there."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "global_step4", out / "checkpoints" / "global_step4")
    (out / "checkpoints" / "latest").write_text("global_step4")
    shutil.copy(run_dir / "metrics.jsonl", out / "metrics.jsonl")
    return out


@pytest.fixture(scope="module")
def resumed(ws, full):
    """The demo run's step-4 checkpoint and metrics (a run stopped there: its records after step 4 are dropped on
    resume), resumed under torchrun to step 8. Not a 4-step run of its own (CI time, issue 51): stopping after a
    finished run's last step and going on is CI in test_preference.py's precomputed-reference cell."""
    root, env = ws
    out = stopped_at_step4(full[0], root / "resumed")
    # --loader-workers 1: a loader process reads ahead; the losses equal the full run's (read in the training process)
    res = torchrun(["-m", "zerotrain", "train", "--output", str(out), *COMMON, "--max-steps", "8", "--resume",
                    "--loader-workers", "1"],
                   env=env, timeout=420)
    return out, res


def test_resume_continues_exactly(full, resumed):
    out, res = resumed
    assert "resuming from" in res.stdout
    ref, _ = records(full[0] / "metrics.jsonl")
    got, evals = records(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 9))  # each step once: metrics continue, not restart
    torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([r["lr"] for r in got], [r["lr"] for r in ref])
    assert [e["step"] for e in evals] == [4, 8]


@pytest.mark.slow  # CI: a 1-rank resume keeping the global batch, test_elastic.py (lost node, FSDP2)
def test_resume_on_one_rank_keeps_the_global_batch(ws, full, resumed):
    """The 2-rank ZeRO-3 run's step-4 checkpoint, resumed by ONE plain process with no batch flag: the
    checkpoint's global batch 8 is kept (grad-accum 2 instead of 2 ranks), DeepSpeed's universal conversion,
    same data position, and steps 5-8 follow the 2-rank run; the resume record says so."""
    root, env = ws
    out = stopped_at_step4(resumed[0], root / "one_rank")
    res = run([sys.executable, "-m", "zerotrain", "train", "--output", str(out), "--resume", "--max-steps", "8",
               *COMMON], env=env, timeout=420)
    assert res.returncode == 0, res.stderr[-6000:]
    assert "universal format for 1 ranks at stage 3" in res.stdout
    assert "world 2 -> 1 ranks, global batch 8 kept (grad-accum 2)" in res.stdout, res.stdout[-3000:]
    ref, _ = records(full[0] / "metrics.jsonl")
    got, _ = records(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 9))
    torch.testing.assert_close([r["loss"] for r in got[4:]], [r["loss"] for r in ref[4:]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([r["lr"] for r in got], [r["lr"] for r in ref])
    assert not (out / "checkpoints" / ".universal").exists()
    resume = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    last = resume[-1]  # the copied metrics.jsonl holds the 2-rank resume's record before it
    assert (last["world_before"], last["world_after"], last["resumed_from_step"], last["grad_accum"]) == (2, 1, 4, 2)
    # a micro-batch that cannot make the kept global batch is refused up front, naming one that can
    bad = run([sys.executable, "-m", "zerotrain", "train", "--output", str(out), "--resume", "--max-steps", "9",
               *COMMON, "--micro-batch", "3"], env=env, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "pass --micro-batch 2 (grad-accum becomes 4), or pass --global-batch to train on with another batch"), \
        bad.stderr[-3000:]


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_one_rank_failure_stops_every_rank(ws, resumed):
    """Rank 1's ZeRO-3 shard truncated: the file check before loading (checkpoint.verify_files, one rank
    per file) names it on one rank, the other stops as its peer; both exit 2 with one line each."""
    root, env = ws
    out = root / "corrupt"
    out.mkdir()
    shutil.copytree(resumed[0] / "checkpoints", out / "checkpoints")
    shard = out / "checkpoints" / "global_step8" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    before = _snapshot(out)
    res = torchrun(["-m", "zerotrain", "train", "--output", str(out), "--resume", "--max-steps", "10", *COMMON],
                   env=env, timeout=300, check=False, agent=True)  # the agent's report names each rank's exit code
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("zerotrain train: error:")]
    assert len(lines) == 2, res.stderr[-4000:]
    assert any("another rank failed" in ln for ln in lines)
    assert any(f"error: {out}/checkpoints/global_step8: zero_pp_rank_1_mp_rank_00_model_states.pt has 1000 bytes, "
               "the save wrote" in ln for ln in lines), lines
    assert "exitcode  : 2" in res.stderr
    assert _snapshot(out) == before  # nothing written, nothing replaced


def test_checkpoint_of_another_model_is_refused(ws, resumed):
    """A real checkpoint (embedded small GPT-2) resumed with a different --model: refused up front."""
    root, _ = ws
    from zerotrain.assets.demo import build_tiny
    from zerotrain.cli import main

    other = build_tiny(root / "other-model", preset="tiny-gpt2")
    before = _snapshot(resumed[0])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["train", "--model", str(other), "--output", str(resumed[0]), "--resume", "--stage", "3"])
    assert rc == 2 and "checkpoint is of GPT2LMHeadModel" in err.getvalue().strip().splitlines()[-1]
    assert _snapshot(resumed[0]) == before


def test_bad_data_every_rank_refuses_before_init(ws):
    root, env = ws
    res = deepspeed_launch(root, ["--output", str(root / "bad"), "--data", str(root / "missing.jsonl")], env,
                           timeout=180)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    line = f"zerotrain train: error: --data {root}/missing.jsonl: no such file"
    assert text.count(line) == 2, text[-3000:]  # both ranks, each one line
    assert not (root / "bad").exists()


def test_seq_cls_string_labels(ws):
    root, env = ws
    from zerotrain.assets.demo import build_tiny

    model = build_tiny(root / "tiny", preset="tiny-gpt2")
    out = root / "cls"
    res = torchrun(["-m", "zerotrain", "train", "--task", "seq-cls", "--model", str(model), "--output", str(out),
                    "--stage", "2", "--micro-batch", "8", "--lr", "3e-3", "--max-steps", "40",
                    "--eval-split", "0.1"], env=env, timeout=420)
    steps, evals = records(out / "metrics.jsonl")
    losses = [r["loss"] for r in steps]
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8 - 0.1, losses
    assert len(evals) == 1 and evals[0]["eval_accuracy"] > 0.6 and "accuracy" in res.stdout

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForSequenceClassification

    final = AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert final.config.id2label == {0: "negative", 1: "positive"}
    state = final.state_dict()
    for k, v in get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints")).items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
