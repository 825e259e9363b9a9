"""Errors a user can cause, reported as one line saying what is wrong and where."""


class ExpertcacheError(Exception):
    """Base class for user-facing errors: the CLI prints ``str(err)`` and exits non-zero."""


class TraceError(ExpertcacheError, ValueError):
    """A trace file or array is malformed: the message names the file, the field and the first bad index."""


class PolicyError(ExpertcacheError, ValueError):
    """An unknown policy name or a bad policy parameter."""


class ConfigError(ExpertcacheError, ValueError):
    """A bad option value (capacity, layers, window, ...)."""


def raised_at(err: OSError) -> str:
    """Where a system call failed, for an error that names no file (``Cannot allocate memory`` alone
    says nothing of which call): `` (in module.py:LINE, function)``, the innermost frame; else ""."""
    import os
    import traceback

    if err.filename or err.__traceback__ is None:
        return ""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f" (in {os.path.basename(frame.filename)}:{frame.lineno}, {frame.name})"
