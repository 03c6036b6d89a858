"""The guides' walk-throughs run as written (issue 66): each guide's blocks marked `<!-- walkthrough: run -->` (and
the files marked `<!-- walkthrough: file NAME -->`) run in order in a fresh directory, offline, on the embedded and
tiny models the guides use (tests/support/guides.py: what runs, and the one rewrite, the quick start's venv and
install prefix). Nothing else is rewritten: `torchrun --nproc_per_node 2` and the deepspeed launcher with
hostfile.example run as the guides say, on 2 CPU ranks over gloo. Every collective has zerotrain's own timeout
(`--dist-timeout`, 300 s by default) and every block a hard one that kills what it started; a failing block fails
the test with its output.

CI runs README.md's quick start (the cheapest: one 2-rank launch of the embedded demo); the other guides are
`slow`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import guides

pytestmark = pytest.mark.multirank

CI = "README.md"


def _walks() -> list[guides.Walkthrough]:
    """Every guide with run steps (guides still PENDING their markers in tests/unit/test_guides.py are skipped
    here: that test holds them to it)."""
    found = []
    for path in guides.guide_files():
        try:
            walk = guides.parse(path)
        except guides.GuideError:
            continue
        if walk.steps:
            found.append(walk)
    return found


@pytest.mark.timeout(1800)  # a slow guide's blocks run 900 s at most each (the quantization guide: a few minutes)
@pytest.mark.parametrize("walk", [pytest.param(w, id=w.guide, marks=() if w.guide == CI else pytest.mark.slow)
                                  for w in _walks()])
def test_guide_walkthrough_runs_as_written(walk: guides.Walkthrough, tmp_path: Path):
    work = guides.prepare_dir(tmp_path / "walk")
    guides.run(walk, work, timeout=900)
    if walk.guide == "README.md":
        # what README says the demo writes under runs/demo/, and a loss that fell
        demo = work / "runs" / "demo"
        for name in ("run_config.yaml", "ds_config.json", "metrics.jsonl", "checkpoints", "final"):
            assert (demo / name).exists(), f"README's demo wrote no runs/demo/{name}"
        losses = [r["loss"] for r in map(json.loads, (demo / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        assert losses and losses[-1] < losses[0], losses
