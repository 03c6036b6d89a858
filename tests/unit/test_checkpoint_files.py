"""checkpoint.verify_files: a checkpoint whose files changed after the save, or that misses a file every rank must
have written (expected_files, per format and layout), is refused in one line before any backend load (whose
collectives would otherwise leave the healthy ranks waiting); a removed or failed tag never becomes a resume
target (remove_tag, prune, newest_complete)."""
from __future__ import annotations

import json

import pytest
import torch

from zerotrain.checkpoint import store as ck
from zerotrain.errors import UserError


def _meta() -> ck.CheckpointMeta:
    return ck.CheckpointMeta(backend="fsdp", format="dcp", zero_stage=3, world_size=2, dtype="float32",
                             model_class="M", model_config_hash="h", global_step=4)


def _dcp_tag(root, step: int = 4):
    """A 2-rank FSDP checkpoint's files as DCP and the engine write them (names seen in a real run)."""
    tag = root / f"global_step{step}"
    (tag / "dcp").mkdir(parents=True)
    torch.save({"w": torch.arange(100.0)}, tag / "engine_state.pt")
    torch.save({"w": torch.arange(100.0)}, tag / "extra.pt")
    (tag / "dcp" / ".metadata").write_bytes(b"m" * 50)
    (tag / "dcp" / "__0_0.distcp").write_bytes(b"x" * 300)
    (tag / "dcp" / "__1_0.distcp").write_bytes(b"x" * 300)
    return tag


@pytest.fixture
def committed(tmp_path):
    tag = _dcp_tag(tmp_path)
    ck.commit(tmp_path, tag.name, _meta(), keep_last=2)
    return tag


def test_commit_records_every_file_and_a_clean_checkpoint_passes(committed):
    meta = ck.read_meta(committed)
    assert set(meta.files) == {"engine_state.pt", "extra.pt", "dcp/.metadata", "dcp/__0_0.distcp",
                               "dcp/__1_0.distcp"}
    assert meta.files["dcp/__0_0.distcp"] == 300
    for rank in range(2):
        ck.verify_files(committed, meta, rank, 2)


@pytest.mark.parametrize("damage, needle", [
    (lambda t: (t / "dcp" / "__0_0.distcp").write_bytes(b"x" * 10), "dcp/__0_0.distcp has 10 bytes, the save wrote 300"),
    (lambda t: (t / "extra.pt").unlink(), "extra.pt is missing"),
])
def test_a_changed_file_is_named_by_exactly_one_rank(committed, damage, needle):
    damage(committed)
    meta = ck.read_meta(committed)
    failures = []
    for rank in range(2):
        try:
            ck.verify_files(committed, meta, rank, 2)
        except UserError as e:
            failures.append(str(e))
    assert len(failures) == 1 and needle in failures[0], failures
    assert "resume from an earlier one under" in failures[0]


def test_a_truncated_torch_file_without_a_recorded_size_is_refused(committed):
    """Checkpoints written before the manifest (no `files` in the meta) still get the zip check."""
    meta_path = committed / ck.META_FILE
    raw = json.loads(meta_path.read_text())
    del raw["files"]
    meta_path.write_text(json.dumps(raw))
    p = committed / "extra.pt"
    p.write_bytes(p.read_bytes()[:200])
    meta = ck.read_meta(committed)
    assert meta.files == {}
    with pytest.raises(UserError, match="extra.pt is not a readable torch file"):
        for rank in range(2):
            ck.verify_files(committed, meta, rank, 2)


def _ds_meta(fmt: str = "deepspeed", stage: int = 2, dtype: str = "fp32", world: int = 2, **extra) -> ck.CheckpointMeta:
    return ck.CheckpointMeta(backend="deepspeed", format=fmt, zero_stage=stage, world_size=world, dtype=dtype,
                             model_class="M", model_config_hash="h", global_step=4, extra=dict(extra))


@pytest.mark.parametrize("meta, names", [
    # each list is the backend files of a real 2-rank checkpoint dir (zerotrain train, DeepSpeed 0.19.8, torch 2.13)
    (_ds_meta(stage=2), ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    (_ds_meta(stage=3), ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                         "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    (_ds_meta(stage=2, dtype="bf16"), ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
    (_ds_meta(stage=0), ["mp_rank_00_model_states.pt"]),
    (_ds_meta("deepspeed-pipe", stage=1, pp=2, pipe_layers=[0, 1, 2, 3]),
     ["layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt", "layer_03-model_states.pt",
      "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "zero_pp_rank_0_mp_rank_01_optim_states.pt"]),
    (_ds_meta(stage=1, tp=2), ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                               "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                               "zero_pp_rank_0_mp_rank_01_optim_states.pt"]),
    (_meta(), ["engine_state.pt", "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"]),
], ids=["zero2", "zero3", "zero2-bf16", "zero0-fp32", "pipe", "tp2", "dcp"])
def test_expected_files_are_what_each_backend_writes(meta, names):
    assert sorted(ck.expected_files(meta)) == sorted(names)


def test_a_shard_never_written_is_missing_at_commit_and_named_at_resume(tmp_path):
    """Rank 1's optimizer file was never written (its disk was full) and no file list names it: the commit check
    finds it, and a checkpoint marked complete without it is refused before any load, naming the file."""
    meta = _ds_meta(stage=2)
    tag = tmp_path / "global_step4"
    tag.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"w": torch.zeros(3)}, tag / name)
    assert ck.missing_files(tag, meta) == ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    ck.commit(tmp_path, tag.name, meta, keep_last=2)  # as the old protocol did: commit without checking
    with pytest.raises(UserError, match=r"global_step4: zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"):
        for rank in range(2):
            ck.verify_files(tag, ck.read_meta(tag), rank, 2)


def test_a_removed_tag_never_wins_even_when_the_removal_crashed(tmp_path, monkeypatch):
    _dcp_tag(tmp_path, 2)
    ck.commit(tmp_path, "global_step2", _meta(), keep_last=2)
    failed = _dcp_tag(tmp_path, 4)
    ck.write_meta(failed, _meta())  # even a tag that looks complete: once its removal starts, it is no candidate
    monkeypatch.setattr(ck.shutil, "rmtree", lambda *a, **k: None)  # the process dies before deleting anything
    ck.remove_tag(failed)
    monkeypatch.undo()
    assert not failed.exists() and ck.newest_complete(tmp_path) == tmp_path / "global_step2"
    assert [d.name for d in ck.list_complete(tmp_path)] == ["global_step2"]
    _dcp_tag(tmp_path, 6)
    ck.commit(tmp_path, "global_step6", _meta(), keep_last=1)  # the leftover goes with the next prune
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step6", "latest"]


def test_keep_last_counts_only_complete_checkpoints(tmp_path):
    for step in (2, 6):
        _dcp_tag(tmp_path, step)
        ck.commit(tmp_path, f"global_step{step}", _meta(), keep_last=2)
        if step == 2:
            _dcp_tag(tmp_path, 4)  # a failed save at step 4, not (yet) removed
    assert [d.name for d in ck.list_complete(tmp_path)] == ["global_step2", "global_step6"]
    assert not (tmp_path / "global_step4").exists()  # incomplete and older than the newest: pruned
    assert ck.read_latest(tmp_path) == "global_step6"


def test_the_write_error_line_of_each_rank():
    """write_error_text: the OSError of this rank in one line, directly, as a cause, or as its entry of DCP's
    CheckpointException (every rank raises it; "" on a rank whose own write was fine); a bug is no such line."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from zerotrain.checkpoint.async_save import write_error_text

    full = OSError(errno.ENOSPC, "No space left on device", "/c/global_step4/dcp/__1_0.distcp")
    text = "[Errno 28] No space left on device: '/c/global_step4/dcp/__1_0.distcp'"
    dcp = CheckpointException("write failed", {1: (full, traceback.StackSummary())})
    assert write_error_text(full, 0) == text
    assert write_error_text(dcp, 1) == text and write_error_text(dcp, 0) == ""
    wrapped = RuntimeError("asynchronous checkpoint write failed")
    wrapped.__cause__ = full
    assert write_error_text(wrapped, 0) == text
    assert write_error_text(ValueError("a bug"), 0) is None
    bug = CheckpointException("write failed", {1: (ValueError("a bug"), traceback.StackSummary())})
    assert write_error_text(bug, 0) is None and write_error_text(bug, 1) is None
