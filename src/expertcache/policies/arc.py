"""``arc``: ARC (Megiddo & Modha, FAST 2003), as libCacheSim's ``ARC``.

Residents sit in T1 (seen once recently) or T2 (seen at least twice); B1 and B2 remember the ids
recently evicted from each (ghosts, no data). ``p`` (a float in [0, C]) is T1's target size. A hit
in T1 moves the item to T2's head; a hit in T2 refreshes it. A miss on a B1 ghost grows ``p`` by
``max(|B2| / |B1|, 1)``, on a B2 ghost shrinks it by ``max(|B1| / |B2|, 1)`` (clamped), and the
item enters T2; any other miss enters T1. When the pool is full, REPLACE evicts T1's least recent
into B1 if ``|T1| > p`` (or ``|T1| == p`` and the miss was a B2 ghost) or T2 is empty, else T2's
least recent into B2 -- after trimming the ghosts as libCacheSim does: with no ghost hit and
``|T1| + |B1| == C``, B1's oldest ghost is dropped (T1's least recent is dropped without a ghost
when B1 is empty); otherwise, with ``|T1| + |T2| + |B1| + |B2| >= 2C``, B2's oldest ghost.

Token-grouped rule: "least recent" is the least recent item the current group does not request
(the other resident list's when a list holds only such items). With one request per step nothing
is protected: k = 1 counts equal libCacheSim's miss for miss (``tests/test_rule_conformance.py``).
"""

from __future__ import annotations

from . import driver
from .._jit import njit
from .hooked import HookedPolicy
from .registry import register

T1, T2, B1, B2 = 0, 1, 2, 3
CAP, GHOST, DEST = 12, 13, 14
"""int64 scalars after the four lists: capacity; the current miss's ghost list (-1 none); where
the chosen victim goes (B1, B2, or -1: dropped)."""


@njit(cache=True, inline="always")
def init(st, sc, fs, n_items, capacity):
    for q in range(4):
        driver.list_clear(sc, q)
    sc[CAP] = capacity
    sc[GHOST] = -1
    sc[DEST] = -1
    fs[0] = 0.0


@njit(cache=True, inline="always")
def hit(st, sc, fs, e, t):
    driver.unlink(st, sc, e)
    driver.push_head(st, sc, T2, e)


@njit(cache=True, inline="always")
def miss(st, sc, fs, e, t):
    q = st[driver.WHERE, e]
    sc[GHOST] = -1
    if q == B1:
        fs[0] = min(fs[0] + max(driver.length(sc, B2) / driver.length(sc, B1), 1.0), float(sc[CAP]))
        driver.unlink(st, sc, e)
        sc[GHOST] = B1
    elif q == B2:
        fs[0] = max(fs[0] - max(driver.length(sc, B1) / driver.length(sc, B2), 1.0), 0.0)
        driver.unlink(st, sc, e)
        sc[GHOST] = B2


@njit(cache=True, inline="always")
def _replace(st, sc, fs, stamp, g, in_b2):
    t1 = driver.length(sc, T1)
    first = T1 if (t1 > 0 and (t1 > fs[0] or (t1 == fs[0] and in_b2))) or driver.length(sc, T2) == 0 else T2
    v = driver.oldest_free(st, sc, first, stamp, g)
    if v < 0:
        first = T2 if first == T1 else T1
        v = driver.oldest_free(st, sc, first, stamp, g)
    sc[DEST] = B1 if first == T1 else B2
    return v


@njit(cache=True, inline="always")
def victim(st, sc, fs, e, t, stamp, g, res, size):
    C = sc[CAP]
    if sc[GHOST] >= 0:
        return _replace(st, sc, fs, stamp, g, sc[GHOST] == B2)
    if driver.length(sc, T1) + driver.length(sc, B1) + 1 > C:
        if driver.length(sc, B1) > 0:
            driver.unlink(st, sc, driver.tail(sc, B1))
            return _replace(st, sc, fs, stamp, g, False)
        v = driver.oldest_free(st, sc, T1, stamp, g)
        if v >= 0:
            sc[DEST] = -1
            return v
        return _replace(st, sc, fs, stamp, g, False)
    total = driver.length(sc, T1) + driver.length(sc, T2) + driver.length(sc, B1) + driver.length(sc, B2)
    if total >= 2 * C and driver.length(sc, B2) > 0:
        driver.unlink(st, sc, driver.tail(sc, B2))
    return _replace(st, sc, fs, stamp, g, False)


@njit(cache=True, inline="always")
def evict(st, sc, fs, v, t):
    driver.unlink(st, sc, v)
    if sc[DEST] >= 0:
        driver.push_head(st, sc, sc[DEST], v)


@njit(cache=True, inline="always")
def admit(st, sc, fs, e, t):
    driver.push_head(st, sc, T2 if sc[GHOST] >= 0 else T1, e)
    sc[GHOST] = -1


@njit(cache=True)
def loop(groups, starts, n_items, capacity, rows, sc0, fs0):
    return driver.run(groups, starts, n_items, capacity, rows, sc0, fs0, init, hit, miss, victim, evict, admit)


@register
class ARC(HookedPolicy):
    name = "arc"
    n_int = 15
    hooks = (init, hit, miss, victim, evict, admit)
    loop = staticmethod(loop)
