"""Compiled replay of ``learned:`` scorers.

:func:`learned_loop` serves streams exactly as :class:`expertcache.cache.ExpertCache` does
(:mod:`expertcache.kernels`: demand fetch, victims among the residents the group does not
request, ascending ``(key, last use, item id)``, the first ``need`` of that order evicted, pools
empty at each stream start) with key = minus a scorer's score of the candidate's causal features.
Keys change at every step (ages grow), so there is no heap: at each eviction every candidate is
described (feature by feature) and scored, O(C F) linear, O(C F H) mlp.

The feature state (last, first and previous use, count, decayed counts, gate sums, router rows,
the residency inference ``since_load`` reads) and its steps are
:mod:`expertcache.scorer.kernels_feature_state`'s, the same compiled functions the live policy calls
(:class:`~expertcache.scorer.kernels_live.LiveFeatures`); this loop adds only the cache. The
Python reference, :class:`expertcache.scorer.features.FeatureState`, is an independent
implementation of the same definitions, and the floats agree bit for bit: the same operations in
the same order, ``exp`` and ``log1p`` always the scalar ``math.exp`` / ``math.log1p``, every score
through :func:`score_row` (float64, every sum in index order; not ``einsum``). This assumes numba
without Intel SVML (``numba -s``), which would vectorise ``math.exp`` loops differently.
``tests/test_learned_compiled.py`` checks counts of all three paths group for group.

Feature codes (:func:`feature_codes`): the reuse group, then ``gate_last``, ``gate_mean``
(``probs``), ``router_now``, ``router_avg`` (``router_probs``), ``online_h1`` (the stream's own
transitions), then the ``prior`` group (``pop``, ``trans_hH``: tables fitted on training sequences,
:mod:`expertcache.scorer.prior`). A scorer naming any other feature (the model-side groups) has no
compiled plan (the policy falls back to FeatureState and the Python engine).
"""

from __future__ import annotations

import numpy as np

from .._jit import njit
from ..kernels import pool_slots, swap_remove
from .kernels_feature_state import (access_group, describe, feature_codes, not_inferred, observe_group, observe_router,
                                    online_arrays, order_prefix, reset_online, reset_state, score_keys,
                                    tables)
from .kernels_features import decayed, log1p_each, score_row, score_rows, trans_at, trans_column

__all__ = ["LearnedPlan", "decayed", "feature_codes", "learned_loop", "log1p_each", "score_row", "score_rows",
           "trans_at", "trans_column"]

TABLE_MAX = 1 << 16
"""Longest table of :func:`~expertcache.scorer.kernels_feature_state.tables` (bounded memory on long streams;
larger values are computed)."""


# ------------------------------------------------------------------------------ the loop
@njit(cache=True)
def learned_loop(groups, starts, n_items, capacity, spt, codes, mean, scale, mlp, w, W1, b1, w2, lograte,
                 probs, router, roffset, alpha, table_max, item_li, item_e, pop, trans, succp, item_ll):
    """Evict the candidates with the smallest ``(-score, last use, id)``; returns misses, evictions.

    ``probs`` float32 ``[G, k]`` (gate weights aligned with ``groups``) or ``[0, 0]``; ``router``
    float32 ``[G, E]`` with ``roffset [G]`` (item id of expert 0 of each group's layer) or
    ``[0, 0]``; ``alpha``: the router average's rate per observation (RouterView); ``table_max``:
    the longest :func:`tables` (:data:`TABLE_MAX`); prior tables (``pop [L, E]``, ``trans [H, L,
    E, E]``, ``succp [H, L, E]`` float64, ``item_li``/``item_e [n_items]``) or empty arrays;
    ``item_ll [n_items]`` each item's local layer for the online counts, or empty. The feature
    state and its steps are :mod:`expertcache.scorer.kernels_feature_state`'s, the ones the live policy
    calls; this loop adds the cache (residents, protection of the group, real evictions)."""
    G, k = groups.shape
    R = lograte.size
    F = codes.size
    use_gate = probs.shape[0] > 0
    use_router = router.shape[0] > 0
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    # the cache: residents in a list, rpos[item] its index (-1 absent), stamp[item] = last group
    res = np.empty(capacity, dtype=np.int64)
    rpos = np.full(n_items, -1, dtype=np.int64)
    stamp = np.full(n_items, -1, dtype=np.int64)
    # the feature state (kernels_feature_state)
    steps = np.empty((4, n_items), dtype=np.int64)
    last = steps[0]
    count = np.empty(n_items, dtype=np.int64)
    decay = np.empty((R, n_items), dtype=np.float64)
    values = np.empty((4, n_items), dtype=np.float64)
    inferred = np.empty(n_items, dtype=np.bool_)
    # scratch
    cand = np.empty(capacity, dtype=np.int64)
    ckey = np.empty(capacity, dtype=np.float64)
    taken = np.zeros(capacity, dtype=np.bool_)
    out = np.empty(capacity, dtype=np.int64)
    X = np.empty((capacity, F), dtype=np.float64)
    z = np.empty(F, dtype=np.float64)
    hid = np.empty(b1.size, dtype=np.float64)
    noprow = np.zeros(0, dtype=np.float32)
    use_prior = pop.shape[0] > 0
    lat = np.empty((pop.shape[0], k), dtype=np.int64)  # latest group served at each layer
    latn = np.zeros(pop.shape[0], dtype=np.int64)
    use_online = item_ll.size > 0
    M, N, ouse, osteps, olat, olatn = online_arrays(item_ll, item_e, k)  # the online counts (scorer.online)
    es = np.empty(k, dtype=np.int64)
    for s in range(starts.size - 1):
        a = starts[s]
        ex, lage, lcount = tables(min(starts[s + 1] - a + 1, table_max), spt, lograte)
        size = 0
        reset_state(steps, count, decay, values, inferred)
        latn[:] = 0
        reset_online(M, N, ouse, osteps, olatn)
        for g in range(a, starts[s + 1]):
            t = g - a
            row = groups[g]
            m = 0
            for j in range(k):
                e = row[j]
                if e >= 0:
                    stamp[e] = g
                    if rpos[e] < 0:
                        m += 1
            m_inf = not_inferred(row, inferred)
            if use_prior or use_online:  # the current group is known
                observe_group(row, item_li, item_e, lat, latn, use_prior, item_ll, M, N, ouse, osteps, olat, olatn, es)
            if use_router:  # RouterView.advance(t): the current step's row is known
                observe_router(router[g], roffset[g], values, alpha)
            need = m - (capacity - size)
            ev = 0
            if need > 0:
                nc = 0
                for i in range(size):
                    c = res[i]
                    if stamp[c] != g:
                        cand[nc] = c
                        nc += 1
                describe(X, cand, nc, codes, t, spt, steps, count, decay, values, lograte, ex, lage, lcount,
                         item_li, item_e, pop, trans, succp, lat, latn, item_ll, M, N, ouse, osteps, olat, olatn)
                score_keys(X, nc, ckey, mean, scale, z, hid, mlp, w, W1, b1, w2)
                size, ev = _evict(cand, ckey, nc, last, need, m_inf, taken, out, inferred, res, rpos, size)
            for j in range(k):  # insert the misses
                e = row[j]
                if e >= 0 and rpos[e] < 0:
                    res[size] = e
                    rpos[e] = size
                    size += 1
            prow = probs[g] if use_gate else noprow
            access_group(row, prow, t, spt, steps, count, decay, lograte, ex, inferred, values)
            misses[g] = m
            evictions[g] = ev
        for i in range(size):
            rpos[res[i]] = -1
    return misses, evictions


@njit(cache=True)
def _evict(cand, ckey, nc, last, need, m_inf, taken, out, inferred, res, rpos, size):
    """Evict the first ``need`` candidates of ascending ``(key, last use, id)``, and take the first
    ``m_inf`` as evicted for the residency inference; returns the new size and the evictions."""
    n_sel = min(max(m_inf, need), nc)
    order_prefix(cand, ckey, nc, last, n_sel, taken, out)
    ev = 0
    for r in range(n_sel):
        v = out[r]
        if r < m_inf:  # FeatureState takes the first m_inf as evicted
            inferred[v] = False
        if r < need:  # evicted for real
            size = swap_remove(res, rpos, size, v)
            ev += 1
    return size, ev


class LearnedPlan:
    """Run :func:`learned_loop` for one scorer.

    ``codes``: int64 feature codes (:func:`feature_codes`) in the scorer's column order;
    ``weights``: ``(mlp, w, W1, b1, w2)`` as :func:`score_row` takes them; ``context(layout, s)``
    -> a dict of stream ``s``'s arrays (any of ``probs``, ``router``, ``offset``, for the prior
    group ``item_li``, ``item_e``, ``pop``, ``trans``, ``succp``, for the online group ``item_ll``
    and ``item_e``; :func:`learned_loop`), or None
    when the scorer reads no context (then all streams run in one call)."""

    ARGS = {"probs": (np.float32, 2), "router": (np.float32, 2), "offset": (np.int64, 1), "item_li": (np.int64, 1),
            "item_e": (np.int64, 1), "pop": (np.float64, 2), "trans": (np.float64, 4), "succp": (np.float64, 3),
            "item_ll": (np.int64, 1)}

    def __init__(self, codes, mean, scale, weights, lograte, alpha, context=None, gate=False, router=False):
        self.codes = np.ascontiguousarray(codes, dtype=np.int64)
        self.mean = np.ascontiguousarray(mean, dtype=np.float64)
        self.scale = np.ascontiguousarray(scale, dtype=np.float64)
        self.weights = weights
        self.lograte = np.ascontiguousarray(lograte, dtype=np.float64)
        self.alpha = float(alpha)
        self.context = context
        self.uses_gate, self.uses_router = bool(gate), bool(router)
        self.table_max = TABLE_MAX

    def with_context(self, context) -> "LearnedPlan":
        """This scorer's plan reading ``context(layout, s)`` per stream."""
        return LearnedPlan(self.codes, self.mean, self.scale, self.weights, self.lograte, self.alpha, context,
                           gate=self.uses_gate, router=self.uses_router)

    def context_args(self, arrays: dict) -> dict:
        """Every array of :data:`ARGS` in the loop's dtype, empty where ``arrays`` lacks it."""
        a = {}
        for name, (dt, nd) in self.ARGS.items():
            v = arrays.get(name)
            a[name] = np.zeros((0,) * nd, dtype=dt) if v is None else np.ascontiguousarray(v, dtype=dt)
        return a

    def _run(self, groups, starts, n_items, slots, spt, arrays):
        mlp, w, W1, b1, w2 = self.weights
        a = self.context_args(arrays)
        return learned_loop(groups, starts, n_items, slots, float(spt), self.codes, self.mean, self.scale, mlp,
                            w, W1, b1, w2, self.lograte, a["probs"], a["router"], a["offset"], self.alpha,
                            self.table_max, a["item_li"], a["item_e"], a["pop"], a["trans"], a["succp"], a["item_ll"])

    def run(self, layout, capacity):
        slots = pool_slots(layout, capacity)
        if self.context is None:
            return self._run(layout.groups, layout.starts, layout.n_items, slots, layout.steps_per_token, {})
        G = layout.groups.shape[0]
        misses, evictions = np.zeros(G, dtype=np.int32), np.zeros(G, dtype=np.int32)
        for s in range(layout.num_streams):  # one call per stream: context arrays stay per stream
            a, b = int(layout.starts[s]), int(layout.starts[s + 1])
            starts = np.array([0, b - a], dtype=np.int64)
            misses[a:b], evictions[a:b] = self._run(layout.groups[a:b], starts, layout.n_items, slots,
                                                    layout.steps_per_token, self.context(layout, s))
        return misses, evictions
