"""The live policy of ``learned:`` scorers: one stream's compiled feature state, driven step by step.

:class:`LiveFeatures` is what :class:`expertcache.policies.learned.Learned` runs inside
:class:`expertcache.cache.ExpertCache` (the live harness's cache step, the tier, the simulator's
Python engine): one compiled call per eviction (:func:`live_keys`) and one per step
(:func:`live_access`), over the functions of :mod:`expertcache.scorer.kernels_feature_state` that the
compiled replay calls too, so both compute the same bits.

The state travels as one object, :class:`LiveState` (a numba structref of the arrays, tables and
weights those functions read; its fields are the very arrays :class:`LiveFeatures` holds, not
copies). Passing the 40 arrays one by one cost about 5 µs of argument unboxing per call, a third of
scoring 29 candidates at FLAME-MoE's geometry; one structref costs about 1 µs. Without numba
(``expertcache._jit``) it is a plain object with the same attributes, and the functions run as
Python.
"""

from __future__ import annotations

import functools

import numpy as np

from .._jit import AVAILABLE, njit
from .kernels_feature_state import (LIVE_TABLE, access_group, describe, not_inferred, observe_group, observe_router,
                                    online_arrays, order_prefix, score_keys, tables)

FIELDS = ("pcand", "codes", "spt", "steps", "count", "decay", "values", "lograte", "ex", "lage", "lcount", "X", "ckey",
          "z", "hid", "mean", "scale", "mlp", "w", "W1", "b1", "w2", "item_li", "item_e", "pop", "trans", "succp", "lat",
          "latn", "item_ll", "M", "N", "ouse", "osteps", "olat", "olatn", "use_prior", "es", "inferred", "taken", "out")
"""What the live steps read and write, in the order :func:`_make_state` takes them."""

if AVAILABLE:
    from numba.core import types
    from numba.experimental import structref

    @structref.register
    class LiveStateType(types.StructRef):
        def preprocess_fields(self, fields):
            return tuple((name, types.unliteral(typ)) for name, typ in fields)

    class LiveState(structref.StructRefProxy):
        """One stream's live state (the fields of :data:`FIELDS`)."""

    structref.define_proxy(LiveState, LiveStateType, list(FIELDS))
else:
    class LiveState:  # the same attributes, for the plain-Python path
        """One stream's live state (the fields of :data:`FIELDS`)."""

        def __init__(self, *values):
            for name, value in zip(FIELDS, values):
                setattr(self, name, value)


@njit(cache=True)
def _make_state(pcand, codes, spt, steps, count, decay, values, lograte, ex, lage, lcount, X, ckey, z, hid, mean, scale,
                mlp, w, W1, b1, w2, item_li, item_e, pop, trans, succp, lat, latn, item_ll, M, N, ouse, osteps, olat,
                olatn, use_prior, es, inferred, taken, out):
    """A :class:`LiveState` of these fields, built by compiled code (so its constructor is cached too)."""
    return LiveState(pcand, codes, spt, steps, count, decay, values, lograte, ex, lage, lcount, X, ckey, z, hid, mean,
                     scale, mlp, w, W1, b1, w2, item_li, item_e, pop, trans, succp, lat, latn, item_ll, M, N, ouse,
                     osteps, olat, olatn, use_prior, es, inferred, taken, out)


@njit(cache=True, inline="always")
def _observe(S, row):
    observe_group(row, S.item_li, S.item_e, S.lat, S.latn, S.use_prior, S.item_ll, S.M, S.N, S.ouse, S.osteps, S.olat,
                  S.olatn, S.es)


@njit(cache=True)
def observe_state(S, row):
    """:func:`~expertcache.scorer.kernels_feature_state.observe_group` of group ``row`` on the state ``S``."""
    _observe(S, row)


@njit(cache=True)
def live_keys(cand, t, row, observe, S):
    """Keys of the candidates ``cand`` at step ``t``, kept with them in ``S.pcand``/``S.ckey`` for the
    step's residency inference; returns a copy of the keys. With ``observe``, step ``t``'s group
    ``row`` is observed first (one compiled call for both)."""
    if observe:
        _observe(S, row)
    nc = cand.size
    S.pcand[:nc] = cand
    describe(S.X, cand, nc, S.codes, t, S.spt, S.steps, S.count, S.decay, S.values, S.lograte, S.ex, S.lage, S.lcount,
             S.item_li, S.item_e, S.pop, S.trans, S.succp, S.lat, S.latn, S.item_ll, S.M, S.N, S.ouse, S.osteps, S.olat,
             S.olatn)
    score_keys(S.X, nc, S.ckey, S.mean, S.scale, S.z, S.hid, S.mlp, S.w, S.W1, S.b1, S.w2)
    return S.ckey[:nc].copy()


@njit(cache=True)
def live_describe(cand, keys, t, row, observe, S):
    """The feature rows of the candidates ``cand`` at step ``t`` (a copy), ``keys`` kept with them
    in ``S.pcand``/``S.ckey`` for the step's residency inference (the keys the cache orders them
    by); with ``observe``, step ``t``'s group ``row`` is observed first."""
    if observe:
        _observe(S, row)
    nc = cand.size
    S.pcand[:nc] = cand
    S.ckey[:nc] = keys
    describe(S.X, cand, nc, S.codes, t, S.spt, S.steps, S.count, S.decay, S.values, S.lograte, S.ex, S.lage, S.lcount,
             S.item_li, S.item_e, S.pop, S.trans, S.succp, S.lat, S.latn, S.item_ll, S.M, S.N, S.ouse, S.osteps, S.olat,
             S.olatn)
    return S.X[:nc].copy()


@njit(cache=True)
def live_access(row, prow, t, nc, orow, observe, S):
    """With ``observe``, step ``t``'s group ``orow`` is observed first; then the step's residency
    inference from the keys of its eviction (``S.pcand[:nc]``, ``S.ckey``; ``nc`` = 0 when it evicted
    nothing), then :func:`~expertcache.scorer.kernels_feature_state.access_group` of ``row`` (gate weights ``prow``)."""
    if observe:
        _observe(S, orow)
    if nc > 0:
        n_sel = min(not_inferred(row, S.inferred), nc)
        order_prefix(S.pcand, S.ckey, nc, S.steps[0], n_sel, S.taken, S.out)
        for r in range(n_sel):
            S.inferred[S.out[r]] = False
    access_group(row, prow, t, S.spt, S.steps, S.count, S.decay, S.lograte, S.ex, S.inferred, S.values)


class LiveFeatures:
    """The compiled state of one stream, driven step by step through the policy protocol.

    ``plan``: the scorer's :class:`~expertcache.scorer.kernels_learned.LearnedPlan` (codes, weights);
    ``arrays``: its context arrays for this stream (``item_li``, ``item_e``, ``pop``, ``trans``,
    ``succp`` for the prior group, ``item_ll``/``item_e`` for the online group), or ``{}``;
    ``context``: the stream context (its ``groups`` give each step's group; ``probs``, ``router``,
    ``offset`` the gate and router rows), or None for a scorer of reuse features."""

    def __init__(self, plan, n_items: int, spt: float, context=None, arrays=None):
        self.plan, self.context, self.spt = plan, context, float(spt)
        a = plan.context_args(arrays or {})
        n, R, F = int(n_items), plan.lograte.size, plan.codes.size
        k = max(int(getattr(getattr(context, "groups", None), "shape", (0, 1))[1]), 1)
        L = a["pop"].shape[0]
        ll = a["item_ll"]
        use_prior = L > 0
        self.observes = use_prior or ll.size > 0
        self.router = getattr(context, "router", None) if plan.uses_router else None
        self.probs = getattr(context, "probs", None) if plan.uses_gate else None
        self.follows = self.observes or self.router is not None  # reads each step's group or router row
        self.seen = -1
        self.nc, self.pending_t = 0, -1
        self._noprow = np.zeros(0, dtype=np.float32)
        self._norow = np.zeros(0, dtype=np.int64)
        # the state lives in S; of its arrays only the router's values are also written from Python
        self.values = np.zeros((4, n), dtype=np.float64)
        ex, lage, lcount = _live_tables(self.spt, plan.lograte.tobytes())
        M, N, ouse, osteps, olat, olatn = online_arrays(ll, a["item_e"], k)
        mlp, w, W1, b1, w2 = plan.weights
        self.S = _make_state(
            np.zeros(n, dtype=np.int64), plan.codes, self.spt, np.full((4, n), -1, dtype=np.int64),
            np.zeros(n, dtype=np.int64), np.zeros((R, n), dtype=np.float64), self.values, plan.lograte, ex, lage,
            lcount, np.zeros((n, F)), np.zeros(n), np.zeros(F), np.zeros(b1.size), plan.mean, plan.scale, bool(mlp),
            w, W1, b1, w2, a["item_li"], a["item_e"], a["pop"], a["trans"], a["succp"],
            np.zeros((L, k), dtype=np.int64), np.zeros(L, dtype=np.int64), ll, M, N, ouse, osteps, olat, olatn,
            bool(use_prior), np.zeros(k, dtype=np.int64), np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.bool_),
            np.zeros(n, dtype=np.int64))

    def _begin(self, t: int) -> bool:
        """Step ``t`` is being scored or accessed: observe the steps ``seen + 1 .. t - 1`` that were
        neither (not in the cache's protocol; kept so any caller stays exact) and step ``t``'s router
        row; True when step ``t``'s group is still to be observed, which the compiled call that
        follows does (one call per step, not two)."""
        while self.seen < t - 1:
            s = self.seen + 1
            if self.observes:
                observe_state(self.S, np.asarray(self.context.groups[s], dtype=np.int64))
            self._observe_router(s)
            self.seen = s
        if self.seen >= t:
            return False
        self._observe_router(t)  # disjoint from what observe_group writes: the order does not matter
        self.seen = t
        return self.observes

    def _observe_router(self, s: int) -> None:
        if self.router is not None:
            observe_router(self.router[s], int(self.context.offset[s]), self.values, self.plan.alpha)

    def keys(self, candidates: np.ndarray, t: int) -> np.ndarray:
        observe = self.follows and self._begin(t)
        row = np.asarray(self.context.groups[t], dtype=np.int64) if observe else self._norow
        cand = np.ascontiguousarray(candidates, dtype=np.int64)
        self.nc, self.pending_t = cand.size, t
        return live_keys(cand, t, row, observe, self.S)

    def describe(self, candidates: np.ndarray, keys: np.ndarray, t: int) -> np.ndarray:
        """float64 ``[len(candidates), F]``: the plan's features of ``candidates`` at step ``t``
        (FeatureState.features, the same bits), where the cache orders them by ``keys`` (another
        rule's: the step's residency inference follows them, as FeatureState.note_keys)."""
        observe = self.follows and self._begin(t)
        row = np.asarray(self.context.groups[t], dtype=np.int64) if observe else self._norow
        cand = np.ascontiguousarray(candidates, dtype=np.int64)
        self.nc, self.pending_t = cand.size, t
        return live_describe(cand, np.ascontiguousarray(keys, dtype=np.float64), t, row, observe, self.S)

    def on_access(self, items: np.ndarray, t: int) -> None:
        row = orow = np.ascontiguousarray(items, dtype=np.int64)
        observe = self.follows and self._begin(t)
        nc = self.nc if self.pending_t == t else 0
        prow = self._noprow
        if self.probs is not None:  # the step's row as the context has it (pads skipped), its gate weights aligned
            row, prow = self.context.groups[t], self.context.probs[t]
        live_access(row, prow, t, nc, orow, observe, self.S)
        self.nc, self.pending_t = 0, -1


@functools.lru_cache(maxsize=16)
def _live_tables(spt: float, lograte: bytes):
    """:func:`~expertcache.scorer.kernels_feature_state.tables` of :data:`LIVE_TABLE` entries, once per
    process and ``(spt, lograte)`` (shared: never written)."""
    return tables(LIVE_TABLE, spt, np.frombuffer(lograte, dtype=np.float64).copy())
