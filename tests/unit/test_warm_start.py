"""The tests' warm interpreters (tests/support/warm_start.py) start processes that behave as cold ones."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.support import launch

PROBE = """
import json, os, random, sys, threading
import numpy as np
def late():
    print("non-daemon thread joined", flush=True)
t = threading.Thread(target=lambda: (__import__("time").sleep(0.2), late()))
t.start()
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("ZT_PROBE"),
                  "hash": hash("zerotrain"), "random": random.random(), "np": float(np.random.rand()),
                  "pid": os.getpid(), "sid": os.getsid(0), "main": __name__, "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
import atexit
atexit.register(lambda: print("atexit ran", flush=True))
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(autouse=True)
def fresh_servers(monkeypatch):
    """Servers started from this test's environment (earlier tests of a session may have changed an import-time
    variable since the session's servers started, and those then rightly start cold)."""
    monkeypatch.setattr(launch, "_WARM", {})
    yield
    for server in launch._WARM.values():
        server.close()


def _probe(tmp_path, rank: str, code: str, **env: str):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    res = launch.run([sys.executable, str(script), code, "x y"], timeout=60,
                     env=launch.rank_env(ZT_PROBE="here", RANK=rank, **env), cwd=tmp_path)
    first = json.loads(res.stdout.splitlines()[0])
    return res, first


def test_a_warm_child_is_a_process_of_its_own_that_ends_as_the_interpreter_does(tmp_path):
    res, a = _probe(tmp_path, "0", "3")
    assert res.returncode == 3 and "to stderr" in res.stderr
    assert res.stdout.splitlines()[1:] == ["non-daemon thread joined", "atexit ran"]  # the interpreter's order
    assert a["argv"] == ["3", "x y"] and a["cwd"] == str(tmp_path) and a["probe"] == "here" and a["main"] == "__main__"
    assert a["sid"] == a["pid"]  # its own session: a timeout kills its whole group
    assert a["torch"]  # it did start warm (torch preloaded)
    _, b = _probe(tmp_path, "0", "0")
    _, c = _probe(tmp_path, "1", "0")
    assert (a["random"], a["np"]) != (b["random"], b["np"])  # each child draws its own seeds, as a cold start
    assert a["hash"] == b["hash"] and a["hash"] != c["hash"]  # ranks 0 and 1 hash strings differently


def test_an_import_time_variable_starts_cold(tmp_path):
    res, a = _probe(tmp_path, "0", "0", HF_HUB_OFFLINE="0")
    assert res.returncode == 0 and not a["torch"]


def test_a_timeout_kills_the_warm_childs_whole_group(tmp_path):
    script = tmp_path / "hang.py"
    pidfile = tmp_path / "grandchild.pid"
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
                      "print('started', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    try:
        launch.run([sys.executable, str(script)], timeout=5, cwd=tmp_path)
    except AssertionError as e:
        assert "timed out after 5" in str(e) and "started" in str(e)
    else:
        raise AssertionError("no timeout")
    assert time.monotonic() - t0 < 40
    grandchild = int(pidfile.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
