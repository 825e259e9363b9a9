"""LRU stack distances of token-grouped streams: every capacity's LRU counts from one pass.

Why one pass suffices. Order the items seen so far in a stream by *recency*: last requesting
group, then item id (within a group the larger id counts as more recent -- exactly the order in
which :func:`expertcache.kernels.lru_loop` appends a group's members to its recency list, so
"least recently used, then smallest id" goes first). Claim: for every capacity ``C`` at least as
large as the widest group, LRU with co-requested items protected holds, before each group, exactly
the ``C`` most recent items (all of them while fewer than ``C`` have been seen).

Induction over groups. Let ``R`` be the resident set (the top ``C`` of the old order) and ``S`` the
group. Every member of ``S`` ends resident; victims are the least recent residents outside ``S``,
one per miss once the pool is full. So afterwards the pool holds ``S`` plus the most recent
``min(C, |R u S|) - |S|`` items of ``R \\ S``. ``R`` is a prefix of the old order, so ``R \\ S`` is
a prefix of the old order without ``S``; and in the new order ``S`` comes first (most recent),
followed by the old order without ``S``. Hence the pool is the top ``C`` of the new order
(``C >= |S|`` is what lets all of ``S`` fit). Protection never bites: a victim search skips only
members of ``S``, which are exactly the items the stack view moves to the front.

Consequences, with the *stack depth* of a request = its item's 1-based position in the recency
order before the group (other members of the same group do not count) and a first request of the
stream having infinite depth:

* the request hits at capacity ``C`` iff its depth ``<= C``: ``misses(C)`` = scored requests with
  depth ``> C``;
* per group, ``evictions = min(C, n_before) + misses - min(C, n_after)`` where ``n`` counts the
  distinct items seen in the stream. Summed over the scored groups, the correction is the *fill*:
  ``fill(C)`` = how many of the stream's first ``C`` distinct items (ranked by first request) were
  first requested inside the scored window. So ``copies_steady(C) = misses(C) - fill(C)``; with the
  whole stream scored this is ``max(0, copies_total - C)``, with a warm window it counts only the
  scored insertions that evict.

-1 pads are skipped; per-stream reset restarts the order; a global pool is the same stream over
``(layer, expert)`` items.

Cost. Requests take rising time stamps; each seen item's latest stamp is one set bit in a bitmap of
``M <= 2 * n_items + 2 * k`` stamps, so a depth is a popcount of the bits at or after the item's
stamp. Up to :data:`DIRECT_WORDS` 64-bit words (about 8,000 items) the words from the item's up to
the newest are popcounted directly -- one or two words for the recent items that dominate real
routing, never more than ``DIRECT_WORDS``; larger pools also keep a Fenwick tree over word counts,
O(log(n_items)) per request. The two ways are two compilations of one loop (``tree`` is ``None``
or an array, and numba drops the dead branch), so the direct loop carries no tree test: with the
test inside, the loop ran 2.3-2.9x ``lru_loop`` instead of 1.0-1.9x (``benchmarks/bench_mrc.py``).
Stamps are renumbered when they run out (amortized O(1)). A group's ids are sorted by
``kernels.sorted_ids``, as ``lru_loop``'s are. Altogether O(G * k * (k + log E)).
"""

from __future__ import annotations

import numpy as np

from ..._jit import AVAILABLE, njit
from ...kernels import sorted_ids

_ONE = np.uint64(1)
DIRECT_WORDS = 256
"""Streams with at most this many 64-stamp words count depths by popcounting words directly;
larger ones keep a Fenwick tree over word counts (O(log) per request, larger constants)."""


if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _popcount(typingctx, x):
        """Set bits of a uint64 (one ``ctpop`` instruction)."""
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.ctpop(args[0])

        return types.int64(types.uint64), codegen

    @intrinsic
    def _lowest_bit(typingctx, x):
        """Index of the lowest set bit of a nonzero uint64 (one ``cttz`` instruction)."""
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

        return types.int64(types.uint64), codegen

else:  # plain Python (see expertcache._jit): the same two functions on uint64 values
    _MASK64 = (1 << 64) - 1

    def _popcount(x):
        """Set bits of a uint64 (its value modulo 2**64, as numba's cast to uint64 would take it)."""
        return (int(x) & _MASK64).bit_count()

    def _lowest_bit(x):
        """Index of the lowest set bit of a nonzero uint64."""
        x = int(x) & _MASK64
        return (x & -x).bit_length() - 1


@njit(cache=True, inline="always")
def _fenwick_add(tree, i, size, v):
    while i <= size:
        tree[i] += v
        i += i & -i


@njit(cache=True, inline="always")
def _fenwick_prefix(tree, i):
    s = 0
    while i > 0:
        s += tree[i]
        i &= i - 1
    return s


@njit(cache=True, inline="always")
def _count_from(bits, tree, live, top, st):
    """Live stamps at or after ``st``; ``top`` is the word of the newest stamp. Without a ``tree``
    (``None``: the branch is compiled away) the words from ``st``'s up to ``top`` are popcounted
    (cheap for recent items, which dominate); with one, ``live`` minus the words below via the
    Fenwick tree over word counts."""
    w = st >> 6
    if tree is None:
        c = _popcount(bits[w] >> np.uint64(st & 63))
        for v in range(w + 1, top + 1):
            c += _popcount(bits[v])
        return c
    low = (_ONE << np.uint64(st & 63)) - _ONE
    return live - _fenwick_prefix(tree, w) - _popcount(bits[w] & low)


@njit(cache=True, inline="always")
def _flip(bits, tree, n_words, st, v):
    """Set (``v = 1``) or clear (``v = -1``) the bit of stamp ``st``."""
    w = st >> 6
    m = _ONE << np.uint64(st & 63)
    if v > 0:
        bits[w] |= m
    else:
        bits[w] &= ~m
    if tree is not None:
        _fenwick_add(tree, w + 1, n_words, v)


@njit(cache=True)
def _renumber(bits, tree, n_words, owner, stamp, clock):
    """Give the live stamps the numbers ``0..live-1`` in their order; returns ``live``."""
    live = 0
    for w in range(((clock - 1) >> 6) + 1):
        x = bits[w]
        while x:
            e = owner[(w << 6) + _lowest_bit(x)]
            x &= x - _ONE
            owner[live] = e
            stamp[e] = live
            live += 1
    for w in range(n_words):
        lo = w << 6
        bits[w] = ~np.uint64(0) if live >= lo + 64 else ((_ONE << np.uint64(max(live - lo, 0))) - _ONE)
    if tree is not None:
        tree[0] = 0
        for w in range(n_words):
            tree[w + 1] = min(max(live - (w << 6), 0), 64)
        for w in range(1, n_words + 1):
            q = w + (w & -w)
            if q <= n_words:
                tree[q] += tree[w]
    return live


@njit(cache=True)
def stamp_words(n_items, k):
    """64-stamp words of the bitmap: room for ``2 * n_items + 2 * k`` stamps (live ones and the
    stale ones between renumberings)."""
    return (2 * n_items + 2 * k + 63) // 64


def stack_histograms(groups, starts, n_items, group_layer, group_scored, n_layers, direct_words=DIRECT_WORDS):
    """Stack-depth histograms of every stream's scored requests, by layer.

    Returns two int64 ``[n_layers, n_items + 1]`` arrays:

    * ``depth[l, d]`` -- scored requests of layer ``l`` with stack depth ``d`` (1..n_items);
      ``depth[l, 0]`` counts first requests of a stream (infinite depth: a miss at any capacity);
    * ``first[l, c]`` -- streams whose ``c``-th distinct item (1-based, by first request) was first
      requested in a scored group of layer ``l``.

    ``group_layer[g]`` / ``group_scored[g]`` give each group's layer row and whether it is scored.
    Pools of more than ``direct_words`` 64-stamp words keep the Fenwick tree (one compiled loop
    each way: the loop without a tree has no tree branch left in it).
    """
    words = stamp_words(int(n_items), groups.shape[1])
    tree = np.zeros(words + 1, dtype=np.int64) if words > direct_words else None
    return _stack_loop(groups, starts, n_items, group_layer, group_scored, n_layers, tree)


@njit(cache=True)
def _stack_loop(groups, starts, n_items, group_layer, group_scored, n_layers, tree):
    """:func:`stack_histograms`' loop; ``tree`` is ``None`` (count words directly) or the Fenwick array.

    Each request takes a time stamp (rising; within a group in ascending id order, so a larger id
    counts as more recent). Every seen item's latest stamp is a set bit of ``bits``; the depth of
    an item is the number of set bits at or after its stamp. When stamps run out the live ones are
    renumbered ``0..live-1`` (``live`` = distinct items seen; amortized O(1) per request).
    """
    G, k = groups.shape
    depth = np.zeros((n_layers, n_items + 1), dtype=np.int64)
    first = np.zeros((n_layers, n_items + 1), dtype=np.int64)
    cap = stamp_words(n_items, k) * 64
    bits = np.zeros(cap // 64, dtype=np.uint64)
    owner = np.zeros(cap, dtype=np.int64)  # item of each live stamp (other entries are stale)
    stamp = np.full(n_items, -1, dtype=np.int64)  # latest stamp of each item; -1: not seen yet
    buf = np.empty(k, dtype=np.int64)
    for s in range(starts.size - 1):
        a, b = starts[s], starts[s + 1]
        size = min(cap, (((b - a) * k + 63) // 64) * 64)  # stamps usable before renumbering
        n_words = size // 64
        bits[:n_words] = 0
        if tree is not None:
            tree[: n_words + 1] = 0
        clock = 0
        live = 0
        for g in range(a, b):
            n = sorted_ids(groups, g, buf)  # the group's ids in ascending order, padding dropped
            if clock + n > size:
                clock = _renumber(bits, tree, n_words, owner, stamp, clock)
            if group_scored[g]:
                row = group_layer[g]
                top = (clock - 1) >> 6
                seen = live
                for i in range(n):
                    st = stamp[buf[i]]
                    if st < 0:
                        seen += 1
                        depth[row, 0] += 1
                        first[row, seen] += 1
                    else:
                        depth[row, _count_from(bits, tree, live, top, st)] += 1
            for i in range(n):
                e = buf[i]
                st = stamp[e]
                if st >= 0:
                    _flip(bits, tree, n_words, st, -1)
                else:
                    live += 1
                st = clock + i
                stamp[e] = st
                owner[st] = e
                _flip(bits, tree, n_words, st, 1)
            clock += n
        for w in range(((clock - 1) >> 6) + 1):  # forget the stream's items
            x = bits[w]
            while x:
                stamp[owner[(w << 6) + _lowest_bit(x)]] = -1
                x &= x - _ONE
    return depth, first
