"""The one error type of `dspine gen-data` (its modules share it; `dspine gen-data` prints it as one
line and exits with status 2)."""

from __future__ import annotations


class GenDataError(RuntimeError):
    """A generation run cannot go on; the message names the cause and the fix."""
