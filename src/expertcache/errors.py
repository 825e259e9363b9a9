"""Errors a user can cause, reported as one line saying what is wrong and where."""


class ExpertcacheError(Exception):
    """Base class for user-facing errors: the CLI prints ``str(err)`` and exits non-zero."""


class TraceError(ExpertcacheError, ValueError):
    """A trace file or array is malformed: the message names the file, the field and the first bad index."""


class PolicyError(ExpertcacheError, ValueError):
    """An unknown policy name or a bad policy parameter."""


class ConfigError(ExpertcacheError, ValueError):
    """A bad option value (capacity, layers, window, ...)."""
