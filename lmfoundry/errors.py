"""User-facing errors.

A `UserError` is a mistake the user can fix (bad path, bad flag, unsupported model). The CLI prints
its message as one line and exits non-zero, without a traceback; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """An error caused by user input; printed as one line by the CLI (exit code `exit_code`)."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
