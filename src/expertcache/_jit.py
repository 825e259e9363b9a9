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

import functools
import hashlib
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
    _PKG = os.path.dirname(os.path.abspath(__file__))

    @functools.cache
    def dependency_stamp() -> str:
        """SHA-256 of every module of the package that compiles code (its source holds ``njit``).

        numba checks a cached loop only against its own file's stamp, but loops here inline hooks
        and helpers from other files (each rule file inlines :func:`expertcache.policies.driver.run`); a
        change to one of those would leave a stale compiled loop, and a silently wrong count. The
        package's cache locators add this stamp, so any change to any compiled module recompiles."""
        h = hashlib.sha256()
        for root, dirs, files in sorted(os.walk(_PKG)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(root, name), "rb") as fh:
                        src = fh.read()
                    if b"njit" in src:
                        h.update(name.encode() + b"\0" + src)
        return h.hexdigest()

    def _stamped(base):
        class Stamped(base):
            """numba's own locator of this kind, for the package's files, its source stamp widened
            by :func:`dependency_stamp`."""

            @classmethod
            def from_function(cls, py_func, py_file):
                if not os.path.abspath(py_file).startswith(_PKG + os.sep):
                    return None
                return super().from_function(py_func, py_file)

            def get_source_stamp(self):
                return (super().get_source_stamp(), dependency_stamp())

        Stamped.__name__ = f"Expertcache{base.__name__}"
        return Stamped

    try:  # numba's locator list is not public API: without it, caches are numba's own (per file)
        from numba.core import caching as _caching

        _caching.CacheImpl._locator_classes[:0] = [_stamped(_caching.InTreeCacheLocator),
                                                   _stamped(_caching.UserWideCacheLocator)]
    except (ImportError, AttributeError):  # pragma: no cover
        pass
else:
    def njit(*args, **options):
        """Stand-in for ``numba.njit``: returns the function unchanged, as ``@njit`` or ``@njit(...)``."""
        if len(args) == 1 and callable(args[0]) and not options:
            return args[0]

        def decorate(func):
            return func

        return decorate

__all__ = ["AVAILABLE", "ENV_VAR", "REASON", "njit"]
