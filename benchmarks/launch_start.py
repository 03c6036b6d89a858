"""What a test launch of two ranks costs before and after the tests' warm interpreters (tests/support/warm_start.py).

    python benchmarks/launch_start.py --rounds 3

Alternates, round by round, the same 2-step `zerotrain train` (the embedded demo, ZeRO-2, 2 CPU ranks):
- agent:  torchrun's elastic agent starting cold ranks (what every CLI test did before);
- direct-cold: the ranks started directly, cold (`ZEROTRAIN_TEST_COLD_START=1`);
- direct-warm: the ranks started directly from the warm interpreters (what the tests do now).
Wall seconds per launch into benchmarks/results/launch_start.json; the warm interpreters' own start is timed once.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "launch_start.json"))
    a = ap.parse_args()
    from tests.support import launch

    t0 = time.monotonic()
    for r in (0, 1):
        launch._warm(r)
    ready = all(launch._warm(r) is not None for r in (0, 1))
    warm_up = time.monotonic() - t0
    times: dict[str, list[float]] = {"agent": [], "direct-cold": [], "direct-warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for kind in times:
                args = ["-m", "zerotrain", "train", "--output", f"{tmp}/{kind}{i}", "--max-steps", "2", "--stage", "2"]
                os.environ["ZEROTRAIN_TEST_COLD_START"] = "1" if kind == "direct-cold" else "0"
                t = time.monotonic()
                if kind == "agent":
                    launch.torchrun(args, agent=True)
                elif kind == "direct-cold":
                    launch._workers(args, 2, 300, launch.rank_env(), True)
                else:
                    launch.torchrun(args)
                times[kind].append(round(time.monotonic() - t, 2))
                print(kind, i, times[kind][-1], flush=True)
    result = {"warm_interpreters_ready": ready, "warm_up_s": round(warm_up, 2), "launch_s": times,
              "median_s": {k: round(statistics.median(v), 2) for k, v in times.items()},
              "load_average": os.getloadavg()}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
