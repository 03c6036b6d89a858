import os
import sys
from pathlib import Path

# Tests never touch a model hub: fail fast instead of retrying for ~48 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402


def pytest_sessionstart(session) -> None:
    """Clear torch-extension build locks that no process holds and that are older than any build:
    a run killed while loading a DeepSpeed op (a session stopped mid-test) leaves one, and zerotrain
    then refuses every DeepSpeed run on this machine (zerotrain/jit_locks.py), which is right for a
    user but would fail every DeepSpeed test here for a leftover of another run."""
    try:
        from zerotrain.jit_locks import stale_locks
    except ImportError:
        return
    for lock, age in stale_locks():
        print(f"conftest: removing stale torch extension build lock {lock} ({age / 60:.0f} min old, no holder)")
        lock.unlink(missing_ok=True)


# Module-scoped fixtures of the engine tests (test_engine_contract.py): one work dir, tiny model and
# single-process reference run per test module.
@pytest.fixture(scope="module")
def work(tmp_path_factory, request) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))


@pytest.fixture(scope="module")
def model_dir(work) -> Path:
    import reference as ref

    return ref.make_model_dir(work / "model")


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """The plain-PyTorch reference of the shared engine run (reference.engine_reference)."""
    import reference as ref

    return ref.engine_reference(model_dir)
