"""All ranks agree on a failure: a step that can fail on one rank only ends every rank together.

Loading a checkpoint shard or rank 0 writing files can fail on one rank while the others would go
on into the next collective and wait there until the timeout (the ZeRO-3 hang). `agree` runs the
step, then one all-reduce tells every rank whether any failed.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, TypeVar

from ..errors import UserError, first_line
from .collectives import reduce_max

T = TypeVar("T")



class PeerFailed(UserError):
    """Another rank failed at the same point; its own error (line or traceback) says why."""


BAD_FILE_ERRORS = (OSError, EOFError, RuntimeError, pickle.UnpicklingError)
"""What reading a damaged or foreign file raises (torch.load of a truncated shard: RuntimeError or
UnpicklingError): under `agree` a user error about that file, named in one line."""


def agree(fn: Callable[[], T], what: str, bad_input: tuple[type[BaseException], ...] = ()) -> T:
    """Run fn on every rank; if it raised on any rank, raise on every rank (no rank left waiting).

    A UserError, and an exception of a `bad_input` type (wrapped as a one-line UserError naming
    `what`), are user errors; anything else is re-raised as it is, with its traceback. Ranks that
    did not fail raise PeerFailed."""
    err: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    (failed,) = reduce_max(0.0 if err is None else 1.0)
    if isinstance(err, bad_input) and not isinstance(err, UserError):
        raise mark_agreed(UserError(f"{what}: {type(err).__name__}: {first_line(err)}")) from err
    if err is not None:
        raise mark_agreed(err)
    if failed:
        raise mark_agreed(PeerFailed(f"{what}: another rank failed (its error is printed above); stopping this rank too"))
    return result


def mark_agreed(err: BaseException) -> BaseException:
    """Mark an error every rank raises together: the exit path lets all of them print it before any
    rank exits (a launcher kills the others as soon as one exits non-zero; see zerotrain/cli.py)."""
    err.zerotrain_agreed = True  # type: ignore[attr-defined]
    return err


def is_agreed(err: BaseException) -> bool:
    """Whether every rank raised this failure together (agree)."""
    return bool(getattr(err, "zerotrain_agreed", False))
