"""Errors a user can cause, reported as one line saying what is wrong and where; and :func:`is_int`
and :func:`is_real`, the integer and real-number tests behind many of them, and :func:`max_threads`,
the bound of every thread count (the commands' options and the engines' arguments)."""

from __future__ import annotations

import math
import numbers
import os
import traceback


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
    if err.filename or err.__traceback__ is None:
        return ""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f" (in {os.path.basename(frame.filename)}:{frame.lineno}, {frame.name})"


def one_line(err: BaseException) -> str:
    """``str(err)`` on one line (white space folded; the type's name where it is empty), at most
    2,000 characters: what an error line says (the CLI's, a walled worker's)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 2000 else text[:1997] + "..."


def is_int(value, lo: int | None = None, hi: int | None = None) -> bool:
    """Whether ``value`` is an integer in ``[lo, hi]`` (an end left open where None): a Python or
    numpy integer, not a bool (``True`` is an int to Python) nor a float such as 2.0 or 2.5. The test
    behind every integer parameter and file field; each caller words its own error."""
    return bool(isinstance(value, numbers.Integral) and not isinstance(value, bool)
                and (lo is None or value >= lo) and (hi is None or value <= hi))


def is_real(value) -> bool:
    """Whether ``value`` is a finite real number: a Python or numpy integer or float, not a bool
    (``True`` is an int to Python), NaN or an infinity, nor an integer too large for a float (on one
    ``math.isfinite`` raises ``OverflowError``: a file's ``1`` followed by 400 zeros had ended
    ``grid`` as an internal error). The sibling of :func:`is_int` behind every real-valued parameter
    and file field; each caller checks its own range and words its own error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def max_threads() -> int:
    """Most threads a command or an engine may start: 4 per core of this machine (at least 8). More
    only slow compute, and 100,000 exhausted the machine's threads and crashed (SIGSEGV)."""
    return max(8, 4 * (os.cpu_count() or 1))
