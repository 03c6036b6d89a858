"""The benchmark runs end to end in its quick form (tiny model, 1 round, 3 steps, zerotrain + DeepSpeed loop).

It checks only that it completes and writes its table: speed is never asserted here (see
benchmarks/RESULTS.md for measured figures).
"""
import json
import sys

import pytest

from tests.support.launch import REPO, rank_env, run
from tests.support.matrix import cells


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


GPU_PLANS = {"ci": "zt3,size3",
             "full": "zt3,ds3,hf3,zt3-compile,zt3-nofused,zt2,zt1,zt0,zt3off,size3,size3off"}


@pytest.mark.multirank
@pytest.mark.parametrize("plan", cells(GPU_PLANS, slow={"full"}))
def test_gpu_suite_cpu_mode(tmp_path, plan):
    """`bash benchmarks/gpu_suite.sh --cpu`, the GPU suite's code path on a tiny Llama over gloo: every entry of its
    plan trains, the sizing runs confirm the estimate's pick, and RESULTS_GPU.md is rendered with the device and the
    MFU rule. CI runs zerotrain and one sizing ladder (--compile is in CI through test_compile.py, HF Trainer through
    test_hf_trainer.py); the whole plan (the GPU's, with the raw DeepSpeed loop, HF Trainer and --compile) is `slow`."""
    out = tmp_path / "out"
    res = run(["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), "--cpu", "300", "--work", str(tmp_path / "work"),
               "--plan", GPU_PLANS[plan]], timeout=420, env=rank_env(OUT=str(out), PY=sys.executable))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    state = json.loads((out / "gpu_results.json").read_text())
    assert state["cpu_mode"] and state["env"]["device"].startswith("CPU: ")
    runs = {r["name"]: r for r in state["runs"]}
    plan_names = state["plan"].split(",")
    assert set(runs) == {x for x in plan_names if not x.startswith("size")}
    for name, r in runs.items():
        assert r["ok"] and r["rc"] == 0 and r["fig"]["tokens_per_s"] > 0 and r["fig"]["peak_rss_gib"] > 0, (name, r)
        assert r["fig"]["mfu"] is None and r["fig"]["mfu_vs_measured_matmul"] > 0  # no datasheet peak for a CPU
    sizing = [x for x in plan_names if x.startswith("size")]
    assert state["sizing_result"] == {k: {"estimated": "tiny", "confirmed": "tiny"} for k in sizing}
    assert all(s["ok"] and s["fig"]["steps_recorded"] == 2 for s in state["sizing"]) and len(state["sizing"]) == len(sizing)
    md = (out / "RESULTS_GPU.md").read_text()
    assert md.startswith(f"# GPU suite: {state['env']['device']}") and "(6 x N + 12 x L x H x T)" in md
    assert all(f"| {name} |" in md for name in runs) and "confirmed by a run: tiny" in md
    assert ("| zt3 / ds3 |" in md) == ("ds3" in runs)  # the ratio row exactly when both ran
