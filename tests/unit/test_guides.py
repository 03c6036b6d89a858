"""Every guide (README.md, docs/*.md) says which of its fenced blocks form a walk-through that runs as written, or
that it has none and why (tests/support/guides.py's markers); the walk-throughs themselves run in
tests/multirank/test_guides.py. No ranks: parsing only."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import guides

PENDING: dict[str, str] = {}
"""Guides whose markers another branch adds (issue 66): undeclared is allowed here until the lead merges them and
empties this set. A guide listed here that declares its walk-through fails (the entry is stale)."""

RUNS = {"README.md", "docs/quantization.md", "docs/rl.md", "docs/vision-language.md"}
"""The guides with a walk-through today: tests/multirank/test_guides.py parametrizes over guides.parse's result,
this pins it so that a guide that loses its markers fails here rather than silently leaving that test."""


@pytest.mark.parametrize("path", guides.guide_files(), ids=lambda p: str(p.relative_to(guides.REPO)))
def test_every_guide_declares_its_walkthrough(path: Path):
    rel = str(path.relative_to(guides.REPO))
    if rel in PENDING:
        with pytest.raises(guides.GuideError, match="no walk-through declared"):
            guides.parse(path)
        return
    walk = guides.parse(path)
    assert (rel in RUNS) == bool(walk.steps), f"{rel}: walk-through steps {len(walk.steps)}, RUNS says {rel in RUNS}"


def test_readme_quick_start_runs_in_the_test_environment():
    """The one rewrite: the quick start's venv + install prefix is dropped (the test's environment stands in for
    it); the launcher command after it is kept as written, and the test-suite block is not part of it."""
    walk = guides.parse(guides.REPO / "README.md")
    [step] = walk.steps
    assert step.text.startswith(".venv/bin/deepspeed --hostfile hostfile.example --no_ssh"), step.text
    assert "pip install" not in step.text and "pytest" not in step.text


def _guide(tmp_path: Path, text: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    p = tmp_path / "docs" / "g.md"
    p.write_text(text)
    return p


def test_markers_are_checked(tmp_path: Path):
    def err(text: str) -> str:
        with pytest.raises(guides.GuideError) as e:
            guides.parse(_guide(tmp_path, text), tmp_path)
        return str(e.value)

    assert "no walk-through declared" in err("# g\n```bash\nzerotrain train\n```\n")
    assert "needs a reason" in err("# g\n<!-- walkthrough: none -->\n")
    assert "```bash" in err("# g\n<!-- walkthrough: run -->\n```python\nprint()\n```\n")
    assert "next line" in err("# g\n<!-- walkthrough: run -->\n\n```bash\ntrue\n```\n")
    assert "unknown marker" in err("# g\n<!-- walkthrough: file -->\n```\nx\n```\n")
    assert "unknown marker" in err("# g\n<!-- walkthrough: runs -->\n```bash\ntrue\n```\n")
    assert "never closed" in err("# g\n<!-- walkthrough: run -->\n```bash\ntrue\n")
    assert "says `walkthrough: none`" in err(
        "# g\n<!-- walkthrough: none, nothing to run here at all -->\n<!-- walkthrough: run -->\n```bash\ntrue\n```\n")
    walk = guides.parse(_guide(tmp_path, "# g\n<!-- walkthrough: file data/p.jsonl -->\n```json\n{}\n```\n"
                                          "```bash\nexample\n```\n<!-- walkthrough: run -->\n```bash\n"
                                          "python3 -m venv .venv && .venv/bin/pip install -e . && zerotrain x\n```\n"),
                        tmp_path)
    assert [(s.kind, s.name, s.text) for s in walk.steps] == [("file", "data/p.jsonl", "{}\n"),
                                                              ("run", "", "zerotrain x\n")]
    assert walk.steps[1].where == "docs/g.md:11"  # the block's first line


def test_a_failing_block_fails_with_its_output(tmp_path: Path):
    walk = guides.parse(_guide(tmp_path, "# g\n<!-- walkthrough: file a.txt -->\n```\nhello\n```\n"
                                          "<!-- walkthrough: run -->\n```bash\ncat a.txt\nfalse\necho never\n```\n"),
                        tmp_path)
    work = guides.prepare_dir(tmp_path / "work", tmp_path)
    with pytest.raises(AssertionError) as e:
        guides.run(walk, work, timeout=30)
    assert "docs/g.md:8" in str(e.value) and "exit 1" in str(e.value) and "hello" in str(e.value)
    assert "never" not in str(e.value).split("--- output")[1]
    walk.steps[1].text = "sleep 30\n"
    with pytest.raises(AssertionError, match="timed out after 1 s"):
        guides.run(walk, work, timeout=1)
