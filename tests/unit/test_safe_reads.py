"""Checkpoint files are read safely by default (backends/checkpointing.py): a file whose unpickling would call
anything but the types a checkpoint holds is refused in one line naming the type, and nothing of it runs; with
--trust-checkpoint it is read as it is. The committed old checkpoints still read (and export) without trust, and a
rank state (tensors, RNG states, plain containers, zerotrain's own dataclasses) round-trips."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from zerotrain.backends.checkpointing import SAFE_TYPES, TRUST_FLAG, read_file, trusting, vet_files
from zerotrain.backends.generation import GenerationStats
from zerotrain.cli import main
from zerotrain.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TAGS = sorted(FIXTURES.glob("ckpt_*/*/checkpoints/global_step2"))
MARKER_CALL = f"{__name__}.make_marker"


def make_marker(path: str) -> str:
    """What a crafted checkpoint's unpickling would call: it leaves a file behind."""
    Path(path).write_text("ran")
    return "ran"


class Crafted:
    """A pickle payload: unpickling it calls make_marker(path)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return make_marker, (self.path,)


def crafted_file(path: Path, marker: Path) -> Path:
    torch.save({"module": {"w": torch.ones(2)}, "extra": Crafted(marker)}, path)
    return path


def test_a_crafted_file_is_refused_in_one_line_and_nothing_runs(tmp_path):
    marker = tmp_path / "marker"
    path = crafted_file(tmp_path / "model_states.pt", marker)
    for own_types in (False, True):  # a rank state's own types are zerotrain's dataclasses, never a function
        with pytest.raises(UserError) as e:
            read_file(path, own_types=own_types)
        line = str(e.value)
        assert "\n" not in line and MARKER_CALL in line and TRUST_FLAG in line and str(path) in line, line
    with pytest.raises(UserError, match=MARKER_CALL):
        vet_files(tmp_path)
    assert not marker.exists()
    with trusting(True):  # the user trusts it: read as it is (and so its code runs)
        assert read_file(path)["extra"] == "ran"
        vet_files(tmp_path)
    assert marker.read_text() == "ran"
    with pytest.raises(UserError, match=MARKER_CALL):  # trust ends with its context
        read_file(path)


def test_each_rank_vets_its_share_of_the_files_and_together_they_vet_all(tmp_path):
    """On a resume every rank vets every world-th file: of 2 ranks exactly one reads the crafted file and refuses it
    (the ranks agree on that refusal in checkpointing.load); one rank alone reads them all."""
    for i in range(3):
        torch.save({"w": torch.full((2,), float(i))}, tmp_path / f"shard_{i}.pt")
    crafted_file(tmp_path / "shard_1b.pt", tmp_path / "marker")
    refused = []
    for rank in range(2):
        try:
            vet_files(tmp_path, rank, 2)
        except UserError as e:
            refused.append((rank, MARKER_CALL in str(e)))
    assert refused == [(0, True)]  # sorted: shard_0, shard_1, shard_1b, shard_2: rank 0 reads the 1st and 3rd
    with pytest.raises(UserError, match=MARKER_CALL):
        vet_files(tmp_path)
    assert not (tmp_path / "marker").exists()


def test_a_crafted_dcp_metadata_is_refused_in_one_line(tmp_path):
    """torch.distributed.checkpoint reads its .metadata with pickle.load: vet_files reads it with its types only."""
    import pickle

    marker = tmp_path / "marker"
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Crafted(marker)}))
    with pytest.raises(UserError) as e:
        vet_files(tmp_path)
    assert "\n" not in str(e.value) and MARKER_CALL in str(e.value) and TRUST_FLAG in str(e.value), str(e.value)
    assert not marker.exists()


def test_a_rank_state_round_trips(tmp_path):
    stats = GenerationStats("phase", True, False, gathers=1, forward_widths=[3, 1])
    state = {"cycle": (0, 2), "dp": 2, "generation": stats, "dapo_tokens": torch.tensor(5.0),
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "none": None,
             "rows": [{"ids": torch.arange(4), "reward": 0.5}]}
    path = tmp_path / "rank0.pt"
    torch.save(state, path)
    loaded = read_file(path, own_types=True)
    assert loaded["generation"] == stats and loaded["cycle"] == (0, 2) and loaded["rng"]["python"] == random.getstate()
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"]) and torch.equal(loaded["rows"][0]["ids"],
                                                                                     torch.arange(4))
    with pytest.raises(UserError, match="zerotrain.backends.generation.GenerationStats"):  # only a rank state's
        read_file(path)


@pytest.mark.parametrize("tag", TAGS, ids=[f"{t.parents[2].name}-{t.parents[1].name}" for t in TAGS])
def test_the_committed_checkpoints_read_safely(tag):
    vet_files(tag)  # every .pt file, DeepSpeed's optimizer files included (SAFE_TYPES)


def test_every_safe_type_is_a_type_deepspeed_has():
    import importlib

    for name in SAFE_TYPES:
        module, _, attr = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), attr), type), name


@pytest.mark.parametrize("tag", TAGS, ids=[f"{t.parents[2].name}-{t.parents[1].name}" for t in TAGS])
def test_the_committed_checkpoints_export_without_trust(tag, tmp_path):
    from zerotrain.export.to_hf import export_checkpoint

    out = export_checkpoint(tag, tmp_path / "hf")
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))


def test_export_of_a_crafted_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    source = next(t for t in TAGS if "deepspeed_stage2" in str(t))
    ckpt = tmp_path / "global_step2"
    shutil.copytree(source, ckpt)
    marker = tmp_path / "marker"
    saved = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)
    saved["extra"] = Crafted(marker)
    torch.save(saved, ckpt / "mp_rank_00_model_states.pt")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and MARKER_CALL in err[0] and TRUST_FLAG in err[0], err
    assert not marker.exists() and not out.exists()


def test_trust_is_a_flag_of_train_and_export():
    from zerotrain.cli import build_parser
    from zerotrain.config.flags import config_from_args

    parser = build_parser()
    args = parser.parse_args(["train", "--resume", "--trust-checkpoint"])
    assert config_from_args(args).run.trust_checkpoint is True
    assert config_from_args(parser.parse_args(["train", "--resume"])).run.trust_checkpoint is False
    assert parser.parse_args(["export", "ckpt", "out", TRUST_FLAG]).trust_checkpoint is True
