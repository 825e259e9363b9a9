"""The compiled loop of ``foresight:H`` (limited foresight), over :mod:`expertcache.kernels`' blocks.

A recency list of residents whose next request is beyond the horizon plus an indexed heap of the
visible ones, O(log C) per request; the semantics of :mod:`expertcache.kernels` (victims only
among residents the current group does not request, ascending ``(key, last use, item id)``).
"""

from __future__ import annotations

import numpy as np

from .._jit import njit
from ..kernels import NEVER, _append, _pop_victim, _push, _remove, _sorted_group, _unlink, heap_buffers, pool_slots

_NEVER = np.int64(NEVER)

_MAX_HORIZON = 1 << 40
"""Horizons beyond any stream's length see everything; larger ones are clamped (int64 safety)."""


@njit(cache=True)
def foresight_loop(groups, nuse, starts, n_items, capacity, horizon):
    """Farthest-future eviction that sees ``horizon`` steps ahead.

    Residents whose next request is more than ``horizon`` steps away (or never) are *beyond* and
    go first, least recently used first (a recency list, as in :func:`lru_loop`); the others are
    *visible* and go farthest next request first (a heap keyed ``(-next, last use, id)``). A beyond
    item turns visible at step ``next - horizon``: each such moment is queued as an event when the
    item is accessed, and stale events (item evicted or re-accessed since) are skipped.
    """
    G, k = groups.shape
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    next_req = np.full(n_items, _NEVER, dtype=np.int64)
    where = np.zeros(n_items, dtype=np.int8)  # 0 absent, 1 beyond, 2 visible, 3 just loaded
    prv = np.full(n_items, -1, dtype=np.int64)
    nxt = np.full(n_items, -1, dtype=np.int64)
    stamp = np.full(n_items, -1, dtype=np.int64)
    pos = np.full(n_items, -1, dtype=np.int64)
    hk, hl, hi, ak, al, ai = heap_buffers(capacity, k, np.empty(0, dtype=np.float64))
    ev_head = np.full(G + 1, -1, dtype=np.int64)  # events due at each (global) step
    ev_item = np.empty(G * k + 1, dtype=np.int64)
    ev_next = np.empty(G * k + 1, dtype=np.int64)
    buf = np.empty(k, dtype=np.int64)
    n_ev = 0
    for s in range(starts.size - 1):
        a, b = starts[s], starts[s + 1]
        head = -1
        tail = -1
        size = 0  # residents, both classes
        hsize = 0  # visible residents
        for g in range(a, b):
            t = g - a
            x = ev_head[g]  # beyond items whose next request comes into view now
            while x >= 0:
                e = ev_item[x]
                if where[e] == 1 and next_req[e] - horizon == g:
                    head, tail = _unlink(prv, nxt, e, head, tail)
                    where[e] = 2
                    hsize = _push(hk, hl, hi, pos, hsize, -float(next_req[e] - a), stamp[e] - a, e)
                x = ev_next[x]
            n = _sorted_group(groups, g, buf, stamp)
            m = 0
            ev = 0
            for i in range(n):  # misses: the least recent beyond resident goes, else the farthest visible
                e = buf[i]
                if where[e] != 0:
                    continue
                m += 1
                if size == capacity:
                    v = head
                    while v >= 0 and stamp[v] == g:
                        v = nxt[v]
                    if v >= 0:
                        head, tail = _unlink(prv, nxt, v, head, tail)
                    else:
                        v, hsize = _pop_victim(hk, hl, hi, pos, hsize, stamp, g, ak, al, ai)
                    where[v] = 0
                    size -= 1
                    ev += 1
                where[e] = 3
                size += 1
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    next_req[e] = nuse[g, j]
            for i in range(n):  # members take their class in ascending id order (ties: smallest id first)
                e = buf[i]
                if where[e] == 1:
                    head, tail = _unlink(prv, nxt, e, head, tail)
                elif where[e] == 2:
                    hsize = _remove(hk, hl, hi, pos, hsize, e)
                if next_req[e] - g <= horizon:
                    where[e] = 2
                    hsize = _push(hk, hl, hi, pos, hsize, -float(next_req[e] - a), t, e)
                else:
                    where[e] = 1
                    head, tail = _append(prv, nxt, e, head, tail)
                    if next_req[e] != _NEVER:
                        due = next_req[e] - horizon
                        ev_item[n_ev] = e
                        ev_next[n_ev] = ev_head[due]
                        ev_head[due] = n_ev
                        n_ev += 1
            misses[g] = m
            evictions[g] = ev
        v = head
        while v >= 0:
            where[v] = 0
            v = nxt[v]
        for r in range(hsize):
            where[hi[r]] = 0
    return misses, evictions


class ForesightPlan:
    """Run :func:`foresight_loop` with a horizon in steps."""

    def __init__(self, horizon_steps: int):
        self.horizon = int(horizon_steps)

    def run(self, layout, capacity):
        return foresight_loop(layout.groups, layout.next_use, layout.starts, layout.n_items, pool_slots(layout, capacity),
                              min(self.horizon, _MAX_HORIZON))
