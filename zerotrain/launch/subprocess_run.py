"""Run a command with a hard timeout that kills everything it started.

A launcher (torchrun, the deepspeed launcher, pdsh) starts ranks that start workers of their own;
killing only the launcher on a timeout would leave them running, holding ports, memory and the output
pipes. So the command runs in a session of its own and a timeout SIGKILLs that whole process group.
This is the one launcher with kill-on-timeout in the project: trials, the test launcher and the
benchmarks all go through `run_with_timeout`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

StrPath = Union[str, Path]


@dataclass
class Finished:
    """How a command ended and what it wrote."""

    returncode: int
    """Its exit code, negative for a signal: -9 when the timeout's kill ended it (test `timed_out`, not this)."""
    stdout: str
    """Its output: stdout, or stdout and stderr interleaved when merged or written to a log."""
    stderr: str
    """Its stderr when kept apart, else ''."""
    timed_out: bool
    """True when the timeout ran out and the whole group was killed."""
    seconds: float
    """Wall time from start to end (the watch included)."""


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (its session: every process it started)."""
    # Only while the leader is not reaped: until then its pid (= the group id) cannot be reused,
    # so this never signals a group some other program started.
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group ended meanwhile
            pass


def run_with_timeout(cmd: Sequence[StrPath], timeout: float, *, env: Optional[Mapping[str, str]] = None,
                     cwd: Optional[StrPath] = None, log: Optional[StrPath] = None, merge_stderr: bool = False,
                     watch: Optional[Callable[[subprocess.Popen], None]] = None) -> Finished:
    """Run `cmd` in a new session and wait for it at most `timeout` seconds, then kill its whole group.

    Output is captured in memory (stdout and stderr apart, or interleaved with `merge_stderr`), or,
    with `log`, written to that file as it comes (stdout and stderr interleaved; the file survives a
    hang) and read back into `stdout`. `watch(proc)`, if given, runs right after the start, before
    the wait, for work beside the running command (sample it, signal it); its time counts against
    the timeout, and if it raises, the group is killed and the error propagates. The timeout covers
    the output too: a descendant that keeps the pipes open past it is killed with the rest.
    """
    t0 = time.monotonic()
    with (open(log, "w") if log is not None else nullcontext()) as sink:
        pipe_err = sink is None and not merge_stderr
        proc = subprocess.Popen([str(c) for c in cmd], stdout=sink if sink is not None else subprocess.PIPE,
                                stderr=subprocess.PIPE if pipe_err else subprocess.STDOUT, text=True,
                                errors="replace", env=env, cwd=cwd, start_new_session=True)
        timed_out = False
        try:
            if watch is not None:
                watch(proc)
            out, err = proc.communicate(timeout=max(0.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            out, err = proc.communicate()  # the pipes close once the whole group is dead
        except BaseException:  # a failed watch, Ctrl-C: leave nothing running behind
            kill_group(proc)
            proc.wait()
            raise
    if log is not None:
        out = Path(log).read_text(errors="replace")
    return Finished(returncode=proc.returncode, stdout=out or "", stderr=err or "", timed_out=timed_out,
                    seconds=time.monotonic() - t0)
