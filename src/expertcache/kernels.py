"""Compiled replay loops: the simulator's hot path, isolated here and nothing else.

Every loop serves all streams of a :class:`~expertcache.sim.layout.StreamLayout` in one call,
with exactly the semantics of :class:`expertcache.cache.ExpertCache` (docs/design.md section 2):
demand fetch, a victim only among residents the current group does not request, victims in
ascending ``(key, last use, item id)`` order, every pool empty at each stream start. They return
two int32 arrays over groups: misses (copies) and evictions (copies once the pool is full).

Three loops cover the key rules (the state-machine rules -- random, arc, s3fifo, sieve -- run on
the engine, :mod:`expertcache.policies.driver`):

* :func:`lru_loop` -- a doubly linked recency list, O(1) per request;
* :func:`static_key_loop` -- an indexed binary heap for rules whose key is fixed from one access of
  an item to the next (LRU, LFU, decayed frequency, farthest-future, mean interval), O(log C) per
  request; the keys of every access are computed before the loop;
* :func:`expertcache.policies.kernels_foresight.foresight_loop` -- limited foresight: a recency list of
  residents whose next request is beyond the horizon plus a heap of the visible ones, O(log C)
  per request (its own module, over this one's list and heap blocks);

Rules are not passed in as compiled functions: numba cannot safely cache a loop specialised on
function arguments across processes, so each loop is a plain cached function.

Steps ``t`` seen by rules are local to the stream (0 at its first group), as in ``ExpertCache``.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit

NEVER = np.iinfo(np.int64).max // 4
"""Next-use step of an item that is never requested again (later than every real step)."""

_NEVER = np.int64(NEVER)


@njit(cache=True)
def next_use(groups, starts, n_items):
    """``[G, k]`` int64: the next group of the same stream requesting the same item, else NEVER."""
    G, k = groups.shape
    out = np.full((G, k), _NEVER, dtype=np.int64)
    seen = np.full(n_items, _NEVER, dtype=np.int64)
    for s in range(starts.size - 1):
        a, b = starts[s], starts[s + 1]
        for g in range(b - 1, a - 1, -1):
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    out[g, j] = seen[e]
                    seen[e] = g
        for g in range(a, b):
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    seen[e] = _NEVER
    return out


# ------------------------------------------------------------------------------ building blocks
# A recency list is a doubly linked list over item ids (prv/nxt, -1 ends), head = least recent.
@njit(cache=True, inline="always")
def _unlink(prv, nxt, e, head, tail):
    p, q = prv[e], nxt[e]
    if p >= 0:
        nxt[p] = q
    else:
        head = q
    if q >= 0:
        prv[q] = p
    else:
        tail = p
    return head, tail


@njit(cache=True, inline="always")
def _append(prv, nxt, e, head, tail):
    prv[e] = tail
    nxt[e] = -1
    if tail >= 0:
        nxt[tail] = e
    else:
        head = e
    return head, e


@njit(cache=True, inline="always")
def sorted_ids(groups, g, buf):
    """Copy group ``g``'s ids (padding dropped) into ``buf`` in ascending order (insertion sort:
    groups are small); return how many."""
    n = 0
    for j in range(groups.shape[1]):
        e = groups[g, j]
        if e < 0:
            continue
        i = n
        while i > 0 and buf[i - 1] > e:
            buf[i] = buf[i - 1]
            i -= 1
        buf[i] = e
        n += 1
    return n


@njit(cache=True, inline="always")
def _sorted_group(groups, g, buf, stamp):
    """:func:`sorted_ids`, and the ids marked requested (``stamp[e] = g``)."""
    n = sorted_ids(groups, g, buf)
    for i in range(n):
        stamp[buf[i]] = g
    return n


# A binary min-heap of residents ordered by (key, last use, id), stored inline in three arrays
# (hk, hl, hi) so a comparison touches no other memory; pos[item] is the item's heap index.
@njit(cache=True, inline="always")
def heap_buffers(capacity, k, like):
    """Empty heap arrays ``(hk, hl, hi)`` for ``capacity`` residents and the victim buffers
    ``(ak, al, ai)`` for one group of ``k``; the keys take the dtype of the array ``like``."""
    return (np.empty(capacity, dtype=like.dtype), np.empty(capacity, dtype=np.int64),
            np.empty(capacity, dtype=np.int64), np.empty(k, dtype=like.dtype), np.empty(k, dtype=np.int64),
            np.empty(k, dtype=np.int64))


@njit(cache=True, inline="always")
def _lt(ka, la, ia, kb, lb, ib):
    if ka != kb:
        return ka < kb
    if la != lb:
        return la < lb
    return ia < ib


@njit(cache=True)
def _sift_up(hk, hl, hi, pos, i):
    k0, l0, e = hk[i], hl[i], hi[i]
    while i > 0:
        p = (i - 1) >> 1
        if not _lt(k0, l0, e, hk[p], hl[p], hi[p]):
            break
        hk[i], hl[i], hi[i] = hk[p], hl[p], hi[p]
        pos[hi[i]] = i
        i = p
    hk[i], hl[i], hi[i] = k0, l0, e
    pos[e] = i


@njit(cache=True)
def _sift_down(hk, hl, hi, pos, i, size):
    k0, l0, e = hk[i], hl[i], hi[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _lt(hk[c + 1], hl[c + 1], hi[c + 1], hk[c], hl[c], hi[c]):
            c += 1
        if not _lt(hk[c], hl[c], hi[c], k0, l0, e):
            break
        hk[i], hl[i], hi[i] = hk[c], hl[c], hi[c]
        pos[hi[i]] = i
        i = c
    hk[i], hl[i], hi[i] = k0, l0, e
    pos[e] = i


@njit(cache=True, inline="always")
def _push(hk, hl, hi, pos, size, key, last, e):
    hk[size], hl[size], hi[size] = key, last, e
    _sift_up(hk, hl, hi, pos, size)
    return size + 1


@njit(cache=True)
def _remove(hk, hl, hi, pos, size, e):
    """Take ``e`` out of the heap; return the new size."""
    r = pos[e]
    size -= 1
    if r != size:
        moved = hi[size]
        hk[r], hl[r], hi[r] = hk[size], hl[size], moved
        pos[moved] = r
        _sift_up(hk, hl, hi, pos, r)
        _sift_down(hk, hl, hi, pos, pos[moved], size)
    return size


@njit(cache=True)
def _pop_victim(hk, hl, hi, pos, size, stamp, g, ak, al, ai):
    """Pop the smallest resident not requested by group ``g`` (``stamp[e] == g``); requested ones
    popped on the way go back. Return ``(victim, new size)``; the caller clears ``pos[victim]``."""
    na = 0
    while True:
        tk, tl, top = hk[0], hl[0], hi[0]
        size -= 1
        if size > 0:
            hk[0], hl[0], hi[0] = hk[size], hl[size], hi[size]
            _sift_down(hk, hl, hi, pos, 0, size)
        if stamp[top] != g:
            break
        ak[na], al[na], ai[na] = tk, tl, top
        na += 1
    for i in range(na):
        size = _push(hk, hl, hi, pos, size, ak[i], al[i], ai[i])
    return top, size


# ------------------------------------------------------------------------------ LRU list
@njit(cache=True)
def lru_loop(groups, starts, n_items, capacity):
    """LRU by a recency list. Members of a group are moved to the tail in ascending id order, so
    equal last use breaks ties by the smallest id."""
    G, k = groups.shape
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    prv = np.full(n_items, -1, dtype=np.int64)
    nxt = np.full(n_items, -1, dtype=np.int64)
    resident = np.zeros(n_items, dtype=np.bool_)
    stamp = np.full(n_items, -1, dtype=np.int64)
    buf = np.empty(k, dtype=np.int64)
    for s in range(starts.size - 1):
        head = -1
        tail = -1
        size = 0
        for g in range(starts[s], starts[s + 1]):
            n = _sorted_group(groups, g, buf, stamp)
            m = 0
            ev = 0
            for i in range(n):
                e = buf[i]
                if resident[e]:
                    if e != tail:  # move to the tail (inlined by hand: the hot path)
                        p, q = prv[e], nxt[e]
                        if p >= 0:
                            nxt[p] = q
                        else:
                            head = q
                        prv[q] = p
                        prv[e] = tail
                        nxt[e] = -1
                        nxt[tail] = e
                        tail = e
                    continue
                m += 1
                if size == capacity:
                    v = head
                    while stamp[v] == g:
                        v = nxt[v]
                    head, tail = _unlink(prv, nxt, v, head, tail)
                    resident[v] = False
                    size -= 1
                    ev += 1
                resident[e] = True
                size += 1
                head, tail = _append(prv, nxt, e, head, tail)
            misses[g] = m
            evictions[g] = ev
        v = head
        while v >= 0:
            resident[v] = False
            v = nxt[v]
    return misses, evictions


# ------------------------------------------------------------------------------ heap
@njit(cache=True)
def static_key_loop(groups, keys, starts, n_items, capacity, negate):
    """Evict the resident with the smallest ``(key, last use, id)``; ``keys[g, j]`` is the key the
    item of slot ``(g, j)`` holds from that access until its next one (``-keys[g, j]`` when
    ``negate``: belady passes the next-use array itself, so the farthest request is the smallest
    key without a ``[G, k]`` temporary). ``keys`` may be float64 or int64; the heap holds that type."""
    G, k = groups.shape
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    pos = np.full(n_items, -1, dtype=np.int64)
    stamp = np.full(n_items, -1, dtype=np.int64)
    hk, hl, hi, ak, al, ai = heap_buffers(capacity, k, keys)
    for s in range(starts.size - 1):
        a = starts[s]
        size = 0
        for g in range(a, starts[s + 1]):
            t = g - a
            for j in range(k):  # hits: re-key in place
                e = groups[g, j]
                if e >= 0:
                    stamp[e] = g
                    i = pos[e]
                    if i >= 0:
                        kn = -keys[g, j] if negate else keys[g, j]
                        up = _lt(kn, t, e, hk[i], hl[i], e)
                        hk[i] = kn
                        hl[i] = t
                        if up:
                            _sift_up(hk, hl, hi, pos, i)
                        else:
                            _sift_down(hk, hl, hi, pos, i, size)
            m = 0
            ev = 0
            for j in range(k):  # misses
                e = groups[g, j]
                if e < 0 or pos[e] >= 0:
                    continue
                m += 1
                if size == capacity:
                    v, size = _pop_victim(hk, hl, hi, pos, size, stamp, g, ak, al, ai)
                    pos[v] = -1
                    ev += 1
                size = _push(hk, hl, hi, pos, size, -keys[g, j] if negate else keys[g, j], t, e)
            misses[g] = m
            evictions[g] = ev
        for i in range(size):
            pos[hi[i]] = -1
    return misses, evictions


@njit(cache=True, inline="always")
def swap_remove(res, rpos, size, v):
    """Remove resident ``v`` from the list ``res[:size]`` (``rpos[item]`` = its index, -1 when absent)
    by moving the last resident into its place; returns the new size."""
    i = rpos[v]
    size -= 1
    res[i] = res[size]
    rpos[res[i]] = i
    rpos[v] = -1
    return size


# ------------------------------------------------------------------------------ plans
def pool_slots(layout, capacity) -> int:
    """Pool slots the loops allocate: never more than the items (more would change no count)."""
    return int(min(int(capacity), int(layout.n_items)))


class LRUPlan:
    """Run :func:`lru_loop`."""

    def run(self, layout, capacity):
        return lru_loop(layout.groups, layout.starts, layout.n_items, pool_slots(layout, capacity))


class StaticKeyPlan:
    """Run :func:`static_key_loop` with keys from ``make_keys(layout) -> [G, k]`` (int64 keys are
    kept as they are, any other type becomes float64); ``negate`` evicts the largest key first."""

    def __init__(self, make_keys, negate: bool = False):
        self.make_keys = make_keys
        self.negate = bool(negate)

    def run(self, layout, capacity):
        keys = self.make_keys(layout)
        keys = np.ascontiguousarray(keys, dtype=np.int64 if keys.dtype == np.int64 else np.float64)
        return static_key_loop(layout.groups, keys, layout.starts, layout.n_items, pool_slots(layout, capacity),
                               self.negate)


@njit(cache=True)
def local_steps(starts, G):
    """``[G]`` int64: each group's step within its stream."""
    out = np.empty(G, dtype=np.int64)
    for s in range(starts.size - 1):
        for g in range(starts[s], starts[s + 1]):
            out[g] = g - starts[s]
    return out


@njit(cache=True)
def access_history(groups, starts, n_items):
    """Per access ``(g, j)``: its count among the stream's requests for that item (1-based) and the
    local step of the item's first request in the stream. Both int64 ``[G, k]``."""
    G, k = groups.shape
    count = np.zeros((G, k), dtype=np.int64)
    first = np.zeros((G, k), dtype=np.int64)
    c = np.zeros(n_items, dtype=np.int64)
    f = np.zeros(n_items, dtype=np.int64)
    for s in range(starts.size - 1):
        a, b = starts[s], starts[s + 1]
        for g in range(a, b):
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    if c[e] == 0:
                        f[e] = g - a
                    c[e] += 1
                    count[g, j] = c[e]
                    first[g, j] = f[e]
        for g in range(a, b):
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    c[e] = 0
    return count, first
