"""User-facing errors.

`LmfoundryError` is the family the Python API raises (`lmfoundry.LmfoundryError`): a mistake the
user can fix (bad path, bad option, unsupported model), whose message is one line. The CLI prints
that line and exits non-zero, without a traceback; the library itself never exits (no
`SystemExit`), so a notebook or a CI script catches it like any exception. Anything else is a bug
and keeps its traceback.

`UserError` is the name the stages raise it under; it is a subclass, so every `raise UserError`
already belongs to the family and `except LmfoundryError` catches them all.
"""

from __future__ import annotations

import errno


class LmfoundryError(Exception):
    """An error the user can fix, said in one line; the CLI prints it and exits with `exit_code`."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UserError(LmfoundryError):
    """An error caused by user input (a bad path, flag, recipe or model): what the stages raise."""


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` reports a full disk: an OSError with ENOSPC or EDQUOT, or a library's own
    error carrying the OS's words (safetensors raises SafetensorError "... No space left on device
    (os error 28)", numpy an OSError "Not enough free space to write ..." without an errno)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return any(words in text for words in ("No space left on device", "(os error 28)", "Not enough free space",
                                           "Disk quota exceeded"))
