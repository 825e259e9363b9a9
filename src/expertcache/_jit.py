"""The one place that imports numba: its ``njit``, or a pure-Python stand-in when numba is absent.

numba is a core dependency and the compiled loops are the normal path. This module only lets the
package import and run where numba cannot be installed (say a GPU box with numpy, torch and
transformers but no package registry), or where it is switched off on purpose with the
environment variable ``EXPERTCACHE_NO_NUMBA=1`` (read once, at import).

Invariant: with or without numba, every function decorated with :func:`njit` computes the same
results (the same counts, ids and floats); without numba it runs as plain Python on numpy arrays
and scalars, orders of magnitude slower. The few helpers that numba compiles from something other
than Python (``llvmlite`` intrinsics) have a pure-Python twin next to them, used when
:data:`AVAILABLE` is False; ``tests/test_jit_fallback.py`` checks that both paths agree.
"""

from __future__ import annotations

import os

ENV_VAR = "EXPERTCACHE_NO_NUMBA"
"""Set to ``1`` to run without numba even where it is installed."""

REASON: str | None = None
"""Why numba is not used (None when it is)."""

if os.environ.get(ENV_VAR, "").strip() == "1":
    REASON = f"{ENV_VAR}=1"
else:
    try:
        import numba as _numba
    except ImportError as err:  # not installed, or built for another numpy
        REASON = f"numba cannot be imported ({err})"

AVAILABLE: bool = REASON is None
"""True when :func:`njit` is numba's (functions are compiled); False: they run as plain Python."""

if AVAILABLE:
    njit = _numba.njit
else:
    def njit(*args, **options):
        """Stand-in for ``numba.njit``: returns the function unchanged, as ``@njit`` or ``@njit(...)``."""
        if len(args) == 1 and callable(args[0]) and not options:
            return args[0]

        def decorate(func):
            return func

        return decorate

__all__ = ["AVAILABLE", "ENV_VAR", "REASON", "njit"]
