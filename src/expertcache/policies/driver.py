"""One compiled driver for cache rules written as hooks: libCacheSim's plugin protocol, token-grouped.

The driver owns everything that is not the rule: residency, the current group's protection, the
fill, and the counts. A rule owns its own state and is told what happens, through six compiled
hooks (each a module-level ``@njit`` function of the rule's own file, :mod:`expertcache.policies`):

``init(st, sc, fs, n_items, capacity)``
    a pool starting empty, at every stream start; ``sc``/``fs`` already hold the parameters;
``hit(st, sc, fs, e, t)``
    requested item ``e`` was resident;
``miss(st, sc, fs, e, t)``
    requested item ``e`` is not resident, before any eviction made for it;
``victim(st, sc, fs, e, t, stamp, g, res, size) -> v``
    the pool is full: the resident to evict so ``e`` can enter. It must not be requested by the
    current group (``stamp[v] == g``); ``res[:size]`` lists the residents in no particular order;
``evict(st, sc, fs, v, t)``
    ``v`` leaves the pool;
``admit(st, sc, fs, e, t)``
    ``e`` enters the pool.

State: ``st`` int64 ``[rows, n_items]`` (per item), ``sc`` int64 and ``fs`` float64 scalars (list
heads, sizes, parameters). ``t`` is the step within the stream (0 at its first group).

Order within a group (the one definition both drivers follow): the requested ids ascending, pads
dropped; first every hit, then every miss in turn (``miss``; ``victim`` and ``evict`` when the pool
is full; ``admit``). So a token's experts never evict each other, and counts do not depend on the
order of ids within a group. With one id per group (k = 1) this is exactly libCacheSim's
``get`` = find, else evict while full, then insert.

The same hooks run in two drivers: :func:`run` here (the compiled replay: each rule's file has a
three-line cached loop that inlines it) and :class:`expertcache.cache.ExpertCache` (the live
harness's cache step, calling the compiled hooks one by one). The driver checks every victim:
a rule that proposes a non-resident or protected item stops the replay with an error.
"""

from __future__ import annotations

import numpy as np

from .._jit import njit
from ..kernels import _sorted_group, pool_slots, swap_remove

# ------------------------------------------------------------------------------ linked lists
# Lists over item ids that rules share: list ``q`` has head sc[base + 3q], tail sc[base + 3q + 1],
# size sc[base + 3q + 2]; st[0] / st[1] are an item's prev / next (-1 ends), st[2] its list (-1: none).
# Head = most recently inserted, tail = oldest (libCacheSim's convention).
PREV, NEXT, WHERE = 0, 1, 2


@njit(cache=True, inline="always")
def list_clear(sc, q):
    sc[3 * q] = -1
    sc[3 * q + 1] = -1
    sc[3 * q + 2] = 0


@njit(cache=True, inline="always")
def push_head(st, sc, q, e):
    """Insert ``e`` at the head of list ``q``."""
    h = sc[3 * q]
    st[PREV, e] = -1
    st[NEXT, e] = h
    if h >= 0:
        st[PREV, h] = e
    else:
        sc[3 * q + 1] = e
    sc[3 * q] = e
    sc[3 * q + 2] += 1
    st[WHERE, e] = q


@njit(cache=True, inline="always")
def unlink(st, sc, e):
    """Take ``e`` out of its list."""
    q = st[WHERE, e]
    p, n = st[PREV, e], st[NEXT, e]
    if p >= 0:
        st[NEXT, p] = n
    else:
        sc[3 * q] = n
    if n >= 0:
        st[PREV, n] = p
    else:
        sc[3 * q + 1] = p
    sc[3 * q + 2] -= 1
    st[WHERE, e] = -1
    st[PREV, e] = -1
    st[NEXT, e] = -1


@njit(cache=True, inline="always")
def head(sc, q):
    return sc[3 * q]


@njit(cache=True, inline="always")
def tail(sc, q):
    return sc[3 * q + 1]


@njit(cache=True, inline="always")
def length(sc, q):
    return sc[3 * q + 2]


@njit(cache=True, inline="always")
def oldest_free(st, sc, q, stamp, g):
    """The oldest member of list ``q`` not requested by group ``g`` (-1 if none)."""
    v = sc[3 * q + 1]
    while v >= 0 and stamp[v] == g:
        v = st[PREV, v]
    return v


# ------------------------------------------------------------------------------ the driver
@njit(cache=True, inline="always")
def run(groups, starts, n_items, capacity, rows, sc0, fs0, init, hit, miss, victim, evict, admit):
    """Replay every stream of a layout (``groups [G, k]``, ``starts``) through one rule's hooks;
    return int32 misses and evictions per group (the compiled loops' contract, kernels.py)."""
    G, k = groups.shape
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    st = np.full((rows, n_items), -1, dtype=np.int64)
    sc = sc0.copy()
    fs = fs0.copy()
    rpos = np.full(n_items, -1, dtype=np.int64)
    stamp = np.full(n_items, -1, dtype=np.int64)
    res = np.empty(max(capacity, 1), dtype=np.int64)
    buf = np.empty(k, dtype=np.int64)
    for s in range(starts.size - 1):
        a = starts[s]
        st[:] = -1
        sc[:] = sc0
        fs[:] = fs0
        init(st, sc, fs, n_items, capacity)
        size = 0
        for g in range(a, starts[s + 1]):
            t = g - a
            n = _sorted_group(groups, g, buf, stamp)  # the group's ids, ascending, marked requested
            for i in range(n):
                if rpos[buf[i]] >= 0:
                    hit(st, sc, fs, buf[i], t)
            m = 0
            ev = 0
            for i in range(n):
                e = buf[i]
                if rpos[e] >= 0:
                    continue
                m += 1
                miss(st, sc, fs, e, t)
                if size == capacity:
                    v = victim(st, sc, fs, e, t, stamp, g, res, size)
                    if v < 0 or v >= n_items or rpos[v] < 0 or stamp[v] == g:
                        raise ValueError("a rule proposed a victim that is not resident or is requested by the current group")
                    evict(st, sc, fs, v, t)
                    size = swap_remove(res, rpos, size, v)
                    ev += 1
                res[size] = e
                rpos[e] = size
                size += 1
                admit(st, sc, fs, e, t)
            misses[g] = m
            evictions[g] = ev
        for i in range(size):
            rpos[res[i]] = -1
    return misses, evictions


class HookPlan:
    """A compiled plan (kernels.py's ``run(layout, capacity)``) for a hooked rule: its cached loop,
    its state rows and its parameter templates."""

    def __init__(self, loop, rows: int, sc0: np.ndarray, fs0: np.ndarray):
        self.loop, self.rows, self.sc0, self.fs0 = loop, int(rows), sc0, fs0

    def run(self, layout, capacity):
        return self.loop(layout.groups, layout.starts, layout.n_items, pool_slots(layout, capacity), self.rows,
                         self.sc0, self.fs0)
