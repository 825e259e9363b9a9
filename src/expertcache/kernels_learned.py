"""Compiled replay of ``learned:`` scorers, and the float arithmetic both replay paths share.

:func:`learned_loop` serves streams exactly as :class:`expertcache.cache.ExpertCache` does
(:mod:`expertcache.kernels`: demand fetch, victims among the residents the group does not
request, ascending ``(key, last use, item id)``, the first ``need`` of that order evicted, pools
empty at each stream start) with key = minus a scorer's score of the candidate's causal features.
Keys change at every step (ages grow), so there is no heap: at each eviction every candidate is
described (feature by feature, :func:`_describe`) and scored, O(C F) linear, O(C F H) mlp.

The loop keeps its own copy of the per-item history :class:`expertcache.learn.features.FeatureState`
keeps (last, first and previous use, count, decayed counts, gate sums, router rows) and replays
FeatureState's residency inference for ``since_load`` (at a step with an eviction the first ``m``
candidates of the cache's order are taken as evicted, ``m`` = the group's items not inferred
resident). It is an independent implementation of the same definitions, and the floats agree bit
for bit: the same operations in the same order, ``exp`` and ``log1p`` always the scalar
``math.exp`` / ``math.log1p`` (FeatureState calls :func:`decayed` and :func:`log1p_each`, not
numpy's vectorised versions, which may round differently; the loop looks the same expressions up
in per-stream tables, :func:`_tables`, indexed by whole steps elapsed and by count), and both paths
score through :func:`score_row` (float64, every sum in index order; not ``einsum``). This assumes
numba without Intel SVML (``numba -s``), which would vectorise ``math.exp`` loops differently.
``tests/test_learned_compiled.py`` checks counts against the Python engine group for group.

Feature codes (:func:`feature_codes`): the reuse group, then ``gate_last``, ``gate_mean``
(``probs``), ``router_now``, ``router_avg`` (``router_probs``), then the ``prior`` group (``pop``,
``trans_hH``: tables fitted on training sequences, :mod:`expertcache.learn.prior`; the loop keeps
the latest group served at each layer, as :class:`~expertcache.learn.prior.PriorFeatures` does, and
both paths average the transition rows through :func:`trans_at`). A scorer naming any other feature
has no compiled plan (the policy falls back to the Python engine).
"""

from __future__ import annotations

import math

import numpy as np

from ._jit import njit
from .kernels import pool_slots, swap_remove
from .kernels_features import decayed, log1p_each, online_at, online_observe, score_row, score_rows, trans_at, trans_column

__all__ = ["LearnedPlan", "decayed", "feature_codes", "learned_loop", "log1p_each", "score_row", "score_rows",
           "trans_at", "trans_column"]

TABLE_MAX = 1 << 16
"""Longest table of :func:`_tables` (bounded memory on long streams; larger values are computed)."""

DECAY0 = 5
"""Code of the first ``decay_b`` feature; ``decay_b`` number i (in ``DECAY_RATES`` order) is ``DECAY0 + i``."""


ONLINE = 13
"""Code of ``online_h1`` once the decay codes are folded out (:func:`_describe`)."""
POP = 14
"""Code of ``pop`` once the decay codes are folded out; ``trans_hH`` number i is ``POP + 1 + i``."""


def feature_codes(decay_rates, horizons=()) -> dict:
    """Name -> code of every feature the loop computes (``decay_rates``: learn.features.DECAY_RATES;
    ``horizons``: learn.signals.HORIZONS, the ``trans_hH`` features in that order)."""
    names = ["age", "log_age", "count", "log_count", "rate", *(f"decay_{b:g}" for b in decay_rates),
             "last_gap", "mean_gap", "single_use", "since_load", "gate_last", "gate_mean", "router_now", "router_avg",
             "online_h1", "pop", *(f"trans_h{h}" for h in horizons)]
    return {n: i for i, n in enumerate(names)}


# ------------------------------------------------------------------------------ the loop
@njit(cache=True)
def _tables(n, spt, lograte):
    """Per elapsed steps ``d < n``: ``exp(-lograte[r] * (d / spt))`` ``[R, n]`` and ``log1p(d / spt)``;
    per count ``c < n``: ``log1p(c)``. The same expressions FeatureState evaluates, so the same bits."""
    R = lograte.size
    ex = np.empty((R, n), dtype=np.float64)
    lage = np.empty(n, dtype=np.float64)
    lcount = np.empty(n, dtype=np.float64)
    for d in range(n):
        age = d / spt
        for r in range(R):
            ex[r, d] = math.exp(-lograte[r] * age)
        lage[d] = math.log1p(age)
        lcount[d] = math.log1p(float(d))
    return ex, lage, lcount


@njit(cache=True, inline="always")
def _exp_at(ex, lograte, r, d, spt):
    """``exp(-lograte[r] * (d / spt))``: from the table below its length, computed beyond it."""
    return ex[r, d] if d < ex.shape[1] else math.exp(-lograte[r] * (d / spt))


@njit(cache=True)
def _describe(X, cand, nc, codes, t, spt, last, first, prev, count, decay, lograte, ex, lage, lcount, loaded,
              gate_last, gate_sum, latest, ema, item_li, item_e, pop, trans, succp, lat, latn,
              item_ll, M, N, use, osteps, olat, olatn):
    """``X[i, f]`` = feature ``codes[f]`` of candidate ``cand[i]`` at step ``t`` (FeatureState.features,
    the same operations); ``ex``, ``lage``, ``lcount``: :func:`_tables` of the stream; ``item_li``,
    ``item_e``: each item's layer (index into the prior tables) and expert; ``lat``, ``latn``: the
    latest group served at each layer (experts, count); ``item_ll``, ``M`` .. ``olatn``: the online
    counts per local layer (:mod:`expertcache.learn.online`)."""
    R = ex.shape[0]
    for f in range(codes.size):
        code = codes[f]
        if DECAY0 <= code < DECAY0 + R:
            r = code - DECAY0
            for i in range(nc):
                c = cand[i]
                X[i, f] = decay[r, c] * _exp_at(ex, lograte, r, t - last[c], spt)
            continue
        if code >= DECAY0 + R:
            code -= R
        for i in range(nc):
            c = cand[i]
            if code == 0:
                v = (t - last[c]) / spt
            elif code == 1:
                d = t - last[c]
                v = lage[d] if d < lage.size else math.log1p(d / spt)
            elif code == 2:
                v = float(count[c])
            elif code == 3:
                v = lcount[count[c]] if count[c] < lcount.size else math.log1p(float(count[c]))
            elif code == 4:
                v = float(count[c]) / ((t - first[c]) / spt + 1.0)
            elif code == 5:
                v = (last[c] - prev[c]) / spt if prev[c] >= 0 else 0.0
            elif code == 6:
                v = (last[c] - first[c]) / spt / max(float(count[c]) - 1.0, 1.0) if prev[c] >= 0 else 0.0
            elif code == 7:
                v = 0.0 if prev[c] >= 0 else 1.0
            elif code == 8:
                v = (t - loaded[c]) / spt
            elif code == 9:
                v = gate_last[c]
            elif code == 10:
                v = gate_sum[c] / max(float(count[c]), 1.0)
            elif code == 11:
                v = latest[c]
            elif code == 12:
                v = ema[c]
            elif code == ONLINE:
                v = online_at(M, N, use, osteps, item_ll[c], item_e[c], olat, olatn)
            elif code == POP:
                v = pop[item_li[c], item_e[c]]
            else:
                v = trans_at(trans, succp, code - POP - 1, item_li[c], item_e[c], lat, latn)
            X[i, f] = v


@njit(cache=True)
def learned_loop(groups, starts, n_items, capacity, spt, codes, mean, scale, mlp, w, W1, b1, w2, lograte,
                 probs, router, roffset, alpha, table_max, item_li, item_e, pop, trans, succp, item_ll):
    """Evict the candidates with the smallest ``(-score, last use, id)``; returns misses, evictions.

    ``probs`` float32 ``[G, k]`` (gate weights aligned with ``groups``) or ``[0, 0]``; ``router``
    float32 ``[G, E]`` with ``roffset [G]`` (item id of expert 0 of each group's layer) or
    ``[0, 0]``; ``alpha``: the router average's rate per observation (RouterView); ``table_max``:
    the longest :func:`_tables` (:data:`TABLE_MAX`); prior tables (``pop [L, E]``, ``trans [H, L,
    E, E]``, ``succp [H, L, E]`` float64, ``item_li``/``item_e [n_items]``) or empty arrays;
    ``item_ll [n_items]`` each item's local layer for the online counts, or empty."""
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
    # FeatureState's history: steps (-1 = never), counts, decayed counts, gate and router values
    steps = np.empty((4, n_items), dtype=np.int64)
    last, first, prev, loaded = steps[0], steps[1], steps[2], steps[3]
    count = np.empty(n_items, dtype=np.int64)
    decay = np.empty((R, n_items), dtype=np.float64)
    values = np.empty((4, n_items), dtype=np.float64)
    gate_last, gate_sum, latest, ema = values[0], values[1], values[2], values[3]
    inferred = np.empty(n_items, dtype=np.bool_)
    # scratch
    cand = np.empty(capacity, dtype=np.int64)
    ckey = np.empty(capacity, dtype=np.float64)
    taken = np.zeros(capacity, dtype=np.bool_)
    X = np.empty((capacity, F), dtype=np.float64)
    z = np.empty(F, dtype=np.float64)
    hid = np.empty(b1.size, dtype=np.float64)
    E = router.shape[1]
    use_prior = pop.shape[0] > 0
    lat = np.empty((pop.shape[0], k), dtype=np.int64)  # latest group served at each layer
    latn = np.zeros(pop.shape[0], dtype=np.int64)
    use_online = item_ll.size > 0
    LO = item_ll.max() + 1 if use_online else 0  # the online counts (learn.online)
    EO = item_e.max() + 1 if use_online else 0
    M = np.zeros((LO, EO, EO), dtype=np.float64)
    N = np.zeros((LO, EO), dtype=np.float64)
    ouse = np.zeros((LO, EO), dtype=np.float64)
    osteps = np.zeros(LO, dtype=np.float64)
    olat = np.empty((LO, k), dtype=np.int64)
    olatn = np.zeros(LO, dtype=np.int64)
    es = np.empty(k, dtype=np.int64)
    lo = 0
    for s in range(starts.size - 1):
        a = starts[s]
        ex, lage, lcount = _tables(min(starts[s + 1] - a + 1, table_max), spt, lograte)
        size = 0
        steps[:, :] = -1
        count[:] = 0
        decay[:, :] = 0.0
        values[:, :] = 0.0
        inferred[:] = False
        latn[:] = 0
        if use_online:
            M[:, :, :] = 0.0
            N[:, :] = 0.0
            ouse[:, :] = 0.0
            osteps[:] = 0.0
            olatn[:] = 0
        for g in range(a, starts[s + 1]):
            t = g - a
            m = 0
            m_inf = 0
            n_lat = 0
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    stamp[e] = g
                    if rpos[e] < 0:
                        m += 1
                    if not inferred[e]:
                        m_inf += 1
                    if use_prior:  # PriorFeatures.advance(t): the current group is known
                        li = item_li[e]
                        lat[li, n_lat] = item_e[e]
                        latn[li] = n_lat + 1
                    if use_online:
                        lo = item_ll[e]  # every item of a group is of one layer
                        es[n_lat] = item_e[e]
                    n_lat += 1
            if use_online and n_lat > 0:  # OnlineFeatures.advance(t)
                online_observe(M, N, ouse, osteps, olat, olatn, lo, es, n_lat)
            if use_router:  # RouterView.advance(t): the current step's row is known
                o = roffset[g]
                for i in range(E):
                    p = float(router[g, i])
                    latest[o + i] = p
                    ema[o + i] += alpha * (p - ema[o + i])
            need = m - (capacity - size)
            ev = 0
            if need > 0:
                nc = 0
                for i in range(size):
                    c = res[i]
                    if stamp[c] != g:
                        cand[nc] = c
                        taken[nc] = False
                        nc += 1
                _describe(X, cand, nc, codes, t, spt, last, first, prev, count, decay, lograte, ex, lage, lcount,
                          loaded, gate_last, gate_sum, latest, ema, item_li, item_e, pop, trans, succp, lat, latn,
                          item_ll, M, N, ouse, osteps, olat, olatn)
                for i in range(nc):
                    ckey[i] = -score_row(X[i], mean, scale, z, hid, mlp, w, W1, b1, w2)
                n_sel = min(max(m_inf, need), nc)
                for r in range(n_sel):  # the r-th candidate of ascending (key, last use, id)
                    best = -1
                    for i in range(nc):
                        if taken[i]:
                            continue
                        if best < 0:
                            best = i
                            continue
                        ci, cb = cand[i], cand[best]
                        if ckey[i] < ckey[best] or (ckey[i] == ckey[best] and (
                                last[ci] < last[cb] or (last[ci] == last[cb] and ci < cb))):
                            best = i
                    taken[best] = True
                    v = cand[best]
                    if r < m_inf:  # FeatureState takes the first m_inf as evicted
                        inferred[v] = False
                    if r < need:  # evicted for real
                        size = swap_remove(res, rpos, size, v)
                        ev += 1
            for j in range(k):  # insert the misses; FeatureState.on_access
                e = groups[g, j]
                if e < 0:
                    continue
                if rpos[e] < 0:
                    res[size] = e
                    rpos[e] = size
                    size += 1
                if not inferred[e]:
                    loaded[e] = t
                    inferred[e] = True
                if count[e] == 0:
                    first[e] = t
                    for r in range(R):
                        decay[r, e] = 1.0
                else:
                    for r in range(R):  # exp(-lograte[r] * ((t - last) / spt)), as FeatureState.on_access
                        decay[r, e] = decay[r, e] * _exp_at(ex, lograte, r, t - last[e], spt) + 1.0
                prev[e] = last[e]
                last[e] = t
                count[e] += 1
                if use_gate:
                    p = float(probs[g, j])
                    gate_last[e] = p
                    gate_sum[e] += p
            misses[g] = m
            evictions[g] = ev
        for i in range(size):
            rpos[res[i]] = -1
    return misses, evictions


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

    def __init__(self, codes, mean, scale, weights, lograte, alpha, context=None):
        self.codes = np.ascontiguousarray(codes, dtype=np.int64)
        self.mean = np.ascontiguousarray(mean, dtype=np.float64)
        self.scale = np.ascontiguousarray(scale, dtype=np.float64)
        self.weights = weights
        self.lograte = np.ascontiguousarray(lograte, dtype=np.float64)
        self.alpha = float(alpha)
        self.context = context
        self.table_max = TABLE_MAX

    def _run(self, groups, starts, n_items, slots, spt, arrays):
        mlp, w, W1, b1, w2 = self.weights
        a = {}
        for name, (dt, nd) in self.ARGS.items():
            v = arrays.get(name)
            a[name] = np.zeros((0,) * nd, dtype=dt) if v is None else np.ascontiguousarray(v, dtype=dt)
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
