"""Hang watchdog: a rank that stops making progress, inside a collective or outside one, ends the job with a dump
that says where every rank was.

- Inside a collective: every collective is bounded by --dist-timeout (the process group's timeout). The rank
  that times out writes its dump (`write_dump`, called by `zerotrain train` on the failure path).
- Outside a collective (a rank stuck in its own code while the others wait for it): `HangWatchdog`, re-armed
  at every optimizer step, fires after --hang-timeout seconds without a step. Its thread writes the dump and
  ends the process (HANG_EXIT); `faulthandler.dump_traceback_later` is armed a little later as a backstop that
  needs no GIL (a rank stuck in C code holding it) and writes the stacks of every thread into the same file.

A dump is OUTPUT/hang/rank<R>.txt: why (watchdog or collective timeout), the step, the last collectives of
this rank from torch's flight recorder (name, sequence number, sizes; TORCH_FR_BUFFER_SIZE, set by
process_group.init), and the Python stack of every thread. `diverged_line` reads every rank's dump and names
the rank(s) that fell behind: the ones whose last collective has the lowest sequence number on the default
group, or, all equal, the ones the watchdog caught outside a collective.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

HANG_DIR = "hang"
HANG_EXIT = 3
"""Exit code of a rank the watchdog ended (no progress for --hang-timeout seconds) and of a rank whose collective
timed out (--dist-timeout) after it wrote its dump."""
SLOWEST_FACTOR = 5.0
"""A rank is stuck when no step finished for this many times its slowest step so far (or --hang-timeout, if more)."""
BACKSTOP_S = 15.0
"""faulthandler's own dump fires this long after the watchdog thread should have."""


def dump_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / HANG_DIR / f"rank{rank}.txt"


DEFAULT_GROUP = "default_pg"
"""The flight recorder's name of the world group: the training collectives every rank runs in the same order."""


def last_collectives(limit: int = 16) -> list[dict[str, Any]]:
    """This rank's newest flight-recorder entries (oldest first): process group, op name, sequence number,
    input sizes, state. Empty when the recorder is off or the build has none."""
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
        if dump is None:
            return []
        entries = json.loads(dump(True, True)).get("entries", [])
    except Exception:  # noqa: BLE001 - a dump must never fail because the recorder is missing
        return []
    out = []
    for e in entries[-limit:]:
        pg = e.get("process_group") or ["?", "?"]
        out.append({"group": pg[1] if len(pg) > 1 else pg[0], "op": e.get("profiling_name"),
                    "seq": e.get("collective_seq_id"), "sizes": e.get("input_sizes"), "state": e.get("state")})
    return out


def write_dump(out_dir: Path, rank: int, why: str, step: Optional[int], in_collective: bool) -> Optional[Path]:
    """Write this rank's dump (header as one JSON line, then the flight recorder, then every thread's stack).
    None when the write failed (a full disk): one warning line instead, and the hang is still reported."""
    path = dump_path(out_dir, rank)
    recent = last_collectives()
    on_default = [e for e in recent if e["group"] == DEFAULT_GROUP]
    head = {"rank": rank, "why": why, "step": step, "in_collective": in_collective, "time": round(time.time(), 3),
            "last_collective": recent[-1] if recent else None,
            "last_default_seq": on_default[-1]["seq"] if on_default else None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(json.dumps(head) + "\n")
            f.write("recent collectives (flight recorder, oldest first):\n")
            for entry in recent:
                f.write(f"  {json.dumps(entry)}\n")
            f.write("python stacks:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError as e:
        _warn_unwritable(e, rank, "writing the hang dump")
        return None
    return path


def _warn_unwritable(e: OSError, rank: int, what: str) -> None:
    from ..errors import os_error_line

    print(f"zerotrain: warning: {os_error_line(e, rank, what, kept='the hang is still reported on stderr')}",
          file=sys.stderr, flush=True)


def read_dumps(out_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> the header of its dump, for every dump under OUTPUT/hang/."""
    found = {}
    for p in sorted((Path(out_dir) / HANG_DIR).glob("rank*.txt")):
        try:
            head = json.loads(p.read_text().splitlines()[0])
        except (IndexError, json.JSONDecodeError, OSError):
            continue
        found[int(head["rank"])] = head
    return found


def wait_for_dumps(out_dir: Path, world: int, timeout_s: float) -> dict[int, dict[str, Any]]:
    """Rank 0 after its collective timed out: the others' dumps, as many as appear within timeout_s."""
    deadline = time.monotonic() + timeout_s
    found = read_dumps(out_dir)
    while len(found) < world and time.monotonic() < deadline:
        time.sleep(0.5)
        found = read_dumps(out_dir)
    return found


def diverged_line(dumps: dict[int, dict[str, Any]], world: int, out_dir: Path) -> str:
    """One line naming the rank(s) that diverged, from every rank's dump."""
    def seq(head: dict) -> int:
        return int(head.get("last_default_seq") or -1)

    missing = [r for r in range(world) if r not in dumps]
    seqs = {r: seq(h) for r, h in dumps.items()}
    if missing:
        culprits, how = missing, "wrote no dump (dead, or stuck where no Python runs)"
    elif len(set(seqs.values())) > 1:
        low = min(seqs.values())
        culprits = [r for r, s in seqs.items() if s == low]
        how = f"fell behind: its last collective is #{low}, the others reached #{max(seqs.values())}"
    else:
        culprits = [r for r, h in dumps.items() if not h.get("in_collective")] or sorted(dumps)
        how = "stopped outside any collective"
    where = ", ".join(f"rank {r}" + (f" (step {dumps[r].get('step')})" if r in dumps else "") for r in culprits)
    return f"zerotrain: hang: {where} {how}; every rank's stack and last collectives: {Path(out_dir) / HANG_DIR}/"


class HangWatchdog:
    """Ends this rank when no optimizer step finished for timeout_s (arm() at every step; disarm() around work
    that is bounded otherwise: saves, evaluation, export). timeout_s 0: off."""

    def __init__(self, out_dir: Path, rank: int, timeout_s: float):
        self.out_dir, self.rank, self.timeout_s = Path(out_dir), rank, timeout_s
        self.step: Optional[int] = None
        self.limit_s = timeout_s
        """The current limit: timeout_s, or more once a step took longer than timeout_s / SLOWEST_FACTOR."""
        self._armed_at: Optional[float] = None
        self._slowest = 0.0
        self._deadline: Optional[float] = None
        self._stop = threading.Event()
        self._backstop: Any = None
        self._backstop_deadline: Optional[float] = None
        """When the armed faulthandler backstop fires (time.monotonic()); None: not armed."""
        self._no_backstop = False
        """Opening the backstop's file failed (warned once): the watchdog thread alone ends a stuck rank."""
        self._thread: Optional[threading.Thread] = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="zerotrain-hang-watchdog", daemon=True)
            self._thread.start()

    def arm(self, step: int) -> None:
        """Start the clock for the work after optimizer step `step` (called when a step finished, and before the
        first). A step may take max(timeout_s, SLOWEST_FACTOR x the slowest step so far): a model whose steps
        take minutes is not ended for being slow."""
        if self._thread is None:
            return
        now = time.monotonic()
        if self._armed_at is not None and self.step is not None and step > self.step:
            self._slowest = max(self._slowest, (now - self._armed_at) / (step - self.step))
        self.step, self._armed_at = step, now
        self.limit_s = max(self.timeout_s, SLOWEST_FACTOR * self._slowest)
        self._deadline = now + self.limit_s
        if self._backstop is None and not self._no_backstop:
            path = dump_path(self.out_dir, self.rank).with_suffix(".stacks")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._backstop = open(path, "w")
            except OSError as e:  # the watchdog thread still ends a stuck rank; only the no-GIL backstop is off
                self._no_backstop = True
                _warn_unwritable(e, self.rank, "opening the watchdog's backstop file")
        # faulthandler's timer restarts its thread on every call (~0.2 ms a step, profiled): re-armed only when the
        # backstop armed last would fire less than 2/3 BACKSTOP_S after this deadline, or the limit grew
        if self._backstop is not None and (self._backstop_deadline is None
                                           or self._backstop_deadline < self._deadline + BACKSTOP_S * 2 / 3):
            faulthandler.dump_traceback_later(self.limit_s + BACKSTOP_S, exit=True, file=self._backstop)
            self._backstop_deadline = now + self.limit_s + BACKSTOP_S

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not timed inside (work bounded otherwise); armed again for the same step afterwards."""
        armed = self._deadline is not None
        self.disarm()
        try:
            yield
        finally:
            if armed and self.step is not None:
                self.arm(self.step)

    def disarm(self) -> None:
        self._deadline = None
        if self._backstop is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_deadline = None

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            deadline = self._deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            path = write_dump(self.out_dir, self.rank, f"watchdog: no optimizer step finished for {self.limit_s:.0f} s "
                              "(--hang-timeout)", self.step, in_collective=False)
            print(f"zerotrain: rank {self.rank}: no progress for {self.limit_s:.0f} s after step {self.step}; "
                  + (f"stack written to {path}" if path else "no stack written (see the warning above)")
                  + "; ending this rank", file=sys.stderr, flush=True)
            os._exit(HANG_EXIT)

    def close(self) -> None:
        """Stop watching; remove the backstop's file when nothing was written to it (a run without a hang)."""
        self.disarm()
        self._stop.set()
        if self._backstop is not None:
            path = Path(self._backstop.name)
            self._backstop.close()
            self._backstop = None
            if path.is_file() and path.stat().st_size == 0:
                path.unlink()
                try:
                    path.parent.rmdir()  # only when empty
                except OSError:
                    pass
