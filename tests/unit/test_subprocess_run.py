"""zerotrain/launch/subprocess_run.py: real short commands through every path (finish, time out, log, watch)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerotrain.launch.subprocess_run import run_with_timeout

PY = sys.executable


def _gone(pid: int) -> bool:
    """True once no process (not even a zombie) has this pid."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return True
    return state == "Z"  # a killed process nobody has reaped yet is dead too


def _wait_gone(pid: int, within: float = 10.0) -> bool:
    # the grandchild's reparenting and reaping by init happen after the kill returns
    deadline = time.monotonic() + within
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def test_finished_command_gives_exit_code_and_both_streams():
    res = run_with_timeout([PY, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 30)
    assert (res.returncode, res.timed_out) == (3, False)
    assert res.stdout == "out\n" and res.stderr == "err\n"


def test_merge_stderr_and_env_and_cwd(tmp_path):
    code = "import os, sys; print(os.environ['ZT_PROBE']); print(os.getcwd(), file=sys.stderr)"
    res = run_with_timeout([PY, "-c", code], 30, env=dict(os.environ, ZT_PROBE="here"), cwd=tmp_path,
                           merge_stderr=True)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.split() == ["here", str(tmp_path)]


def test_timeout_kills_the_whole_group(tmp_path):
    """A shell that starts a `sleep` grandchild and waits: both die at the timeout. The sleep does not hold the
    output pipes, so only killing the group (not just the shell) ends it."""
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 60 >/dev/null 2>&1 & echo $! > {pidfile}; echo started; wait"
    t0 = time.monotonic()
    res = run_with_timeout(["bash", "-c", script], 1.5)
    assert time.monotonic() - t0 < 30
    assert res.timed_out and res.returncode == -9
    assert "started" in res.stdout  # what it wrote before the kill is kept
    assert _wait_gone(int(pidfile.read_text())), "the grandchild `sleep` survived the timeout"


def test_grandchild_holding_the_pipe_is_covered_by_the_timeout(tmp_path):
    """The command itself exits at once but leaves a `sleep` holding its stdout: the wait for the output is
    bounded by the timeout too, and that descendant is killed with the group."""
    pidfile = tmp_path / "grandchild.pid"
    res = run_with_timeout(["bash", "-c", f"sleep 60 & echo $! > {pidfile}; echo leader done"], 1.5)
    assert res.timed_out and "leader done" in res.stdout
    assert _wait_gone(int(pidfile.read_text()))


def test_log_file_gets_the_output_and_survives_a_timeout(tmp_path):
    log = tmp_path / "run.log"
    res = run_with_timeout(["bash", "-c", "echo to-out; echo to-err >&2"], 30, log=log)
    assert res.returncode == 0 and not res.timed_out
    assert sorted(log.read_text().split()) == ["to-err", "to-out"] and res.stdout == log.read_text()
    res = run_with_timeout(["bash", "-c", "echo before-hang; exec sleep 60"], 1.5, log=log)
    assert res.timed_out and log.read_text() == "before-hang\n" == res.stdout


def test_watch_runs_beside_the_command_and_a_failing_watch_kills_it(tmp_path):
    seen: list[int] = []
    res = run_with_timeout(["bash", "-c", "echo $$"], 30, watch=lambda proc: seen.append(proc.pid))
    assert res.returncode == 0 and seen == [int(res.stdout)]  # the watch got the running command

    pidfile = tmp_path / "child.pid"

    def fail(proc: subprocess.Popen) -> None:
        while not pidfile.is_file() or not pidfile.read_text().strip():
            time.sleep(0.02)
        raise RuntimeError("watch failed")

    with pytest.raises(RuntimeError, match="watch failed"):
        run_with_timeout(["bash", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 30, watch=fail)
    assert _wait_gone(int(pidfile.read_text()))
