"""A generated config actually trains: 2 CPU ranks (gloo), a raw DeepSpeed loop from each shipped JSON.

fp32 losses must agree across stages 0-3 and offload (ZeRO changes where state lives, not the math)."""
import json

import pytest
import torch

from tests.support.launch import REPO, torchrun

pytest.importorskip("deepspeed")

PRESETS = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


@pytest.mark.multirank
def test_generated_configs_train_with_equal_losses(tmp_path):
    out = tmp_path / "losses.json"
    paths = [str(REPO / "ds_configs" / f"{p}.json") for p in PRESETS]
    torchrun([REPO / "tests" / "support" / "ds_config_worker.py", out, *paths], timeout=600)
    losses = json.loads(out.read_text())
    ref = torch.tensor(losses[paths[0]])
    assert len(ref) == 3 and torch.isfinite(ref).all()
    for p in paths[1:]:
        torch.testing.assert_close(torch.tensor(losses[p]), ref, rtol=1e-5, atol=0, msg=lambda m: f"{p}: {m}")
    assert ref[-1] < ref[0]  # it learns
