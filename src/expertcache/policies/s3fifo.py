"""``s3fifo``: S3-FIFO (Yang et al., SOSP 2023), as libCacheSim's ``S3FIFO`` where that is sane.

Three FIFO queues: a small one S of ``s = max(1, floor(0.1 C))`` slots for new items, a main one
M (``C - s``), and a ghost queue of ``floor(0.9 C)`` ids recently evicted from S. Each resident
has a 2-bit use counter, bumped on a hit. A miss on a ghost enters M; before the first eviction a
miss enters M once S is full; any other miss enters S. When the pool is full it evicts from M if
``|M| > C - s`` or S is empty, else from S:

* from S: the oldest item moves to M's head (counter 0) if it was used at least twice, else it
  is evicted into the ghost queue; repeated until one is evicted or S is empty;
* from M: the oldest item goes back to M's head with its counter decremented if it was used,
  else it is evicted (no ghost).

libCacheSim's own version (0.3.5) differs only at small caches, where it misbehaves: below
C = 10 its small queue is 0 objects and it aborts; from 10 to 19 it is 1 object, and an object as
large as the small queue is never inserted, so (with unit objects) no miss is ever inserted and
every request misses -- a 4-object loop misses all its requests at C = 10-19. Here ``s`` is at
least 1 and unit items always fit; from C = 20 on, counts equal libCacheSim's miss for miss
(``tests/test_rule_conformance.py``).

Token-grouped rule: "the oldest" is the oldest item the current group does not request; a queue
holding only such items hands over to the other queue. With one request per step nothing is
protected.
"""

from __future__ import annotations

import numpy as np

from . import driver
from .._jit import njit
from .hooked import HookedPolicy
from .registry import register

SMALL, MAIN, GHOSTQ = 0, 1, 2
FREQ = 3
S_SIZE, M_SIZE, G_SIZE, EVICTED, FROM_GHOST, THRESHOLD, DEST = 9, 10, 11, 12, 13, 14, 15


@njit(cache=True, inline="always")
def init(st, sc, fs, n_items, capacity):
    for q in range(3):
        driver.list_clear(sc, q)
    s = max(1, int(capacity * fs[0]))
    sc[S_SIZE] = s
    sc[M_SIZE] = capacity - s
    sc[G_SIZE] = int(capacity * fs[1])
    sc[EVICTED] = 0
    sc[FROM_GHOST] = 0
    sc[DEST] = -1


@njit(cache=True, inline="always")
def hit(st, sc, fs, e, t):
    if st[FREQ, e] < 3:
        st[FREQ, e] += 1


@njit(cache=True, inline="always")
def miss(st, sc, fs, e, t):
    sc[FROM_GHOST] = 0
    if st[driver.WHERE, e] == GHOSTQ:
        driver.unlink(st, sc, e)
        sc[FROM_GHOST] = 1


@njit(cache=True, inline="always")
def _take(st, sc, stamp, g, q):
    """An item of queue ``q`` (S or M) to evict, -1 if ``q`` has none left: its oldest item the group
    does not request, once the used ones met on the way went to M's head (from S: used at least
    THRESHOLD times, counter reset; in M: used at all, counter decremented). An S item goes to the
    ghosts (``DEST``), an M item nowhere."""
    used = sc[THRESHOLD] if q == SMALL else 1
    while True:
        v = driver.oldest_free(st, sc, q, stamp, g)
        if v < 0:
            return -1
        if st[FREQ, v] < used:
            sc[DEST] = GHOSTQ if q == SMALL else -1
            return v
        driver.unlink(st, sc, v)
        driver.push_head(st, sc, MAIN, v)
        st[FREQ, v] = 0 if q == SMALL else st[FREQ, v] - 1


@njit(cache=True, inline="always")
def victim(st, sc, fs, e, t, stamp, g, res, size):
    sc[EVICTED] = 1
    while True:
        main_first = driver.length(sc, MAIN) > sc[M_SIZE] or driver.length(sc, SMALL) == 0
        v = _take(st, sc, stamp, g, MAIN if main_first else SMALL)
        if v >= 0:
            return v
        if main_first or driver.length(sc, SMALL) > 0:  # (S holding only the group's items: M gives one)
            v = _take(st, sc, stamp, g, SMALL if main_first else MAIN)
            if v >= 0:
                return v


@njit(cache=True, inline="always")
def evict(st, sc, fs, v, t):
    driver.unlink(st, sc, v)
    st[FREQ, v] = 0
    if sc[DEST] == GHOSTQ and sc[G_SIZE] > 0:
        if driver.length(sc, GHOSTQ) >= sc[G_SIZE]:
            driver.unlink(st, sc, driver.tail(sc, GHOSTQ))
        driver.push_head(st, sc, GHOSTQ, v)


@njit(cache=True, inline="always")
def admit(st, sc, fs, e, t):
    if sc[FROM_GHOST] == 1 or (sc[EVICTED] == 0 and driver.length(sc, SMALL) >= sc[S_SIZE]):
        driver.push_head(st, sc, MAIN, e)
    else:
        driver.push_head(st, sc, SMALL, e)
    st[FREQ, e] = 0
    sc[FROM_GHOST] = 0


@njit(cache=True)
def loop(groups, starts, n_items, capacity, rows, sc0, fs0):
    return driver.run(groups, starts, n_items, capacity, rows, sc0, fs0, init, hit, miss, victim, evict, admit)


@register
class S3FIFO(HookedPolicy):
    name = "s3fifo"
    rows = 4
    n_int = 16
    hooks = (init, hit, miss, victim, evict, admit)
    loop = staticmethod(loop)

    def params(self):
        sc, _ = super().params()
        sc[THRESHOLD] = 2
        return sc, np.array([0.1, 0.9], dtype=np.float64)
