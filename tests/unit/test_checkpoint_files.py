"""checkpoint.verify_files: a checkpoint whose files changed after the save is refused in one line before
any backend load (whose collectives would otherwise leave the healthy ranks waiting)."""
from __future__ import annotations

import json

import pytest
import torch

from zerotrain.checkpoint import store as ck
from zerotrain.errors import UserError


def _meta() -> ck.CheckpointMeta:
    return ck.CheckpointMeta(backend="fsdp", format="dcp", zero_stage=3, world_size=2, dtype="float32",
                             model_class="M", model_config_hash="h", global_step=4)


@pytest.fixture
def committed(tmp_path):
    tag = tmp_path / "global_step4"
    (tag / "dcp").mkdir(parents=True)
    torch.save({"w": torch.arange(100.0)}, tag / "rank0.pt")
    torch.save({"w": torch.arange(100.0)}, tag / "rank1.pt")
    (tag / "dcp" / "__0_0.distcp").write_bytes(b"x" * 300)
    ck.commit(tmp_path, tag.name, _meta(), keep_last=2)
    return tag


def test_commit_records_every_file_and_a_clean_checkpoint_passes(committed):
    meta = ck.read_meta(committed)
    assert set(meta.files) == {"rank0.pt", "rank1.pt", "dcp/__0_0.distcp"}
    assert meta.files["dcp/__0_0.distcp"] == 300
    for rank in range(2):
        ck.verify_files(committed, meta, rank, 2)


@pytest.mark.parametrize("damage, needle", [
    (lambda t: (t / "dcp" / "__0_0.distcp").write_bytes(b"x" * 10), "dcp/__0_0.distcp has 10 bytes, the save wrote 300"),
    (lambda t: (t / "rank1.pt").unlink(), "rank1.pt is missing"),
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
    p = committed / "rank0.pt"
    p.write_bytes(p.read_bytes()[:200])
    meta = ck.read_meta(committed)
    assert meta.files == {}
    with pytest.raises(UserError, match="rank0.pt is not a readable torch file"):
        for rank in range(2):
            ck.verify_files(committed, meta, rank, 2)
