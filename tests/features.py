"""Which CI cell proves which feature (issue 66): the table is tests/features.yaml (a data file: one entry per
feature), read here into FEATURES, PENDING and SLOW_ONLY.

A feature: a readable name, `ci` = the node ids of the cheapest cells collected under the default `-m 'not slow'`
(CI) that prove it, `slow` = the test functions whose other cells are the rest of its matrix. Adding a feature is
adding one entry to the YAML file, then `python -m tests.support.testing_doc` regenerates the table in
docs/testing.md. tests/unit/test_ci_coverage.py checks it against pytest's collection: every node id is collected,
every `ci` cell is not slow, every feature has one (PENDING aside), every slow test is some feature's `slow` (or
SLOW_ONLY's, with why), and docs/testing.md is the generated text.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import yaml

TABLE = Path(__file__).with_name("features.yaml")


class Feature(NamedTuple):
    name: str
    ci: tuple[str, ...]
    slow: tuple[str, ...]


_table = yaml.safe_load(TABLE.read_text())
FEATURES: list[Feature] = [Feature(f["name"], tuple(f.get("ci", ())), tuple(f.get("slow", ())))
                           for f in _table["features"]]
PENDING: set[str] = set(_table.get("pending") or ())
"""Known gaps: features whose only cells are slow today; an entry whose feature has a CI cell fails the check."""
SLOW_ONLY: dict[str, str] = dict(_table.get("slow_only") or {})
"""Slow test function -> why no feature needs it in CI (what CI proves instead)."""
