"""Compiled replay loops: the simulator's hot path, isolated here and nothing else.

Every loop serves all streams of a :class:`~expertcache.sim.layout.StreamLayout` in one call,
with exactly the semantics of :class:`expertcache.cache.ExpertCache` (DESIGN section 2):
demand fetch, a victim only among residents the current group does not request, victims in
ascending ``(key, last use, item id)`` order, every pool empty at each stream start. They return
two int32 arrays over groups: misses (copies) and evictions (copies once the pool is full).

Three loops cover every rule:

* :func:`lru_loop` -- a doubly linked recency list, O(1) per request;
* :func:`static_key_loop` -- an indexed binary heap for rules whose key is fixed from one access of
  an item to the next (LRU, LFU, farthest-future, mean interval), O(log C) per request; the keys of
  every access are computed before the loop;
* :func:`scan_loop` -- a scan over the residents at each eviction for rules whose keys move with
  time (decayed frequency, limited foresight, random), O(C) per eviction; the rule comes in as two
  compiled functions ``key(item, t, fstate, istate, nxt, pf, pi)`` and
  ``access(item, t, fstate, istate, pf, pi)``.

Steps ``t`` seen by rules are local to the stream (0 at its first group), as in ``ExpertCache``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

NEVER = np.iinfo(np.int64).max // 4
"""Next-use step of an item that is never requested again (later than every real step)."""

_NEVER = np.int64(NEVER)


@nb.njit(cache=True)
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


# ------------------------------------------------------------------------------ LRU list
@nb.njit(cache=True)
def lru_loop(groups, starts, n_items, capacity):
    """LRU by a recency list: head = least recently used. Members of a group are moved to the
    tail in ascending id order, so equal last use breaks ties by the smallest id."""
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
            n = 0
            for j in range(k):  # insertion sort of the group's ids
                e = groups[g, j]
                if e < 0:
                    continue
                stamp[e] = g
                i = n
                while i > 0 and buf[i - 1] > e:
                    buf[i] = buf[i - 1]
                    i -= 1
                buf[i] = e
                n += 1
            m = 0
            ev = 0
            for i in range(n):
                e = buf[i]
                if resident[e]:
                    if e != tail:  # unlink, then append at the tail
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
                    p, q = prv[v], nxt[v]
                    if p >= 0:
                        nxt[p] = q
                    else:
                        head = q
                    if q >= 0:
                        prv[q] = p
                    else:
                        tail = p
                    resident[v] = False
                    size -= 1
                    ev += 1
                resident[e] = True
                size += 1
                prv[e] = tail
                nxt[e] = -1
                if tail >= 0:
                    nxt[tail] = e
                else:
                    head = e
                tail = e
            misses[g] = m
            evictions[g] = ev
        v = head
        while v >= 0:
            resident[v] = False
            v = nxt[v]
    return misses, evictions


# ------------------------------------------------------------------------------ heap
# A binary min-heap of residents ordered by (key, last use, id), stored inline in three arrays
# (hk, hl, hi) so a comparison touches no other memory; pos[item] is the item's heap index.
@nb.njit(cache=True, inline="always")
def _lt(ka, la, ia, kb, lb, ib):
    if ka != kb:
        return ka < kb
    if la != lb:
        return la < lb
    return ia < ib


@nb.njit(cache=True)
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


@nb.njit(cache=True)
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


@nb.njit(cache=True)
def static_key_loop(groups, keys, starts, n_items, capacity):
    """Evict the resident with the smallest ``(key, last use, id)``; ``keys[g, j]`` is the key the
    item of slot ``(g, j)`` holds from that access until its next one."""
    G, k = groups.shape
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    pos = np.full(n_items, -1, dtype=np.int64)
    stamp = np.full(n_items, -1, dtype=np.int64)
    hk = np.empty(capacity, dtype=np.float64)
    hl = np.empty(capacity, dtype=np.int64)
    hi = np.empty(capacity, dtype=np.int64)
    ak = np.empty(k, dtype=np.float64)
    al = np.empty(k, dtype=np.int64)
    ai = np.empty(k, dtype=np.int64)
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
                        kn = keys[g, j]
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
                    na = 0
                    while True:  # pop until the top is not requested by this group
                        tk, tl, top = hk[0], hl[0], hi[0]
                        size -= 1
                        if size > 0:
                            hk[0], hl[0], hi[0] = hk[size], hl[size], hi[size]
                            _sift_down(hk, hl, hi, pos, 0, size)
                        if stamp[top] != g:
                            pos[top] = -1
                            ev += 1
                            break
                        ak[na], al[na], ai[na] = tk, tl, top
                        na += 1
                    for i in range(na):  # requested residents go back
                        hk[size], hl[size], hi[size] = ak[i], al[i], ai[i]
                        _sift_up(hk, hl, hi, pos, size)
                        size += 1
                hk[size], hl[size], hi[size] = keys[g, j], t, e
                _sift_up(hk, hl, hi, pos, size)
                size += 1
            misses[g] = m
            evictions[g] = ev
        for i in range(size):
            pos[hi[i]] = -1
    return misses, evictions


# ------------------------------------------------------------------------------ scan
@nb.njit(cache=True)
def scan_loop(groups, starts, n_items, capacity, nuse, key_fn, access_fn, fstate, istate, pf, pi):
    """Evict by scanning the residents for the smallest ``(key_fn(...), last use, id)``.

    ``fstate``/``istate`` are the rule's per-item state (reset to 0 / -1 for each stream);
    ``nuse`` is :func:`next_use` (or an empty ``[0, 0]`` array when the rule needs no future);
    ``pf``/``pi`` are the rule's float and int parameters.
    """
    G, k = groups.shape
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    has_future = nuse.shape[0] == G
    last = np.zeros(n_items, dtype=np.int64)
    nxt = np.full(n_items, _NEVER, dtype=np.int64)
    rpos = np.full(n_items, -1, dtype=np.int64)
    stamp = np.full(n_items, -1, dtype=np.int64)
    res = np.empty(capacity, dtype=np.int64)
    for s in range(starts.size - 1):
        a, b = starts[s], starts[s + 1]
        for g in range(a, b):
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    fstate[e] = 0.0
                    istate[e] = -1
        size = 0
        for g in range(a, b):
            t = g - a
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    stamp[e] = g
            m = 0
            ev = 0
            for j in range(k):
                e = groups[g, j]
                if e < 0 or rpos[e] >= 0:
                    continue
                m += 1
                if size == capacity:
                    best = -1
                    bk = 0.0
                    for i in range(size):
                        c = res[i]
                        if stamp[c] == g:
                            continue
                        kc = key_fn(c, t, fstate, istate, nxt, pf, pi)
                        if best < 0 or kc < bk or (kc == bk and (last[c] < last[best] or (last[c] == last[best] and c < best))):
                            best = c
                            bk = kc
                    i = rpos[best]
                    size -= 1
                    res[i] = res[size]
                    rpos[res[i]] = i
                    rpos[best] = -1
                    ev += 1
                res[size] = e
                rpos[e] = size
                size += 1
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    last[e] = t
                    if has_future:
                        nxt[e] = nuse[g, j] - a if nuse[g, j] != _NEVER else _NEVER
                    access_fn(e, t, fstate, istate, pf, pi)
            misses[g] = m
            evictions[g] = ev
        for i in range(size):
            rpos[res[i]] = -1
    return misses, evictions


# ------------------------------------------------------------------------------ plans
class LRUPlan:
    """Run :func:`lru_loop`."""

    def run(self, layout, capacity):
        return lru_loop(layout.groups, layout.starts, layout.n_items, capacity)


class StaticKeyPlan:
    """Run :func:`static_key_loop` with keys from ``make_keys(layout) -> float64 [G, k]``."""

    def __init__(self, make_keys):
        self.make_keys = make_keys

    def run(self, layout, capacity):
        keys = np.ascontiguousarray(self.make_keys(layout), dtype=np.float64)
        return static_key_loop(layout.groups, keys, layout.starts, layout.n_items, capacity)


class ScanPlan:
    """Run :func:`scan_loop` with a rule's compiled ``key``/``access`` functions."""

    def __init__(self, key_fn, access_fn, pf=None, pi=None, needs_future=False):
        self.key_fn = key_fn
        self.access_fn = access_fn
        self.pf = np.zeros(1) if pf is None else np.ascontiguousarray(pf, dtype=np.float64)
        self.pi = np.zeros(1, dtype=np.int64) if pi is None else np.ascontiguousarray(pi, dtype=np.int64)
        self.needs_future = needs_future

    def run(self, layout, capacity):
        nuse = layout.next_use if self.needs_future else np.zeros((0, 0), dtype=np.int64)
        fstate = np.zeros(layout.n_items, dtype=np.float64)
        istate = np.full(layout.n_items, -1, dtype=np.int64)
        return scan_loop(
            layout.groups, layout.starts, layout.n_items, capacity, nuse,
            self.key_fn, self.access_fn, fstate, istate, self.pf, self.pi,
        )


@nb.njit(cache=True)
def local_steps(starts, G):
    """``[G]`` int64: each group's step within its stream."""
    out = np.empty(G, dtype=np.int64)
    for s in range(starts.size - 1):
        for g in range(starts[s], starts[s + 1]):
            out[g] = g - starts[s]
    return out


@nb.njit(cache=True)
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
