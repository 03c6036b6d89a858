"""User errors and the one-line form of any exception.

A `UserError` is a mistake in what the user asked for (a flag, a file, a checkpoint): the CLI prints
its message as one line and exits 2, on every rank. Every other exception is a bug (ours or a
library's) and keeps its traceback. UserError subclasses ValueError so callers that catch
ValueError keep working.
"""
from __future__ import annotations


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
