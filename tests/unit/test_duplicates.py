"""No copied code: zerotrain/, tests/ and benchmarks/ hold no two places sharing 6 or more same or same-shape lines
(tests/support/duplicates.py says what counts), and the checker itself finds what it should."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.duplicates import duplicate_pairs

REPO = Path(__file__).resolve().parents[2]

BODY = '''\
def {name}(rows, limit):
    """Docstrings, comments and blank lines are passed over."""
    total = 0
    for row in rows:  # a comment
        if row.{field} > {number}:

            total += row.{field} * 2
    seen = {{"{text}": total}}
    return seen, limit
'''
"""Seven kept lines (the docstring, the comment and the blank line are passed over); the tests give the
second file another last line, so that the two share six (def ... seen), or five with `seen` dropped."""


@pytest.mark.parametrize("folder", ["zerotrain", "tests", "benchmarks"])
def test_no_duplicates(folder):
    pairs = duplicate_pairs(REPO / folder)
    assert pairs == [], "places sharing 6 or more same or same-shape lines (make one piece of code serve " \
                        "both):\n" + "\n".join(pairs)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def _body(name="total_of", field="size", number=3, text="sum", last="return seen, limit", drop=None):
    lines = BODY.format(name=name, field=field, number=number, text=text).splitlines()
    lines[-1] = "    " + last
    if drop is not None:
        del lines[drop]
    return "\n".join(lines) + "\n"


def test_finds_six_identical_lines(tmp_path):
    root = _tree(tmp_path, {"a.py": "import os\n\n\n" + _body(),
                            "b.py": "x = 1\n\n" + _body(last="print(seen)")})
    assert duplicate_pairs(root) == ["tree/a.py:4-11 ~ tree/b.py:3-10"]


def test_finds_six_same_shape_lines(tmp_path):
    renamed = _body(name="weight_of", field="mass", number=7.5, text="kg", last="print(seen)")
    root = _tree(tmp_path, {"a.py": _body(), "b.py": renamed})
    assert duplicate_pairs(root) == ["tree/a.py:1-8 ~ tree/b.py:1-8 (same shape)"]


@pytest.mark.parametrize("renamed", [False, True])
def test_five_shared_lines_are_not_a_pair(tmp_path, renamed):
    other = dict(name="weight_of", field="mass", number=7.5, text="kg") if renamed else {}
    root = _tree(tmp_path, {"a.py": _body(), "b.py": _body(last="print(seen)", drop=7, **other)})  # no `seen`
    assert duplicate_pairs(root) == []
