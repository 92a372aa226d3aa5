"""User-facing errors.

A `UserError` is a mistake the user can fix (bad path, bad flag, unsupported model). The CLI prints
its message as one line and exits non-zero, without a traceback; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import errno


class UserError(Exception):
    """An error caused by user input; printed as one line by the CLI (exit code `exit_code`)."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` reports a full disk: an OSError with ENOSPC or EDQUOT, or a library's own
    error carrying the OS's words (safetensors raises SafetensorError "... No space left on device
    (os error 28)", numpy an OSError "Not enough free space to write ..." without an errno)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return any(words in text for words in ("No space left on device", "(os error 28)", "Not enough free space",
                                           "Disk quota exceeded"))
