"""The key rules' compiled heap loop checked against the one engine (issue 23, item 1).

``lfu``, ``mean-interval``, ``decayed`` and ``belady`` replay through the keyed heap loop of
:mod:`expertcache.kernels` (keys precomputed per group, every victim of a group chosen at once, in
ascending ``(key, last use, id)``). Here the same rules are written a second time, as engine hooks
in this file (a victim hook that scans the residents for the smallest ``(key, last use, id)``, one
victim per miss, as :func:`expertcache.policies.driver.run` asks), and both must give the same misses and
evictions group for group, on k = 1 and token-grouped traces, both pools, every capacity.

Where the hooks keep what the int64 state rows do not hold: ``decayed``'s float score per item
lives in the float scalars (``fs[1 + e]``, with the rate ``c`` in ``fs[0]``; its score and key are
:mod:`expertcache.policies.decayed`'s own two scalar functions, so the rule is the same and only the
loop differs); ``belady``'s future, which hooks are not given, is a table this file builds by its own
backward scan (``fs[1 + g * n_items + e]``: the next group after ``g`` requesting ``e``), read by the
victim hook, which knows ``g``. Choosing the victims one miss at a time equals choosing them all at
once because a miss's victim is never requested by the group and the keys of the residents do not
change within a group (a rule's state changes only for requested items).
"""

from __future__ import annotations

import numpy as np
import pytest

from expertcache import Trace
from expertcache.policies import driver
from expertcache._jit import njit
from expertcache.kernels import pool_slots
from expertcache.policies.decayed import _order_key, _updated_score
from expertcache.sim import build_layout, replay_layout

COUNT, FIRST, LAST = 0, 1, 2  # st rows: uses in the stream, first and last step used


@njit(cache=False)
def _init(st, sc, fs, n_items, capacity):
    for e in range(n_items):
        st[COUNT, e] = 0


@njit(cache=False)
def _use(st, sc, fs, e, t):
    if st[COUNT, e] == 0:
        st[FIRST, e] = t
    st[COUNT, e] += 1
    st[LAST, e] = t


@njit(cache=False)
def _nothing(st, sc, fs, e, t):
    pass


@njit(cache=False)
def _decayed_use(st, sc, fs, e, t):
    fs[1 + e] = 1.0 if st[COUNT, e] == 0 else _updated_score(fs[1 + e], t - st[LAST, e], fs[0])
    _use(st, sc, fs, e, t)


@njit(cache=False)
def _lfu_key(st, fs, v, g):
    return float(st[COUNT, v])


@njit(cache=False)
def _mean_interval_key(st, fs, v, g):  # minus the predicted next use (mean_interval.predicted_next)
    c = st[COUNT, v]
    if c < 2:
        return -np.inf
    last, first = float(st[LAST, v]), float(st[FIRST, v])
    return -(last + (last - first) / (c - 1))


@njit(cache=False)
def _decayed_key(st, fs, v, g):
    return _order_key(fs[1 + v], st[LAST, v], fs[0])


@njit(cache=False)
def _belady_key(st, fs, v, g):  # minus the next use after g (the same as after v's last use: v is not in g)
    return -fs[1 + g * st.shape[1] + v]


def _victim_of(key):
    @njit(cache=False)
    def victim(st, sc, fs, e, t, stamp, g, res, size):
        best, bk, bl = -1, 0.0, 0
        for i in range(size):
            v = res[i]
            if stamp[v] == g:
                continue
            kv, lv = key(st, fs, v, g), st[LAST, v]
            if best < 0 or kv < bk or (kv == bk and (lv < bl or (lv == bl and v < best))):
                best, bk, bl = v, kv, lv
        return best
    return victim


def _loop_of(key, use):
    victim = _victim_of(key)

    @njit(cache=False)
    def loop(groups, starts, n_items, capacity, sc0, fs0):
        # a hit and an admission are uses (the key rules' on_access records them after the group's
        # misses; here they are recorded as they happen, which changes only requested, protected items)
        return driver.run(groups, starts, n_items, capacity, 3, sc0, fs0, _init, use, _nothing, victim, _nothing, use)

    return loop


NEVER_F = 1e18  # farther than any group


def _future_table(layout) -> np.ndarray:
    """``[G, n_items]`` float: the next group of the same stream after ``g`` requesting each item
    (NEVER_F if none), by a plain backward scan (independent of kernels.next_use)."""
    G, n = layout.groups.shape[0], layout.n_items
    table = np.full((G, n), NEVER_F)
    for s in range(layout.num_streams):
        a, b = int(layout.starts[s]), int(layout.starts[s + 1])
        seen = np.full(n, NEVER_F)
        for g in range(b - 1, a - 1, -1):
            table[g] = seen
            for e in layout.groups[g]:
                if e >= 0:
                    seen[e] = g
    return table


def _float_scalars(name, layout) -> np.ndarray:
    if name == "decayed":  # the rate, then a score per item
        from expertcache.policies import make_policy

        return np.r_[make_policy("decayed").rate(layout.steps_per_token), np.zeros(layout.n_items)]
    if name == "belady":
        return np.r_[0.0, _future_table(layout).ravel()]
    return np.zeros(1)


RULES = {"lfu": (_lfu_key, _use), "mean-interval": (_mean_interval_key, _use),
         "decayed": (_decayed_key, _decayed_use), "belady": (_belady_key, _use)}
LOOPS = {}


def _engine_counts(layout, capacity, name):
    loop = LOOPS.setdefault(name, _loop_of(*RULES[name]))
    return loop(layout.groups, layout.starts, layout.n_items, pool_slots(layout, capacity),
                np.zeros(1, dtype=np.int64), _float_scalars(name, layout))


def bursty(T, L, E, k, seqs, seed):
    rng = np.random.default_rng(seed)
    ex = np.empty((T, L, k), dtype=np.int32)
    for t in range(T):
        for layer in range(L):
            hot = rng.permutation(E)[: max(k, E // 3)] if t % 17 == 0 or t == 0 else hot
            pool = hot if rng.random() < 0.7 else np.arange(E)
            ex[t, layer] = rng.choice(pool, size=k, replace=False)
    return Trace.from_arrays(ex, np.repeat(np.arange(seqs), T // seqs), num_experts=E)


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("k", [1, 3])
def test_the_heap_loop_equals_the_engine(name, k):
    for seed in range(3):
        tr = bursty(T=240, L=3, E=12, k=k, seqs=3, seed=seed)
        for pool in ("layer", "global"):
            layout = build_layout(tr, pool=pool)
            caps = list(range(k, 12)) if pool == "layer" else list(range(3 * k, 36, 4))
            for C in caps:
                got = replay_layout(layout, C, name)
                assert got.engine == "compiled"  # the keyed heap loop
                want = _engine_counts(layout, C, name)
                heap = _heap(layout, C, name)
                assert np.array_equal(heap[0], want[0]) and np.array_equal(heap[1], want[1]), (name, k, pool, C, seed)
                assert got.copies_total == int(want[0].sum())
                if C == caps[0]:
                    assert want[1].sum() > 0  # the rule really chose victims


def _heap(layout, C, name):
    from expertcache.policies import make_policy

    return make_policy(name).plan(layout).run(layout, C)
