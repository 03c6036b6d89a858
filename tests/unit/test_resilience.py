"""The parts of runs that finish by themselves that need no ranks: `zerotrain launch --elastic`'s command and
refusals, `--resume auto`, the global batch a resume keeps, the resume record, fault specs, the hang report and
the asynchronous writer. The real runs: tests/multirank/test_elastic.py."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from zerotrain.checkpoint import store as ck
from zerotrain.checkpoint.async_save import FileWriter, host_copy
from zerotrain.cli import main as cli_main
from zerotrain.commands.launch import elastic_train_args
from zerotrain.config.schema import RunConfig
from zerotrain.distributed import faults, watchdog
from zerotrain.errors import UserError
from zerotrain.launch import launchers as L
from zerotrain.plan.resolve import keep_global_batch
from zerotrain.train.restarts import last_logged_step, resumption


def test_elastic_command_and_its_refusals(capsys):
    assert L.parse_elastic("1:2") == (1, 2) and L.parse_elastic("3") == (3, 3)
    for bad in ("2:1", "0:1", "a:b", "1:2:3"):
        with pytest.raises(UserError, match="give MIN:MAX"):
            L.parse_elastic(bad)
    assert cli_main(["launch", "--elastic", "1:2", "--max-restarts", "4", "--nproc-per-node", "8", "--rdzv-endpoint",
                     "node1:29400", "--rdzv-conf", "last_call_timeout=5", "--print", "torchrun", "--", "train",
                     "--stage", "3", "--save-every", "50"]) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --nnodes=1:2 --nproc-per-node=8 --max-restarts=4 --rdzv-backend=c10d " \
           "--rdzv-endpoint=node1:29400 --rdzv-id=zerotrain --rdzv-conf=last_call_timeout=5 -m zerotrain train " \
           "--stage 3 --save-every 50 --resume auto" in out
    assert cli_main(["launch", "--elastic", "1:1", "--hostfile", "h", "--", "train"]) == 2
    assert "drop --hostfile" in capsys.readouterr().err
    assert cli_main(["launch", "--hostfile", "h", "--nproc-per-node", "2", "--", "train"]) == 2
    assert "--nproc-per-node is a setting of --elastic" in capsys.readouterr().err


def test_elastic_ranks_resume_auto():
    args, notes = elastic_train_args(["--stage", "3"])
    assert args[-2:] == ["--resume", "auto"]
    assert any("no --save-every" in n for n in notes)  # a restart would recompute from step 0: said
    assert elastic_train_args(["--resume", "auto", "--save-every", "5"]) == (["--resume", "auto", "--save-every", "5"],
                                                                          [])
    for resume in (["--resume"], ["--resume", "latest"], ["--resume=runs/x/checkpoints"]):
        with pytest.raises(UserError, match="needs --resume auto"):
            elastic_train_args(resume)


def _checkpoint(root: Path, step: int, world: int, global_batch: int) -> Path:
    tag = root / "checkpoints" / ck.tag_for(step)
    tag.mkdir(parents=True)
    meta = ck.CheckpointMeta(backend="fsdp", format="dcp", zero_stage=3, world_size=world, dtype="fp32",
                             model_class="M", model_config_hash="h", global_step=step,
                             extra={"data": {"text_packing": 2, "global_batch": global_batch}})
    ck.write_meta(tag, meta)
    ck.write_latest(root / "checkpoints", tag.name)
    return tag


def test_resume_auto_and_latest(tmp_path):
    assert ck.resolve_resume(tmp_path, "auto") is None  # nothing yet: a fresh start
    with pytest.raises(UserError, match="or pass --resume auto"):
        ck.resolve_resume(tmp_path, "latest")
    (tmp_path / "checkpoints" / "global_step4").mkdir(parents=True)  # a save cut short: never resumed from
    assert ck.resolve_resume(tmp_path, "auto") is None
    tag = _checkpoint(tmp_path, 2, 2, 8)
    assert ck.resolve_resume(tmp_path, "auto") == tag == ck.resolve_resume(tmp_path, "latest")


def test_a_resume_keeps_the_checkpoints_global_batch():
    cfg = RunConfig.model_validate({"batch": {"micro_batch": 2, "grad_accum": 2}})
    kept = keep_global_batch(cfg, 1, "ck/global_step2", 8)
    assert kept.batch.global_batch == 8  # --grad-accum given too: recomputed (the resume line says so)
    explicit = RunConfig.model_validate({"batch": {"micro_batch": 2, "global_batch": 4}})
    assert keep_global_batch(explicit, 1, "ck/global_step2", 8) is explicit  # --global-batch wins
    with pytest.raises(UserError) as e:
        keep_global_batch(cfg, 3, "ck/global_step2", 8)
    assert str(e.value) == ("--resume ck/global_step2: the checkpoint's global batch 8 cannot be kept on 3 "
                            "data-parallel ranks at --micro-batch 2 (8 is not a multiple of 6); resume on a world whose "
                            "data-parallel size divides 8, or pass --global-batch to train on with another batch")
    with pytest.raises(UserError, match=r"pass --micro-batch 2 \(grad-accum becomes 2\)"):
        keep_global_batch(RunConfig.model_validate({"batch": {"micro_batch": 3}}), 2, "ck", 8)


def test_resume_record_counts_the_steps_run_again(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}, {"step": 2, "eval_loss": 2.1}, {"step": 3, "loss": 1.8}]
    ) + '{"step": 4, "lo')  # the line the crash cut
    assert last_logged_step(metrics) == 3
    r = resumption(Path("ck/global_step2"), 2, 1, 2, 8, 4, metrics)
    assert (r.steps_recomputed, r.world_before, r.world_after) == (1, 2, 1)
    rec = r.record()
    assert rec["event"] == "resume" and rec["step"] == 2  # kept by a later resume's trim at step >= 2
    assert "world 2 -> 1 ranks, global batch 8 kept (grad-accum 4); 1 step(s) after that checkpoint recomputed" \
        in r.line()


def test_fault_specs():
    env = {faults.ENV: "kill:rank=1:step=5,hold-write:rank=0:step=4"}
    assert faults.planned(env) == [faults.Fault("kill", 1, 5), faults.Fault("hold-write", 0, 4)]
    assert faults.planned({**env, "TORCHELASTIC_RESTART_COUNT": "1"}) == []  # the restarted group runs clean
    assert faults.planned({}) == []
    with pytest.raises(ValueError, match="unknown fault"):
        faults.planned({faults.ENV: "explode:rank=0:step=1"})


def _dump(root: Path, rank: int, seq: int, in_collective: bool, step: int = 3) -> None:
    p = watchdog.dump_path(root, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"rank": rank, "step": step, "in_collective": in_collective,
                             "last_default_seq": seq}) + "\n")


def test_the_hang_line_names_the_rank_that_diverged(tmp_path):
    _dump(tmp_path, 0, 113, True)
    _dump(tmp_path, 1, 113, False)
    line = watchdog.diverged_line(watchdog.read_dumps(tmp_path), 2, tmp_path)
    assert line.startswith("zerotrain: hang: rank 1 (step 3) stopped outside any collective; ")
    _dump(tmp_path, 1, 90, True)  # in a collective, but an earlier one: it fell behind
    assert "rank 1 (step 3) fell behind: its last collective is #90, the others reached #113" in \
        watchdog.diverged_line(watchdog.read_dumps(tmp_path), 2, tmp_path)
    assert "rank 2 wrote no dump" in watchdog.diverged_line(watchdog.read_dumps(tmp_path), 3, tmp_path)


def test_write_dump_has_the_stack(tmp_path):
    path = watchdog.write_dump(tmp_path, 0, "test", 7, in_collective=False)
    head, *rest = path.read_text().splitlines()
    assert json.loads(head)["step"] == 7
    assert "python stacks:" in rest and any("test_resilience.py" in x for x in rest)


def test_host_copy_is_a_deep_snapshot():
    live = {"w": torch.ones(3), "opt": [{"m": torch.zeros(2)}, 5], "name": "x"}
    snap = host_copy(live)
    live["w"].add_(1)
    live["opt"][0]["m"].add_(1)
    assert snap["w"].tolist() == [1.0, 1.0, 1.0] and snap["opt"][0]["m"].tolist() == [0.0, 0.0]
    assert snap["opt"][1] == 5 and snap["name"] == "x"


def test_file_writer_writes_in_order_and_reports_a_failure(tmp_path):
    writer = FileWriter(rank=0)
    ticket = writer.begin(step=1)
    state = {"w": torch.arange(4.0)}
    writer.put(state, str(tmp_path / "a.pt"), torch.save)
    state["w"].zero_()  # training goes on: the queued copy is what gets written
    writer.end()
    ticket.wait()
    assert torch.load(tmp_path / "a.pt")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    bad = writer.begin(step=2)
    writer.put(state, str(tmp_path / "missing" / "b.pt"), torch.save)
    writer.end()
    done = threading.Event()
    threading.Thread(target=lambda: (bad._event.wait(), done.set()), daemon=True).start()
    assert done.wait(10)
    with pytest.raises(RuntimeError, match="asynchronous checkpoint write failed"):
        bad.wait()


def test_cuda_arch_suffixes_deepspeed_cannot_read_are_dropped_and_said():
    """An H100 image's TORCH_CUDA_ARCH_LIST='9.0a' broke DeepSpeed 0.19.8's FusedAdam build ("invalid literal for
    int() with base 10: '0a'", benchmarks/RESULTS.md GPU section): the engine rewrites it and says so."""
    from zerotrain.backends.deepspeed.engine import plain_cuda_arch_list

    env = {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a 10.0f+PTX"}
    line = plain_cuda_arch_list(env)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0+PTX"
    assert line.startswith("TORCH_CUDA_ARCH_LIST='8.0;9.0a 10.0f+PTX': DeepSpeed's op builds cannot read")
    assert plain_cuda_arch_list(env) is None and plain_cuda_arch_list({}) is None  # nothing left to change
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder  # and DeepSpeed's own parser takes the result

    class Probe(CUDAOpBuilder):
        NAME = "probe"

        def absolute_name(self):
            return "probe"

        def sources(self):
            return []

        def filter_ccs(self, ccs):
            return [cc.split(".") for cc in ccs]

    import os
    from unittest import mock

    probe = Probe(name="probe")
    probe.jit_mode = True
    with mock.patch.dict(os.environ, {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a"}):  # what failed on the H100
        with pytest.raises(ValueError, match="invalid literal for int"):
            probe.compute_capability_args()
    with mock.patch.dict(os.environ, env):
        probe.compute_capability_args()  # JIT mode: it writes the list torch's extension build reads
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"


def test_the_watchdog_gives_slow_steps_room(tmp_path, monkeypatch):
    """The limit is max(--hang-timeout, 5 x the slowest step so far): a model whose steps take minutes is not ended
    for being slow; pausing (a save) does not count as a step."""
    clock = [100.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])
    dog = watchdog.HangWatchdog(tmp_path, 0, 10.0)
    try:
        dog.arm(0)
        clock[0] += 1.0
        dog.arm(1)
        assert dog.limit_s == 10.0  # a 1 s step: --hang-timeout rules
        clock[0] += 4.0
        dog.arm(2)
        assert dog.limit_s == 20.0  # a 4 s step: 5 x 4
        with dog.paused():
            clock[0] += 100.0  # a long save: not a step
        clock[0] += 1.0
        dog.arm(3)
        assert dog.limit_s == 20.0
    finally:
        dog.close()
    assert not (tmp_path / "hang").exists()  # nothing was dumped: the backstop's empty file is gone
