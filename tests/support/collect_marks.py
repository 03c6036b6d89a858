"""A pytest plugin for tests/unit/test_ci_coverage.py: after collection, writes every collected node id with
whether it is `slow` to the JSON file $ZT_COLLECT_MARKS_OUT (run with `--collect-only -m "slow or not slow"
-p tests.support.collect_marks`)."""
from __future__ import annotations

import json
import os


def pytest_collection_finish(session) -> None:
    out = os.environ.get("ZT_COLLECT_MARKS_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({item.nodeid: item.get_closest_marker("slow") is not None for item in session.items}, f)
