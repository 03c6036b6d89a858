"""One rank of the sp x tp DeepSpeed probe: the capability table given a DeepSpeed row for {"sp", "tp"} (the only
change; the engine is zerotrain's as committed), then tests/support/engine_worker.py as the parity tests run it."""
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from zerotrain.plan import capabilities as cap  # noqa: E402

cap.COMBINATIONS[frozenset({"sp", "tp"})] = {**cap.COMBINATIONS.get(frozenset({"sp", "tp"}), {}),
                                             "deepspeed": "AutoTP x Ulysses (probe)"}
sys.argv = [str(REPO / "tests/support/engine_worker.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
