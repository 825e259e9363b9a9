"""The compiled feature state of ``learned:`` scorers: one stream's per-item history, and its steps.

:class:`expertcache.scorer.features.FeatureState` is the Python reference (training events are
collected with it); this module is the compiled implementation of the same definitions, written
once and called by both compiled users:

* the compiled replay (:func:`expertcache.scorer.kernels_learned.learned_loop`), which runs whole streams;
* the live policy (:class:`expertcache.scorer.kernels_live.LiveFeatures`, used by
  :class:`expertcache.policies.learned.Learned`): the cache step of the live harness
  (:class:`expertcache.cache.ExpertCache`), the tier and the simulator's Python engine, one
  compiled call per eviction and one per step.

The steps, in the order of one access step ``t`` of a stream:

1. :func:`observe_group` / :func:`observe_router`: the step has begun, so its group (the prior and
   online groups' latest group per layer, the online pair counts) and its router row are known;
2. at an eviction, :func:`describe` + :func:`score_row` give each candidate's key (minus its
   score), and :func:`order_prefix` the first candidates of ascending ``(key, last use, id)``;
3. :func:`access_group`: the group's items are used at ``t`` (history, decayed counts, gate sums,
   and the residency inference that ``since_load`` reads: at a step with an eviction, the first
   ``m`` candidates of that order are taken as evicted, ``m`` = the group's items not inferred
   resident, exactly as FeatureState infers it).

State arrays (``n`` items, ``R`` decay rates): ``steps`` int64 ``[4, n]`` (last, first, previous
use, inferred load; -1 = never), ``count`` int64 ``[n]``, ``decay`` float64 ``[R, n]`` (each decayed
count right after its last use), ``values`` float64 ``[4, n]`` (last gate weight, gate sum, latest
router probability, its average), ``inferred`` bool ``[n]``. The floats agree with FeatureState's
bit for bit (same operations, same order, scalar ``math.exp``/``math.log1p``; see
:mod:`expertcache.scorer.kernels_features`); ``tests/test_learned_compiled.py`` checks all three paths
(compiled replay, live state, FeatureState) count for count.
"""

from __future__ import annotations

import math

import numpy as np

from .._jit import njit
from .kernels_features import online_at, online_observe, score_row, trans_at

DECAY0 = 5
"""Code of the first ``decay_b`` feature; ``decay_b`` number i (in ``DECAY_RATES`` order) is ``DECAY0 + i``."""
ONLINE = 13
"""Code of ``online_h1`` once the decay codes are folded out (:func:`describe`)."""
POP = 14
"""Code of ``pop`` once the decay codes are folded out; ``trans_hH`` number i is ``POP + 1 + i``."""
LIVE_TABLE = 1 << 12
"""Length of the live state's :func:`tables` (beyond it the same expressions are computed)."""


def feature_codes(decay_rates, horizons=()) -> dict:
    """Name -> code of every feature the compiled state computes (``decay_rates``:
    scorer.features.DECAY_RATES; ``horizons``: scorer.signals.HORIZONS, the ``trans_hH`` features)."""
    names = ["age", "log_age", "count", "log_count", "rate", *(f"decay_{b:g}" for b in decay_rates),
             "last_gap", "mean_gap", "single_use", "since_load", "gate_last", "gate_mean", "router_now", "router_avg",
             "online_h1", "pop", *(f"trans_h{h}" for h in horizons)]
    return {n: i for i, n in enumerate(names)}


@njit(cache=True)
def tables(n, spt, lograte):
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
def exp_at(ex, lograte, r, d, spt):
    """``exp(-lograte[r] * (d / spt))``: from the table below its length, computed beyond it."""
    return ex[r, d] if d < ex.shape[1] else math.exp(-lograte[r] * (d / spt))


@njit(cache=True)
def reset_state(steps, count, decay, values, inferred):
    """A new stream: no item used, none inferred resident."""
    steps[:, :] = -1
    count[:] = 0
    decay[:, :] = 0.0
    values[:, :] = 0.0
    inferred[:] = False


@njit(cache=True)
def online_arrays(item_ll, item_e, k):
    """The online counts of a pool whose items have local layers ``item_ll`` and experts ``item_e``
    (empty arrays when ``item_ll`` is): ``M [L, E, E]``, ``N``/``use [L, E]``, ``steps [L]``, the
    latest group per layer ``lat [L, k]``/``latn [L]``, zeroed."""
    LO = item_ll.max() + 1 if item_ll.size > 0 else 0
    EO = item_e.max() + 1 if item_ll.size > 0 else 0
    return (np.zeros((LO, EO, EO), dtype=np.float64), np.zeros((LO, EO), dtype=np.float64),
            np.zeros((LO, EO), dtype=np.float64), np.zeros(LO, dtype=np.float64), np.zeros((LO, k), dtype=np.int64),
            np.zeros(LO, dtype=np.int64))


@njit(cache=True)
def reset_online(M, N, ouse, osteps, olatn):
    """A new stream for the online counts (empty arrays when the scorer has no online feature)."""
    M[:, :, :] = 0.0
    N[:, :] = 0.0
    ouse[:, :] = 0.0
    osteps[:] = 0.0
    olatn[:] = 0


@njit(cache=True)
def observe_group(row, item_li, item_e, lat, latn, use_prior, item_ll, M, N, ouse, osteps, olat, olatn, es):
    """Step begun with group ``row`` (item ids, -1 pads): it becomes its layer's latest group for the
    prior features (``lat``/``latn`` per prior-table layer ``item_li``) and, with ``item_ll`` non-empty,
    is counted by the online features (PriorFeatures.advance, OnlineFeatures.advance)."""
    use_online = item_ll.size > 0
    n = 0
    lo = 0
    for j in range(row.size):
        e = row[j]
        if e < 0:
            continue
        if use_prior:
            li = item_li[e]
            lat[li, n] = item_e[e]
            latn[li] = n + 1
        if use_online:
            lo = item_ll[e]  # every item of a group is of one layer
            es[n] = item_e[e]
        n += 1
    if use_online and n > 0:
        online_observe(M, N, ouse, osteps, olat, olatn, lo, es, n)


@njit(cache=True, inline="always")
def observe_router(rrow, o, values, alpha):
    """Step begun with router row ``rrow`` (float32 ``[E]``) of the layer whose expert 0 is item ``o``
    (RouterView.advance): the latest probability and its average, rate ``alpha``."""
    for i in range(rrow.size):
        p = float(rrow[i])
        values[2, o + i] = p
        values[3, o + i] += alpha * (p - values[3, o + i])


@njit(cache=True)
def describe(X, cand, nc, codes, t, spt, steps, count, decay, values, lograte, ex, lage, lcount,
             item_li, item_e, pop, trans, succp, lat, latn, item_ll, M, N, ouse, osteps, olat, olatn):
    """``X[i, f]`` = feature ``codes[f]`` of candidate ``cand[i]`` at step ``t`` (FeatureState.features,
    the same operations); ``ex``, ``lage``, ``lcount``: :func:`tables`; ``item_li``, ``item_e``: each
    item's layer (index into the prior tables) and expert; ``lat``, ``latn``: the latest group served
    at each layer; ``item_ll``, ``M`` .. ``olatn``: the online counts per local layer."""
    last, first, prev, loaded = steps[0], steps[1], steps[2], steps[3]
    R = ex.shape[0]
    for f in range(codes.size):
        code = codes[f]
        if DECAY0 <= code < DECAY0 + R:
            r = code - DECAY0
            for i in range(nc):
                c = cand[i]
                X[i, f] = decay[r, c] * exp_at(ex, lograte, r, t - last[c], spt)
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
                v = values[0, c]
            elif code == 10:
                v = values[1, c] / max(float(count[c]), 1.0)
            elif code == 11:
                v = values[2, c]
            elif code == 12:
                v = values[3, c]
            elif code == ONLINE:
                v = online_at(M, N, ouse, osteps, item_ll[c], item_e[c], olat, olatn)
            elif code == POP:
                v = pop[item_li[c], item_e[c]]
            else:
                v = trans_at(trans, succp, code - POP - 1, item_li[c], item_e[c], lat, latn)
            X[i, f] = v


@njit(cache=True)
def score_keys(X, nc, ckey, mean, scale, z, hid, mlp, w, W1, b1, w2):
    """``ckey[i]`` = minus the score of row ``X[i]`` (:func:`score_row`), for ``i < nc``."""
    for i in range(nc):
        ckey[i] = -score_row(X[i], mean, scale, z, hid, mlp, w, W1, b1, w2)


@njit(cache=True)
def order_prefix(cand, ckey, nc, last, n_sel, taken, out):
    """``out[:n_sel]``: the first ``n_sel`` of ``cand[:nc]`` in ascending ``(key, last use, id)``."""
    for i in range(nc):
        taken[i] = False
    for r in range(n_sel):
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
        out[r] = cand[best]


@njit(cache=True)
def access_group(row, prow, t, spt, steps, count, decay, lograte, ex, inferred, values):
    """Group ``row`` used at step ``t`` (FeatureState.on_access, after the step's evictions were
    inferred): an item not inferred resident is loaded now; first use, decayed counts, previous and
    last use, count; with ``prow`` (float32 gate weights aligned with ``row``) non-empty, the gates."""
    last, first, prev, loaded = steps[0], steps[1], steps[2], steps[3]
    R = lograte.size
    use_gate = prow.size > 0
    for j in range(row.size):
        e = row[j]
        if e < 0:
            continue
        if not inferred[e]:
            loaded[e] = t
            inferred[e] = True
        if count[e] == 0:
            first[e] = t
            for r in range(R):
                decay[r, e] = 1.0
        else:
            for r in range(R):  # exp(-lograte[r] * ((t - last) / spt)), as FeatureState.on_access
                decay[r, e] = decay[r, e] * exp_at(ex, lograte, r, t - last[e], spt) + 1.0
        prev[e] = last[e]
        last[e] = t
        count[e] += 1
        if use_gate:
            p = float(prow[j])
            values[0, e] = p
            values[1, e] += p


@njit(cache=True)
def not_inferred(row, inferred):
    """How many items of ``row`` are not inferred resident."""
    m = 0
    for j in range(row.size):
        e = row[j]
        if e >= 0 and not inferred[e]:
            m += 1
    return m
