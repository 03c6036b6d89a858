"""User errors and the one-line form of any exception.

A `UserError` is a mistake in what the user asked for (a flag, a file, a checkpoint): the CLI prints
its message as one line and exits 2, on every rank. An OSError is the machine's fault (a full disk, a
read-only file system): `os_error_line` makes it one line too (rank, path, the OS's text, what was kept, the fix),
an `EnvironmentFault`, and never a traceback (zerotrain/cli.py). Every other exception is a bug (ours or a
library's) and keeps its traceback. UserError subclasses ValueError so callers that catch
ValueError keep working. `staged_dir` writes an output directory aside and renames it into place when complete,
so a failed write leaves no partial directory.
"""
from __future__ import annotations

import contextlib


class UserError(ValueError):
    """A user error: one line naming the setting (flag, config key, file) and the fix."""


class ConfigError(UserError):
    """A user error in the run config (zerotrain/config/rules.py holds the rules)."""


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message, else its type name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def print_user_error(command: str, e: UserError) -> None:
    """`zerotrain COMMAND: error: ...` on stderr in one write (under PYTHONUNBUFFERED print() writes text and
    newline apart, and ranks failing together would interleave their lines); marks the error printed."""
    import sys

    sys.stderr.write(f"zerotrain {command}: error: {e}\n")
    sys.stderr.flush()
    e.zerotrain_printed = True  # type: ignore[attr-defined]


class EnvironmentFault(UserError):
    """An OS error from the machine, not the code: a full disk, a read-only or vanished file system, a permission.
    Printed as one line (os_error_line: rank, path, the OS's text, what was kept, the fix) like a UserError, never
    as a traceback; a rank-0-only write raises it under distributed/agree.py so no other rank waits for it."""


_FIXES = dict(
    ENOSPC="free space on that file system (or write to another one)",
    EDQUOT="free space within your disk quota (or write to another file system)",
    EROFS="the file system is mounted read-only: write to a writable one",
    EACCES="make that directory writable for this user (or write elsewhere)",
    EPERM="make that directory writable for this user (or write elsewhere)",
    EIO="the disk or network file system reported an I/O error: check it (dmesg, the storage's health)",
    ENOENT="that path does not exist (removed by another process, or its disk is not mounted)",
)
"""The usual fix per errno name; any other errno: `check that file system`."""


def os_error_line(e: OSError, rank: int | None, what: str, kept: str = "", fix: str = "") -> str:
    """One line for an OS error: 'rank 0: writing final/ failed: /x/final/config.json: No space left on device
    (ENOSPC); kept: ...; fix: ...'. `kept` says what is still intact (the checkpoints, the source of an export),
    `fix` what to do afterwards (the default names the usual cure for the errno)."""
    import errno

    name = errno.errorcode.get(e.errno or 0, type(e).__name__)
    text = e.strerror or first_line(e)
    path = e.filename if e.filename is not None else ""
    where = f"{path}: " if path else ""
    if e.filename2 is not None:
        where = f"{path} -> {e.filename2}: "
    cure = _FIXES.get(name, "check that file system" if e.errno else "")
    head = f"rank {rank}: " if rank is not None else ""
    return (f"{head}{what} failed: {where}{text} ({name})" + (f"; kept: {kept}" if kept else "")
            + (f"; fix: {cure}" + (f", then {fix}" if fix else "") if cure else (f"; fix: {fix}" if fix else "")))


def staged_dir(final) -> contextlib.AbstractContextManager:
    """Write a directory aside, then rename it onto `final` only when complete:

        with staged_dir(out) as tmp:   # tmp = OUT_PARENT/.OUTNAME.partial-<pid>/OUTNAME, created empty
            write everything into tmp
        # complete: an existing `final` was replaced (kept until the new one is in place); failed: tmp removed,
        # `final` as it was

    The staging folder is a sibling of `final` (same file system: the rename is atomic) and keeps the last path
    component, so files inside have their usual names."""
    import os
    import shutil
    from pathlib import Path

    @contextlib.contextmanager
    def _staged():
        out = Path(final)
        stage = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(stage, ignore_errors=True)  # a previous attempt of this same pid
        inner = stage / out.name
        inner.mkdir(parents=True)
        try:
            yield inner
            old = stage / f".{out.name}.old"
            if out.exists():
                os.replace(out, old)  # a directory cannot be replaced onto a non-empty one: move the old aside
            try:
                os.replace(inner, out)
            except BaseException:
                if old.exists() and not out.exists():
                    os.replace(old, out)  # the previous one back: nothing lost
                raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    return _staged()
