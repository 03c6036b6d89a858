"""Faults a test injects into a real run, named by $ZEROTRAIN_FAULT (never set in a user's run).

    ZEROTRAIN_FAULT="kill:rank=1:step=5"      SIGKILL rank 1 right after optimizer step 5
    ZEROTRAIN_FAULT="kill-node:rank=1:step=5" SIGKILL rank 1's elastic agent (its host is lost), then rank 1
    ZEROTRAIN_FAULT="kill-node:rank=any:step=5"  the same on every rank that has this environment (set it on one
                                                 host's agent only: that host is lost, whichever ranks it holds)
    ZEROTRAIN_FAULT="term:rank=0:step=4"      SIGTERM to rank 0 after step 4 (a scheduler's preemption)
    ZEROTRAIN_FAULT="hang:rank=1:step=3"      rank 1 sleeps after step 3, outside any collective
    ZEROTRAIN_FAULT="hold-write:rank=1:step=4"  rank 1's asynchronous writer of checkpoint 4 blocks before its
                                                 last file, so a test can kill the job mid-write

Several faults are joined with ','. A fault fires on the first attempt of an elastic job only
(TORCHELASTIC_RESTART_COUNT 0), so the restarted worker group runs clean. The tests that use them:
tests/multirank/test_elastic.py.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

ENV = "ZEROTRAIN_FAULT"
KINDS = ("kill", "kill-node", "term", "hang", "hold-write")


@dataclass(frozen=True)
class Fault:
    kind: str
    """One of KINDS."""
    rank: int
    """The rank it fires on; -1: any rank whose environment names it."""
    step: int


def planned(environ: Optional[dict[str, str]] = None) -> list[Fault]:
    """The faults $ZEROTRAIN_FAULT asks for in this attempt (none on an elastic restart)."""
    environ = os.environ if environ is None else environ
    spec = environ.get(ENV, "").strip()
    if not spec or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return []
    faults = []
    for item in spec.split(","):
        kind, *fields = item.strip().split(":")
        values = dict(f.split("=", 1) for f in fields)
        if kind not in KINDS:
            raise ValueError(f"${ENV}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
        rank = -1 if values["rank"] == "any" else int(values["rank"])
        faults.append(Fault(kind, rank, int(values["step"])))
    return faults


def after_step(rank: int, step: int) -> None:
    """Fire this rank's step fault, if one is planned at `step` (called after every optimizer step)."""
    for f in planned():
        if f.rank not in (rank, -1) or f.step != step:
            continue
        if f.kind == "kill-node":  # the agent first: it must not restart this worker
            os.kill(os.getppid(), signal.SIGKILL)
        if f.kind in ("kill", "kill-node"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif f.kind == "hang":
            while True:  # outside any collective: only the watchdog can see it
                time.sleep(1.0)


def holds_write(rank: int, step: int) -> bool:
    """Whether this rank's asynchronous write of checkpoint `step` is to block (hold-write)."""
    return any(f.kind == "hold-write" and f.rank in (rank, -1) and f.step == step for f in planned())
