"""The locked arena: the incumbent user-space tier (``arena`` and ``hybrid`` modes, docs/tier.md).

The arena is one anonymous ``mmap`` of at most the arena budget, locked with ``mlock(2)`` before
anything is copied into it, holding the top experts by request frequency in a profile window
(ties: lower layer index, then lower expert id). A request for a resident expert is served by
copying its bytes out of the arena (the worker streams any other request: O_DIRECT in ``arena``
mode, the page cache in ``hybrid``). The preload reads with O_DIRECT and leaves nothing in the page
cache.

Invariants: the arena holds floor(budget / expert_bytes) entries at most (never more bytes than
the budget); if ``mlock`` fails the run stops (:class:`MlockError`, one line) -- an arena that is
not locked is not the design being measured, so there is no silent fallback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

from ..errors import ExpertcacheError
from .pool import Pool

CAP_IPC_LOCK = 14


class MlockError(ExpertcacheError):
    """mlock of the arena failed: the run stops (fail-stop), the message says why in one line."""


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def top_experts(experts: np.ndarray, num_experts: int, count: int) -> list[tuple[int, int]]:
    """The ``count`` most requested (layer index, expert) pairs of ``experts[T, L, k]``;
    ties go to the lower layer index, then the lower expert id."""
    T, L, k = experts.shape
    counts = np.zeros(L * num_experts, dtype=np.int64)
    ids = experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * num_experts)[None, :, None]
    np.add.at(counts, ids[experts >= 0], 1)
    order = np.lexsort((np.arange(counts.size), -counts))  # by count desc, then flat index asc
    order = [int(i) for i in order[: max(0, count)] if counts[i] > 0]
    return [(i // num_experts, i % num_experts) for i in order]


class Arena:
    """Locked buffer holding ``chosen`` entries of ``pool``; see the module docstring."""

    def __init__(self, pool: Pool, budget_bytes: int, chosen: list[tuple[int, int]]):
        self.pool = pool
        size = pool.expert_bytes
        self.capacity_entries = int(budget_bytes // size) if size else 0
        chosen = chosen[: self.capacity_entries]
        self.slots: dict[tuple[int, int], int] = {key: i for i, key in enumerate(chosen)}
        self.bytes = len(chosen) * size
        self.locked_bytes = 0
        self.preload_bytes = 0
        self.preload_note: str | None = None
        self._buf = mmap.mmap(-1, max(self.bytes, mmap.PAGESIZE)) if self.bytes else None
        if self._buf is not None:
            self._lock()

    def _lock(self) -> None:
        libc = _libc()
        anchor = ctypes.c_char.from_buffer(self._buf)
        addr = ctypes.addressof(anchor)
        del anchor  # the mmap cannot close while a ctypes object exports it
        if os.environ.get("EXPERTCACHE_TIER_FAIL_MLOCK"):  # test hook: an injected failure, documented
            err, why = 12, "injected by EXPERTCACHE_TIER_FAIL_MLOCK"
        else:
            rc = libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(len(self._buf)))
            err = ctypes.get_errno() if rc != 0 else 0
            why = os.strerror(err) if err else ""
        if err:
            self._buf.close()
            self._buf = None
            raise MlockError(f"arena: mlock of {self.bytes} bytes failed ({why}); RLIMIT_MEMLOCK or CAP_IPC_LOCK "
                             "forbids it: the arena cannot be locked, so this run stops (fail-stop)")
        page = mmap.PAGESIZE
        self.locked_bytes = -(-len(self._buf) // page) * page  # mlock locks whole pages (docs/tier.md)

    def preload(self) -> int:
        """Copy every chosen entry into the arena; returns bytes copied (excluded from the measured
        interval). Entries are read with O_DIRECT through a page-aligned bounce buffer (nocache with
        drop-behind where the filesystem refuses O_DIRECT), so the preload puts nothing in the page
        cache: nothing transient is charged to the wall beside the arena it fills."""
        from .readers import FileReader, aligned_buffer
        size = self.pool.expert_bytes
        if self._buf is None:
            return 0
        reader = FileReader(self.pool, "direct")
        bounce = aligned_buffer(reader.buffer_bytes())
        try:
            with memoryview(self._buf) as view, memoryview(bounce) as src:
                for (li, e), slot in self.slots.items():
                    ent = self.pool.entry(li, e)
                    reader.read(ent, bounce)
                    view[slot * size: slot * size + ent.size] = src[: ent.size]
                    self.preload_bytes += ent.size
            reader.end_pass()
        finally:
            reader.close()
            bounce.close()
        self.preload_note = reader.fallback
        return self.preload_bytes

    def read(self, key: tuple[int, int], ent, buf) -> int:
        """Copy resident entry ``key`` into ``buf``; returns its size."""
        off = self.slots[key] * self.pool.expert_bytes
        with memoryview(self._buf) as src:
            memoryview(buf)[: ent.size] = src[off: off + ent.size]
        return ent.size

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None


def drop_ipc_lock() -> bool:
    """Remove CAP_IPC_LOCK from this process's effective capabilities (so RLIMIT_MEMLOCK binds even
    for root); returns whether it was done. Used to force a real mlock failure in tests."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = _libc()
    hdr = Header(0x20080522, 0)
    data = (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        return False
    data[0].effective &= ~(1 << CAP_IPC_LOCK)
    return libc.capset(ctypes.byref(hdr), data) == 0
