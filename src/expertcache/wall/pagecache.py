"""The page cache of named files: how much of each is resident (``mincore``, bounded memory), read
again and again by a wall's sampler (``cachestat``), and dropped (``posix_fadvise``).

Invariants (as :mod:`.accounting`'s): residency is measured over read-only mappings of at most
:data:`WINDOW` bytes at a time; a file whose residency the kernel would fake (Linux >= 5.0 reports
every page resident for a file the caller neither owns nor may write) is refused rather than
counted; nothing changes the machine except :func:`evict_file_pages`, which drops the clean
page-cache pages of the named files only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import stat
import time
from typing import Sequence

from ..errors import ConfigError

__all__ = ["residency", "FileCache", "evict_file_pages", "WINDOW", "PAGE"]

WINDOW = 256 << 20
"""Most bytes of one file mapped at once by :func:`residency` (the mincore vector is WINDOW/page)."""
PAGE = mmap.PAGESIZE


# ---------------------------------------------------------------------- residency
_libc = None
_ODD = bytes(range(1, 256, 2))


def _c():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    return _libc


def _file_residency(path: str) -> tuple[int, int]:
    if not stat.S_ISREG(os.stat(path).st_mode):  # before open: a FIFO would block it
        raise OSError(f"{path}: not a regular file")
    with open(path, "rb") as fh:
        fd = fh.fileno()
        st = os.fstat(fd)
        size = st.st_size
        if size == 0:
            return 0, 0
        if st.st_uid != os.geteuid() and not os.access(path, os.W_OK):
            raise PermissionError(f"{path}: mincore cannot report residency of a file this process neither owns "
                                  "nor may write (the kernel reports every page resident)")
        libc = _c()
        resident = 0
        for off in range(0, size, WINDOW):
            length = min(WINDOW, size - off)
            addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap for mincore failed: {os.strerror(err)}", path)
            try:
                pages = (length + PAGE - 1) // PAGE
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, length, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mincore failed: {os.strerror(err)}", path)
                flags = vec.raw
                count = len(flags) - len(flags.translate(None, _ODD))  # bit 0: page resident
                resident += count * PAGE
                if flags[-1] & 1 and length % PAGE:
                    resident -= PAGE - length % PAGE  # the last page is only partly file
            finally:
                libc.munmap(addr, length)
        return resident, size


def residency(paths: Sequence[str]) -> tuple[int, int]:
    """``(resident_bytes, total_bytes)`` of the files' page-cache pages, by mincore.

    Memory stays bounded (one mapping of at most :data:`WINDOW` bytes at a time); empty files count
    0 of 0. Raises OSError for a missing file and PermissionError for a file whose residency the
    kernel would fake (see the module docstring).
    """
    res = tot = 0
    for p in paths:
        r, t = _file_residency(os.fspath(p))
        res += r
        tot += t
    return res, tot


_CACHESTAT = 451
"""The ``cachestat`` system call (Linux 6.5+; the same number on x86-64 and the generic table)."""


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


class FileCache:
    """The page-cache bytes of a fixed set of files, read again and again (a wall's sampler):
    ``cachestat`` on descriptors held open (one system call per file, no mapping), else
    :func:`residency` by ``mincore``. ``method`` says which. Counts whole pages, as the cache holds
    them (a file's last partial page counts whole)."""

    def __init__(self, paths: Sequence[str]):
        self.paths = [os.fspath(p) for p in paths]
        self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        self.method = "cachestat"
        try:
            self._cachestat(self.fds[0]) if self.fds else None
        except OSError:
            self.method = "mincore"

    @staticmethod
    def _cachestat(fd: int) -> int:
        libc = _c()
        rng, out = _CachestatRange(0, 0), _Cachestat()
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return int(out.nr_cache) * PAGE

    def bytes(self) -> int:
        if self.method == "cachestat":
            return sum(self._cachestat(fd) for fd in self.fds)
        return residency(self.paths)[0]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def evict_file_pages(paths: Sequence[str]) -> dict:
    """Drop the files' clean page-cache pages (fsync, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on
    each) and measure residency afterwards as the proof. Pages mapped by a live process stay; the
    result says how many bytes remained (``resident_after_bytes``), ``cold`` is True when none did."""
    errors = []
    for p in paths:
        try:
            fd = os.open(os.fspath(p), os.O_RDONLY)
        except OSError as exc:
            errors.append(f"{p}: {exc.strerror or exc}")
            continue
        try:
            try:
                os.fsync(fd)
            except OSError:
                pass  # a read-only filesystem has nothing dirty to write
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            errors.append(f"{p}: {exc.strerror or exc}")
        finally:
            os.close(fd)
    out = {"files": len(paths), "method": "posix_fadvise(POSIX_FADV_DONTNEED)", "errors": errors[:10],
           "resident_after_bytes": None, "total_bytes": None, "cold": False, "note": None}
    try:
        out["resident_after_bytes"], out["total_bytes"] = residency(paths)
        out["cold"] = out["resident_after_bytes"] == 0 and not errors
    except OSError as exc:
        out["note"] = f"residency after eviction unknown: {exc.strerror or exc}"
    return out


EVICT_TRIES = 3
"""Evictions :func:`evict_for_wall` makes before it calls the pages that stay held."""


def evict_for_wall(paths: Sequence[str], what: str = "MODEL") -> dict:
    """:func:`evict_file_pages` before a walled run whose tier is the page cache of ``paths``, and a
    one-line :class:`~expertcache.errors.ConfigError` where pages stay: another process maps or
    locks them (a running server of the same file). The wall cannot move them, and they count in
    the tier it measures: a run beside such a holder had its limit pulled down until the worker died
    at start (ENOMEM, tracebacks), then a proof that failed. Pages a passing reader brings back are
    dropped again: it retries :data:`EVICT_TRIES` times, a tenth of a second apart."""
    for attempt in range(EVICT_TRIES):
        out = evict_file_pages(paths)
        held = out.get("resident_after_bytes")
        if not held:  # none stayed, or residency is unknown here (the proof then says so)
            return out
        if attempt + 1 < EVICT_TRIES:
            time.sleep(0.1)
    names = ", ".join(map(os.fspath, paths[:3])) + (", ..." if len(paths) > 3 else "")
    raise ConfigError(f"{what} {names}: {held:,} of its {out['total_bytes']:,} bytes stay in the page cache after "
                      "eviction: another process maps or locks them (a server or run of the same file?); the wall "
                      "counts them and cannot free them: stop that process, or run on a copy of the file")
