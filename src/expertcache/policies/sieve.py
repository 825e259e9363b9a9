"""``sieve``: SIEVE (Zhang et al., NSDI 2024), as libCacheSim's ``Sieve``.

One FIFO queue (new items at the head) and a visited bit per item. A hit sets the bit. To evict,
a hand walks from where it stopped (the tail at first) toward the head, clearing set bits, and
evicts the first item whose bit is clear; the hand then rests on the evicted item's newer
neighbour (past the head it starts again at the tail). Items of the current group are passed over
without touching their bit (the token-grouped rule; with one request per step nothing is ever
protected, so k = 1 counts equal libCacheSim's, ``tests/test_rule_conformance.py``).
"""

from __future__ import annotations

from . import driver
from .._jit import njit
from .hooked import HookedPolicy
from .registry import register

VISITED = 3
HAND = 3


@njit(cache=True, inline="always")
def init(st, sc, fs, n_items, capacity):
    driver.list_clear(sc, 0)
    sc[HAND] = -1


@njit(cache=True, inline="always")
def hit(st, sc, fs, e, t):
    st[VISITED, e] = 1


@njit(cache=True, inline="always")
def miss(st, sc, fs, e, t):
    pass


@njit(cache=True, inline="always")
def victim(st, sc, fs, e, t, stamp, g, res, size):
    v = sc[HAND] if sc[HAND] >= 0 else driver.tail(sc, 0)
    while stamp[v] == g or st[VISITED, v] > 0:
        if stamp[v] != g:
            st[VISITED, v] = 0
        v = st[driver.PREV, v]
        if v < 0:
            v = driver.tail(sc, 0)
    return v


@njit(cache=True, inline="always")
def evict(st, sc, fs, v, t):
    sc[HAND] = st[driver.PREV, v]
    driver.unlink(st, sc, v)
    st[VISITED, v] = 0


@njit(cache=True, inline="always")
def admit(st, sc, fs, e, t):
    driver.push_head(st, sc, 0, e)
    st[VISITED, e] = 0


@njit(cache=True)
def loop(groups, starts, n_items, capacity, rows, sc0, fs0):
    return driver.run(groups, starts, n_items, capacity, rows, sc0, fs0, init, hit, miss, victim, evict, admit)


@register
class Sieve(HookedPolicy):
    name = "sieve"
    rows = 4
    n_int = 4
    hooks = (init, hit, miss, victim, evict, admit)
    loop = staticmethod(loop)
