"""The benchmark runs end to end in its quick form (tiny model, 1 round, 3 steps, zerotrain + DeepSpeed loop).

It checks only that it completes and writes its table: speed is never asserted here (see
benchmarks/RESULTS.md for measured figures).
"""
import json
import sys

import pytest

from tests.support.launch import REPO, rank_env, run


@pytest.mark.multirank
@pytest.mark.slow  # a measuring tool kept runnable: the whole matrix, not CI
def test_bench_quick_writes_table(tmp_path):
    out = tmp_path / "bench.md"
    res = run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--quick", "--out", str(out)],
              timeout=600, env=rank_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert "zerotrain tokens/s" in text and "ds_loop tokens/s" in text and "zerotrain / ds_loop" in text
    assert "rounds complete: 1 of 1," in text and "still running" not in text
    runs = json.loads((tmp_path / "bench.md.json").read_text())
    assert {r["runner"] for r in runs} == {"zerotrain", "ds_loop"} and all(r["ok"] for r in runs)
    assert all(r["state_bytes"] > 0 for r in runs)
    # The saved raw runs re-render to the same tables without running anything.
    again = tmp_path / "again.md"
    res = run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--from-json", str(tmp_path / "bench.md.json"),
               "--seq-len", "64", "--out", str(again)], timeout=120, env=rank_env())
    assert res.returncode == 0, res.stderr[-3000:]
    tables = lambda t: t.split("## Tokens/s", 1)[1].split("## Failed", 1)[0].strip()  # noqa: E731
    assert tables(again.read_text()) == tables(text)
