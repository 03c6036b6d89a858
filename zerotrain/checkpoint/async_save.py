"""Asynchronous checkpoint saves (--async-save): training goes on while a checkpoint's files are written.

The commit protocol of zerotrain/checkpoint/store.py is unchanged: a checkpoint becomes `latest` only after
every rank's files are written. What changes is when: `Engine.save_checkpoint` returns once the state is
copied (to host memory) and handed to a writer; the trainer asks at every step boundary whether every rank's
writer finished and whether any failed (one all-reduce it already runs, zerotrain/distributed/preemption.py), and
then rank 0 commits it, or removes it when a rank's write failed (Engine.commit_pending_save).
At most one save is in flight: the next save, the end of the run and a preemption first wait for it
(`Engine.finish_pending_save`). A crash during a write leaves an incomplete tag that is never resumed from.

- DeepSpeed: `HostCopyCheckpointEngine` replaces the engine's `checkpoint_engine`. DeepSpeed calls its `save`
  for each file; it deep-copies the state to CPU memory (the training step that follows changes the live
  tensors in place) and queues the file for one writer thread. DeepSpeed's own async engines (FastPersist,
  Decoupled) need pinned memory and libaio, which CPU-only machines lack.
- FSDP2: torch.distributed.checkpoint's `async_save` (it stages the state to CPU, then writes in a thread whose
  collectives run on a dedicated gloo group, so they never interleave with training's).
"""
from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..distributed import faults
from . import store as ck


def host_copy(obj: Any) -> Any:
    """A deep copy of a state dict in CPU memory: tensors cloned (detached), containers rebuilt, the rest shared
    (ints, strings, configs: nothing training changes in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        copied = {k: host_copy(v) for k, v in obj.items()}
        return OrderedDict(copied) if isinstance(obj, OrderedDict) else copied  # module state dicts keep their type
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(host_copy(v) for v in obj)
    return obj


def write_error_text(error: BaseException, rank: int) -> Optional[str]:
    """This rank's environment fault in one line ("[Errno 28] No space left on device: 'PATH'") when `error` is or
    wraps an OSError: directly, as a cause, or as this rank's entry of torch.distributed.checkpoint's
    CheckpointException (which every rank raises when any rank's write failed: "" when this rank's did not);
    None for anything else (a bug: raised as it is)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):  # DCP's CheckpointException: {rank: (exception, traceback)}
        if rank not in failures:
            return "" if any(write_error_text(e, rank) is not None for e, _ in failures.values()) else None
        return write_error_text(failures[rank][0], rank)
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return str(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class Ticket:
    """One rank's part of one asynchronous save: done when every file it queued is written."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def failed(self) -> bool:
        """Done, and this rank's write raised (known without waiting)."""
        return self.done() and self.result() is not None

    def result(self) -> Optional[BaseException]:
        """What the finished write raised (None: written); call once done."""
        return self.error

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise RuntimeError(f"asynchronous checkpoint write failed: {self.error}") from self.error


class FutureTicket(Ticket):
    """A Ticket over a concurrent.futures.Future (DCP's async_save)."""

    def __init__(self, future: Any, hold: bool = False, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self._future = future
        self._hold = hold
        """A test holds this write (faults.py): never done, as if the writer were stuck mid-checkpoint."""
        self._error = error
        """What this rank's own write beside the future raised (rank 0's engine state): reported once it is done."""

    def done(self) -> bool:
        return not self._hold and self._future.done()

    def result(self) -> Optional[BaseException]:
        return self._future.exception() or self._error

    def wait(self) -> None:
        if self._hold:
            threading.Event().wait()
        try:
            self._future.result()
        except BaseException as e:  # noqa: BLE001 - re-raised with what failed
            raise RuntimeError(f"asynchronous checkpoint write failed: {e}") from e
        if self._error is not None:
            raise RuntimeError(f"asynchronous checkpoint write failed: {self._error}") from self._error


class FileWriter:
    """One background thread writing queued (state, path) items with torch.save, in order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._queue: "queue.Queue[tuple[Any, ...]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="zerotrain-ckpt-writer", daemon=True)
        self._thread.start()
        self._ticket: Optional[Ticket] = None
        self._step: Optional[int] = None

    def begin(self, step: int) -> Ticket:
        self._ticket, self._step = Ticket(), step
        return self._ticket

    def put(self, state: Any, path: str, save: Callable[[Any, str], None]) -> None:
        self._queue.put(("file", host_copy(state), path, save, self._step))

    def end(self) -> None:
        """Every file of the current save is queued: its ticket finishes after the last one."""
        self._queue.put(("end", self._ticket))
        self._ticket = None

    def _run(self) -> None:
        error: Optional[BaseException] = None
        written: dict[Optional[int], int] = {}
        while True:
            item = self._queue.get()
            if item[0] == "end":
                item[1].finish(error)
                error = None
                continue
            _, state, path, save, step = item
            if error is not None:
                continue
            try:
                save(state, path)
                written[step] = written.get(step, 0) + 1
                if step is not None and written[step] == 1 and faults.holds_write(self.rank, step):
                    threading.Event().wait()  # a test holds this write mid-checkpoint (faults.py)
            except BaseException as e:  # noqa: BLE001 - reported by the ticket's wait
                error = e


class WriteGuard:
    """How this rank's DeepSpeed checkpoint files are written (guarded_checkpoint_engine): now, with the first OSError
    kept instead of raised (DeepSpeed's save has collectives after each file: a rank that raised out of it would
    leave the others waiting in them), or queued to an asynchronous `writer` (--async-save)."""

    def __init__(self) -> None:
        self.writer: Optional[FileWriter] = None
        """--async-save: the thread that writes the files (set at the first asynchronous save)."""
        self.error: Optional[OSError] = None
        """The first OSError of the current synchronous save (begin() clears it)."""

    def begin(self) -> None:
        self.error = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), an OSError kept (the first one) instead of raised; nothing more is written after one."""
        if self.error is not None:
            return None
        try:
            return fn(*args)
        except OSError as e:
            self.error = e
            return None

    def raise_error(self) -> None:
        """After DeepSpeed's save returned on every rank: this rank's kept OSError, raised now."""
        if self.error is not None:
            raise self.error


def guarded_checkpoint_engine(inner: Any, guard: WriteGuard) -> Any:
    """DeepSpeed's checkpoint engine wrapped so its saves go through `guard` (loads go to `inner`)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class HostCopyCheckpointEngine(CheckpointEngine):
        def __init__(self) -> None:
            super().__init__()
            self.name = "zerotrain.HostCopyCheckpointEngine"

        def create(self, info: Any) -> None:
            inner.create(info)

        def save(self, state_dict: Any, path: str) -> None:
            if guard.writer is not None:
                guard.writer.put(state_dict, path, inner.save)
            else:
                guard.call(inner.save, state_dict, path)

        def load(self, path: str, map_location: Any = None) -> Any:
            return inner.load(path, map_location=map_location)

        def commit(self, info: Any) -> bool:
            return True  # zerotrain commits once every rank's files are written (backends/checkpointing.py _settle)

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            inner.makedirs(path, exist_ok=exist_ok)

    return HostCopyCheckpointEngine()


@dataclass
class PendingSave:
    """A checkpoint whose files are being written; it becomes `latest` at commit."""

    root: Path
    target: Path
    meta: ck.CheckpointMeta
    """The meta of the step it holds (taken at save time: training has moved on)."""
    ticket: Ticket
    started_s: float = field(default=0.0)
