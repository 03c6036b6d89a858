"""Shipped ds_configs/ are exactly what the generator makes, and DeepSpeed's parser accepts them all."""
import json
from pathlib import Path

import pytest

from tests.support.launch import REPO
from zerotrain.plan.presets import PRESETS, dumps, preset_files, preset_readme

SHIPPED = REPO / "ds_configs"


def test_no_drift():
    expected = preset_files()
    shipped = {str(p.relative_to(SHIPPED)): p.read_text() for p in SHIPPED.rglob("*.json")}
    assert set(shipped) == set(expected), "ds_configs/ files differ: run `zerotrain config --all ds_configs`"
    for rel, ds in expected.items():
        assert shipped[rel] == dumps(ds), f"ds_configs/{rel} drifted: run `zerotrain config --all ds_configs`"
    assert (SHIPPED / "README.md").read_text() == preset_readme(), "ds_configs/README.md drifted"


@pytest.mark.parametrize("rel", sorted(preset_files()))
def test_shipped_file_parses(rel):
    ds_cfg = pytest.importorskip("deepspeed.runtime.config")
    ds = json.loads((SHIPPED / rel).read_text())
    if rel.startswith("hf/"):
        assert "auto" in json.dumps(ds)
        return  # "auto" values are HF Trainer's to fill; test_hf_trainer.py feeds these to HF Trainer
    assert "auto" not in json.dumps(ds)
    parsed = ds_cfg.DeepSpeedConfig(ds)
    name = Path(rel).stem
    assert parsed.zero_optimization_stage == PRESETS[name]().zero.stage
    assert ("offload" in name) == (parsed.zero_config.offload_optimizer is not None)
