"""CI runs the representative cells of each test matrix (every backend, every family, every feature at least
once); the rest is marked `slow`. pyproject.toml's addopts deselect `slow`; `pytest -m "slow or not slow"`
runs the whole matrix (run it before closing an issue that touches what a matrix covers)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import pytest


def cells(values: Iterable[Any], slow: set[str], ids: Optional[Callable[[Any], str]] = None) -> list:
    """One pytest.param per value, with its id (the value itself, or ids(value)); an id in `slow` is marked
    slow. A name in `slow` that is no cell's id is an error (a renamed cell would otherwise run in CI)."""
    params, seen = [], set()
    for v in values:
        name = ids(v) if ids else str(v)
        seen.add(name)
        params.append(pytest.param(*(v if isinstance(v, tuple) else (v,)), id=name,
                                   marks=[pytest.mark.slow] if name in slow else []))
    unknown = slow - seen
    assert not unknown, f"slow names no cell: {sorted(unknown)}"
    return params
