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
(TORCHELASTIC_RESTART_COUNT 0), so the restarted worker group runs clean. The value is checked on every rank
before the process group starts (zerotrain/train/preflight.py: a malformed one is refused in one line, exit 2) and
an armed one is named in the train banner, so a value left exported in a shell cannot fire unannounced. The tests
that use them: tests/multirank/test_elastic.py, tests/multirank/test_os_errors.py.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

from ..errors import UserError

ENV = "ZEROTRAIN_FAULT"
KINDS = ("kill", "kill-node", "term", "hang", "hold-write")


@dataclass(frozen=True)
class Fault:
    kind: str
    """One of KINDS."""
    rank: int
    """The rank it fires on; -1: any rank whose environment names it."""
    step: int
    """The optimizer step after which it fires (hold-write: the checkpoint step whose write it blocks)."""


FORMAT = "KIND:rank=R|any:step=N[,KIND:...]"


def parse(spec: str) -> list[Fault]:
    """$ZEROTRAIN_FAULT's value -> its faults; a malformed value is one UserError line (preflight refuses it on
    every rank before the process group starts, so a typo never fires late or not at all)."""
    faults = []
    for item in spec.split(","):
        kind, *fields = item.strip().split(":")

        def bad(why: str) -> UserError:
            return UserError(f"${ENV}={spec!r}: {why}; expected {FORMAT} with KIND one of {', '.join(KINDS)}. "
                             f"It is a test hook that kills or hangs ranks: unset it (`unset {ENV}`) for a real run")

        if kind not in KINDS:
            raise bad(f"unknown fault {kind!r}")
        values = dict(f.split("=", 1) for f in fields if "=" in f)
        if len(values) != len(fields) or set(values) != {"rank", "step"}:
            raise bad(f"{item.strip()!r} must name rank= and step= (and nothing else)")
        if not (values["rank"] == "any" or values["rank"].isdigit()) or not values["step"].isdigit() \
                or int(values["step"]) < 1:
            raise bad(f"{item.strip()!r}: rank is a rank number or 'any', step a step number >= 1")
        faults.append(Fault(kind, -1 if values["rank"] == "any" else int(values["rank"]), int(values["step"])))
    return faults


def planned(environ: Optional[dict[str, str]] = None) -> list[Fault]:
    """The faults $ZEROTRAIN_FAULT asks for in this attempt (none on an elastic restart)."""
    environ = os.environ if environ is None else environ
    spec = environ.get(ENV, "").strip()
    if not spec or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return []
    return parse(spec)


_ACTIONS = {"kill": "SIGKILL {who} after step {step}", "kill-node": "SIGKILL {who} and its elastic agent after step "
            "{step}", "term": "SIGTERM {who} after step {step}", "hang": "hang {who} after step {step}",
            "hold-write": "block {who}'s asynchronous write of checkpoint {step}"}


def banner(environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """The train banner's warning when $ZEROTRAIN_FAULT is set (validated: a malformed value raises), else None."""
    environ = os.environ if environ is None else environ
    spec = environ.get(ENV, "").strip()
    if not spec:
        return None
    faults = parse(spec)
    what = "; ".join(_ACTIONS[f.kind].format(who="every rank" if f.rank == -1 else f"rank {f.rank}", step=f.step)
                     for f in faults)
    restart = " (not on this elastic restart: faults fire on the first attempt only)" if not planned(environ) else ""
    return (f"${ENV}={spec} is set: a test fault hook will {what}{restart}; unset it (`unset {ENV}`) unless this is a "
            "test")


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
