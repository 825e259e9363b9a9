"""The kernel's two file LRU lists under a memory cgroup: the forecast's model of what the kernel
page-cache modes (``mmap``, ``advise``) read (docs/llama.md, "The kernel's two lists").

Linux 6.x without the multi-gen LRU keeps a cgroup's file pages on two lists; these rules are
kept, at the grain of an *item* (an expert, or a read-ahead window) instead of a page:

* a page read in goes on the **inactive** list, unless it *refaults* soon: its shadow entry's age
  (evictions and activations counted since it was evicted) at most the active list's bytes, in
  which case it goes straight on the **active** list (``workingset_refault``);
* reclaim runs while the file pages exceed the limit. If the active list is more than ``ratio``
  times the inactive one (``ratio`` 1 below 1 GiB of file pages, ``isqrt(10 * GiB)`` from there:
  ``inactive_is_low``), the active list's oldest item goes back to the inactive list as its newest,
  its reference cleared (``shrink_active_list``: a data page is deactivated whether referenced or
  not). Otherwise the inactive list's oldest item is scanned: referenced since the last scan and
  marked by an earlier one, it is activated (and stays marked, so that once deactivated a use
  activates it again at its next scan); referenced but not marked, it is marked and kept
  (moved to the newest end); not referenced, it is evicted (``folio_check_references``);
* a use through the mapping is a reference only where the mapping has recency: not under
  ``MADV_RANDOM`` (``vma_has_recency``, Linux 6.3+), which ``advise`` sets on the expert tensors;
* the dense part is read every token and stays active (its bytes count in the active list's);
* llama.cpp's load leaves the file's pages on the active list (measured: 802-876 MB of an 883 MB
  wall active once loaded): the replay first loads every item, in id order, into the active list.

Invariants: the bytes held, the dense part's included, never exceed ``capacity`` after a step
unless the dense part alone does; every access to an item not held is a read of its bytes; a read is a
*fill* when it is the item's first use in the replay (the load is not a use). The compiled loop
(:func:`_replay`) and the reference in ``tests/test_pagelists.py`` agree exactly.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .._jit import njit
from ..kernels import _append, _unlink

GIB = 1 << 30
CHUNK = 1 << 20
"""Accesses handed to the compiled loop at a time (the state persists between chunks)."""

# the scalar state, st[...]
_IHEAD, _ITAIL, _AHEAD, _ATAIL, _IBYTES, _ABYTES, _AGE, _READ, _FILL = range(9)
_OUT, _INACTIVE, _ACTIVE = 0, 1, 2


@njit(cache=True, inline="always")
def _ratio(total):
    gib = total // GIB
    if gib == 0:
        return 1
    r = int(np.sqrt(10.0 * gib))
    while (r + 1) * (r + 1) <= 10 * gib:
        r += 1
    while r * r > 10 * gib:
        r -= 1
    return r


@njit(cache=True, inline="always")
def _to_inactive(u, prv, nxt, where, sizes, st):
    where[u] = _INACTIVE
    st[_IHEAD], st[_ITAIL] = _append(prv, nxt, u, st[_IHEAD], st[_ITAIL])
    st[_IBYTES] += sizes[u]


@njit(cache=True, inline="always")
def _to_active(u, prv, nxt, where, sizes, st):
    where[u] = _ACTIVE
    st[_AHEAD], st[_ATAIL] = _append(prv, nxt, u, st[_AHEAD], st[_ATAIL])
    st[_ABYTES] += sizes[u]
    st[_AGE] += sizes[u]  # an activation ages the shadow entries (workingset_age_nonresident)


@njit(cache=True)
def _reclaim(capacity, sizes, prv, nxt, where, young, marked, shadow, st):
    while st[_IBYTES] + st[_ABYTES] > capacity:
        if st[_AHEAD] >= 0 and st[_IBYTES] * _ratio(st[_IBYTES] + st[_ABYTES]) < st[_ABYTES]:
            u = st[_AHEAD]
            st[_AHEAD], st[_ATAIL] = _unlink(prv, nxt, u, st[_AHEAD], st[_ATAIL])
            st[_ABYTES] -= sizes[u]
            young[u] = False
            _to_inactive(u, prv, nxt, where, sizes, st)
            continue
        u = st[_IHEAD]
        if u < 0:
            return
        st[_IHEAD], st[_ITAIL] = _unlink(prv, nxt, u, st[_IHEAD], st[_ITAIL])
        st[_IBYTES] -= sizes[u]
        if young[u]:
            young[u] = False
            if marked[u]:  # stays marked: a deactivated item used again is activated at its next scan
                _to_active(u, prv, nxt, where, sizes, st)
            else:
                marked[u] = True
                _to_inactive(u, prv, nxt, where, sizes, st)
        else:
            where[u] = _OUT
            shadow[u] = st[_AGE]
            st[_AGE] += sizes[u]


@njit(cache=True)
def _load(capacity, sizes, prv, nxt, where, young, marked, shadow, st):
    for u in range(sizes.size):
        _to_active(u, prv, nxt, where, sizes, st)
        _reclaim(capacity, sizes, prv, nxt, where, young, marked, shadow, st)


@njit(cache=True)
def _replay(acc, counted, referenced, capacity, sizes, prv, nxt, where, young, marked, used, shadow, st):
    for i in range(acc.size):
        u = acc[i]
        if where[u] != _OUT:
            if referenced:
                young[u] = True
            used[u] = True
            continue
        if counted[i]:
            st[_READ] += sizes[u]
            if not used[u]:
                st[_FILL] += sizes[u]
        used[u] = True
        if shadow[u] >= 0 and st[_AGE] - shadow[u] <= st[_ABYTES]:
            _to_active(u, prv, nxt, where, sizes, st)
        else:
            _to_inactive(u, prv, nxt, where, sizes, st)
        young[u] = referenced
        marked[u] = False
        _reclaim(capacity, sizes, prv, nxt, where, young, marked, shadow, st)


def two_lists(groups: Iterable[tuple[np.ndarray, bool]], capacity: int, sizes, dense: int,
              referenced: bool) -> tuple[int, int]:
    """``(read bytes, fill bytes)`` of the counted groups (``(item ids, counted)``, in order)
    through the two lists (module docstring) of ``capacity`` bytes of file pages, over items of
    ``sizes`` bytes, after the load; ``dense`` bytes always active; ``referenced``: a use is a
    reference (a mapping with recency) or not (``MADV_RANDOM``)."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    n = sizes.size
    prv = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    where = np.zeros(n, dtype=np.int8)
    young = np.zeros(n, dtype=np.bool_)
    marked = np.zeros(n, dtype=np.bool_)
    used = np.zeros(n, dtype=np.bool_)
    shadow = np.full(n, -1, dtype=np.int64)
    st = np.zeros(9, dtype=np.int64)
    st[[_IHEAD, _ITAIL, _AHEAD, _ATAIL]] = -1
    st[_ABYTES] = int(dense)
    cap = int(capacity)
    _load(cap, sizes, prv, nxt, where, young, marked, shadow, st)
    acc: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    pending = 0

    def flush() -> None:
        if acc:
            _replay(np.concatenate(acc), np.concatenate(flags), bool(referenced), cap, sizes, prv, nxt, where, young,
                    marked, used, shadow, st)
            acc.clear()
            flags.clear()

    for items, counted in groups:
        items = np.asarray(items, dtype=np.int64)
        acc.append(items)
        flags.append(np.full(items.size, bool(counted), dtype=np.bool_))
        pending += items.size
        if pending >= CHUNK:
            flush()
            pending = 0
    flush()
    return int(st[_READ]), int(st[_FILL])
