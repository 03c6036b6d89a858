import os
from pathlib import Path

# Tests never touch a model hub: fail fast instead of retrying for ~48 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


def _pin_ninja() -> None:
    """Every process of the session (the ranks, HF Trainer's, a DeepSpeed op loaded in this one) builds DeepSpeed's
    ops with the environment's ninja, as a zerotrain rank does (zerotrain/backends/deepspeed/op_builds.py): with the
    machine's ninja beside it, each rebuilt the other's ops (~50 s per op: CI's README walk-through and the next
    DeepSpeed test, twice per run)."""
    try:
        from zerotrain.backends.deepspeed.op_builds import pin_ninja
    except ImportError:
        return
    pin_ninja()


_pin_ninja()


def pytest_sessionstart(session) -> None:
    """Clear torch-extension build locks that no process holds and that are older than any build:
    a run killed while loading a DeepSpeed op (a session stopped mid-test) leaves one, and zerotrain
    then refuses every DeepSpeed run on this machine (zerotrain/distributed/jit_locks.py), which is right for a
    user but would fail every DeepSpeed test here for a leftover of another run."""
    try:
        from zerotrain.distributed.jit_locks import stale_locks
    except ImportError:
        return
    for lock, age in stale_locks():
        print(f"conftest: removing stale torch extension build lock {lock} ({age / 60:.0f} min old, no holder)")
        lock.unlink(missing_ok=True)
    if not session.config.option.collectonly:
        from tests.support import op_prebuild

        _PREBUILD.append(op_prebuild.start())


_PREBUILD: list = []
"""The background build of DeepSpeed's CPU ops (tests/support/op_prebuild.py), while the unit tests run."""


def pytest_collection_modifyitems(session, config, items) -> None:
    """The unit tests first, those that launch processes (`multirank`) last among them, the order stable otherwise:
    the unit tests mostly keep one core busy and DeepSpeed's ops build on the other meanwhile
    (tests/support/op_prebuild.py), before the first test that loads one; a unit failure also shows minutes earlier."""
    def phase(item) -> int:
        if not item.nodeid.startswith("tests/unit/"):
            return 2
        return 1 if item.get_closest_marker("multirank") else 0

    items.sort(key=phase)


# Module-scoped fixtures of the engine tests (test_engine_contract.py): one work dir, tiny model and
# single-process reference run per test module.
@pytest.fixture(scope="module")
def work(tmp_path_factory, request) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))


@pytest.fixture(scope="module")
def model_dir(work) -> Path:
    import tests.support.reference as ref

    return ref.make_model_dir(work / "model")


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """The plain-PyTorch reference of the shared engine run (reference.engine_reference)."""
    import tests.support.reference as ref

    return ref.engine_reference(model_dir)


# --- skips: a skipped test is a failure unless the allow-list names its reason ----------------------
# The test extra installs everything the suite needs (deepspeed, torchao, mlflow, the MiniLM checkpoint)
# and .ci/run sets up the two-host cluster, so a skip means a feature went untested while CI stays green.
SKIP_ALLOWED: dict[str, str] = {
    "needs a GPU": "GPU-only checks on a CPU machine",
}
"""Substring of a skip reason -> why that skip is acceptable. Nothing else may skip."""
if os.environ.get("ZEROTRAIN_CI_SKIP_MULTIHOST") == "1":  # .ci/run's logged opt-out (no root on the runner)
    SKIP_ALLOWED.update({"needs root": "ZEROTRAIN_CI_SKIP_MULTIHOST=1", "multihost_setup": "ZEROTRAIN_CI_SKIP_MULTIHOST=1",
                         "'ip netns'": "ZEROTRAIN_CI_SKIP_MULTIHOST=1", "no ssh client": "ZEROTRAIN_CI_SKIP_MULTIHOST=1"})


def _unexpected_skip(report) -> str | None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    if any(allowed in reason for allowed in SKIP_ALLOWED):
        return None
    return reason


def _fail_unexpected_skip(report) -> None:
    reason = _unexpected_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (f"unexpected skip ({reason}): install what the test extra installs, or add the reason to "
                           "SKIP_ALLOWED in tests/conftest.py if the skip is right on this machine")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


_SKIPPED_MODULES: list[tuple[str, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module-level skip (pytest.importorskip at import) skips every test in the module: the run goes
    on and fails at the end (pytest_sessionfinish), naming the module."""
    outcome = yield
    report = outcome.get_result()
    reason = _unexpected_skip(report)
    if reason is not None:
        _SKIPPED_MODULES.append((report.nodeid, reason))


def pytest_terminal_summary(terminalreporter):
    from tests.support.launch import STARTS

    if STARTS:
        terminalreporter.write_line("rank and command starts: " + "; ".join(f"{k} {n}" for k, n in STARTS.most_common()))
    if _PREBUILD and _PREBUILD[0] is not None:
        from tests.support import op_prebuild

        terminalreporter.write_line(op_prebuild.outcome(_PREBUILD[0]))
    for nodeid, reason in _SKIPPED_MODULES:
        terminalreporter.write_line(f"FAILED (unexpected skip of the whole module) {nodeid}: {reason}", red=True)


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED_MODULES and exitstatus == 0:
        session.exitstatus = 1
