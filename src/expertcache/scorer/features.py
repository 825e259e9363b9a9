"""Causal features of eviction candidates (docs/learn.md lists each one and its unit).

:class:`FeatureState` follows one stream the way a policy does (``on_access`` once per step, after
any evictions) and describes the candidates of an eviction at step ``t`` from what happened at
steps ``< t`` plus the current step's router row and request. Invariant (no leakage): the features
of an eviction at step ``t`` are a function of the stream's groups ``0..t-1`` (and, for
``since_load``, the victims the cache chose at those steps), group ``t`` (the request being served;
``online`` and ``prior`` read it), gate weights of steps ``< t``, router rows ``0..t`` and tables
fitted on training sequences; nothing later. ``tests/test_learn.py`` perturbs a trace's future and checks this.

Times are in tokens: step differences divided by ``steps_per_token`` (1 per-layer; the number of
layers in a global pool), so a rate means the same thing in both pools.
"""

from __future__ import annotations

import numpy as np

from .kernels_features import decayed, log1p_each
from ..errors import ConfigError
from ..trace.context import RouterView, StreamContext
from .online import ONLINE, OnlineFeatures, online_fits
from .prior import PRIOR, PriorFeatures
from .signals import DEFAULT_OFF, NEEDS, SIGNAL_GROUPS, SignalFeatures

DECAY_RATES = (0.5, 0.8, 0.95, 0.99)
LOGRATE = -np.log(np.asarray(DECAY_RATES))
"""``-ln b`` per decay rate. ``exp`` and ``log1p`` below go through the scalar helpers of
:mod:`expertcache.scorer.kernels_learned`, so the compiled replay computes the same bits."""

REUSE = ("age", "log_age", "count", "log_count", "rate",
         *(f"decay_{b:g}" for b in DECAY_RATES),
         "last_gap", "mean_gap", "single_use", "since_load")
GATE = ("gate_last", "gate_mean")
ROUTER = ("router_now", "router_avg")
MODEL = tuple(n for names in SIGNAL_GROUPS.values() for n in names)
FEATURES = REUSE + GATE + ROUTER + ONLINE + PRIOR + MODEL
GROUPS = {"reuse": REUSE, "gate": GATE, "router": ROUTER, "online": ONLINE, "prior": PRIOR, **SIGNAL_GROUPS}
"""Feature groups; ``gate`` needs the trace's ``probs``, ``router`` its ``router_probs``; ``online``
(:mod:`.online`) the stream's own transitions; ``prior`` (:mod:`.prior`) routing tables fitted on
training sequences; the model-side groups (:mod:`.signals`: token, next, hidden, ahead) the
capture's signal extras and fitted tables."""
TABLED = PRIOR + MODEL
"""Features that read tables fitted on training sequences (the scorer file carries them)."""


def available_features(context: StreamContext | None, lookahead: bool = True) -> tuple[str, ...]:
    """Names this context can supply: reuse always, gate with ``probs``, router with ``router_probs``,
    online (within its size limit) and prior with the pool's item map (any trace), a model-side group
    with its signal extras (``ahead``, which reads later input ids, only with ``lookahead``)."""
    names = list(REUSE)
    if context is not None and context.probs is not None:
        names += GATE
    if context is not None and context.router is not None:
        names += ROUTER
    items = getattr(context, "item_layer", None)
    if items is not None:
        if online_fits(len(items), getattr(context, "num_experts", 0)):
            names += ONLINE
        names += PRIOR
    sig = getattr(context, "signals", None)
    for g, need in NEEDS.items():
        if sig is not None and all(n in sig.extras for n in need) and (lookahead or g not in DEFAULT_OFF):
            names += GROUPS[g]
    return tuple(names)


def feature_group(name: str) -> str:
    return next(g for g, names in GROUPS.items() if name in names)


def feature_needs(name: str) -> str:
    """The trace field a feature reads beyond the requests (``probs``, ``router_probs``, a signal extra)."""
    g = feature_group(name)
    item_map = "layer/expert item map (a stream context)"
    return {"gate": "probs", "router": "router_probs", "prior": item_map, "online": item_map}.get(g) \
        or NEEDS.get(g, ("",))[-1]


class FeatureState:
    """Per-item history of one stream and the feature rows of eviction candidates.

    Residency (for ``since_load``) is inferred, not reported (a policy is told neither its capacity
    nor its victims): at a step with an eviction the cache evicts the first ``need`` candidates in
    ascending ``(key, last use, item id)`` order; :meth:`note_keys` records the keys the cache used
    so :meth:`on_access` can replay that choice, taking ``need`` = the group's items not resident.
    That is exact once the pool is full; at the pool's first eviction, if a free slot was left,
    one or more extra candidates are taken as evicted and restart their ``since_load`` at their
    next use. The inference is the same in training and in the policy, so the feature is
    consistent; it is off when items are prefetched (the live harness's prefetcher).
    """

    def __init__(self, n_items: int, context: StreamContext | None = None, steps_per_token: int = 1, tables=None):
        self.n = int(n_items)
        self.context = context
        self.spt = float(steps_per_token)
        self.last = np.full(self.n, -1, dtype=np.int64)
        self.first = np.full(self.n, -1, dtype=np.int64)
        self.prev = np.full(self.n, -1, dtype=np.int64)  # the use before the last one
        self.count = np.zeros(self.n, dtype=np.int64)
        self.decay = np.zeros((len(DECAY_RATES), self.n), dtype=np.float64)  # score right after the last use
        self.lograte = LOGRATE
        self.gate_last = np.zeros(self.n, dtype=np.float64)
        self.gate_sum = np.zeros(self.n, dtype=np.float64)
        self.resident = np.zeros(self.n, dtype=bool)
        self.loaded = np.full(self.n, -1, dtype=np.int64)
        self.router = None
        if context is not None and context.router is not None:
            self.router = RouterView(context, self.n)
        self._pending = None  # (t, candidates, keys) of the last eviction
        sig = getattr(context, "signals", None)
        self.signals = None if tables is None or sig is None else SignalFeatures(tables, sig, self.n)
        self.tables, self._prior, self._online = tables, None, None

    # -- updates ------------------------------------------------------------------------------
    def note_keys(self, candidates: np.ndarray, keys: np.ndarray, t: int) -> None:
        """The keys the cache will order ``candidates`` by at step ``t`` (for residency)."""
        self._pending = (t, np.asarray(candidates, dtype=np.int64), np.asarray(keys, dtype=np.float64))

    def on_access(self, items: np.ndarray, t: int) -> None:
        items = np.asarray(items, dtype=np.int64)
        items = items[items >= 0]
        missing = items[~self.resident[items]]
        if self._pending is not None and self._pending[0] == t:
            _, cand, keys = self._pending
            order = np.lexsort((cand, self.last[cand], keys))
            self.resident[cand[order[: missing.size]]] = False
        self._pending = None
        self.loaded[missing] = t
        self.resident[items] = True
        if self.router is not None:
            self.router.advance(t)
        new = self.count[items] == 0
        self.first[items[new]] = t
        el = np.where(self.last[items] >= 0, (t - self.last[items]) / self.spt, 0.0)
        self.decay[:, items] = np.where(new[None, :], 1.0, decayed(self.decay[:, items], self.lograte, el) + 1.0)
        self.prev[items] = self.last[items]
        self.last[items] = t
        self.count[items] += 1
        ctx = self.context
        if ctx is not None and ctx.probs is not None:
            row, p = ctx.groups[t], ctx.probs[t]
            ok = row >= 0
            self.gate_last[row[ok]] = p[ok]
            self.gate_sum[row[ok]] += p[ok]

    # -- features -----------------------------------------------------------------------------
    def features(self, candidates: np.ndarray, t: int, names: tuple[str, ...] = REUSE) -> np.ndarray:
        """float64 ``[len(candidates), len(names)]``: the named features at step ``t``."""
        c = np.asarray(candidates, dtype=np.int64)
        spt = self.spt
        last, count = self.last[c], self.count[c].astype(np.float64)
        age = (t - last) / spt
        cols = {}
        want = set(names)
        cols["age"] = age
        cols["log_age"] = log1p_each(age)
        cols["count"] = count
        cols["log_count"] = log1p_each(count)
        cols["rate"] = count / ((t - self.first[c]) / spt + 1.0)
        if want & {f"decay_{b:g}" for b in DECAY_RATES}:
            now = decayed(self.decay[:, c], self.lograte, age)
            for i, b in enumerate(DECAY_RATES):
                cols[f"decay_{b:g}"] = now[i]
        two = self.prev[c] >= 0
        cols["last_gap"] = np.where(two, (last - self.prev[c]) / spt, 0.0)
        cols["mean_gap"] = np.where(two, (last - self.first[c]) / spt / np.maximum(count - 1, 1), 0.0)
        cols["single_use"] = (~two).astype(np.float64)
        cols["since_load"] = (t - self.loaded[c]) / spt
        if want & set(GATE):
            cols["gate_last"] = self.gate_last[c]
            cols["gate_mean"] = self.gate_sum[c] / np.maximum(count, 1)
        if want & set(ROUTER):
            self.router.advance(t)
            cols["router_now"] = self.router.latest[c]
            cols["router_avg"] = self.router.ema[c]
        if want & set(ONLINE):
            if self._online is None:  # built at the first eviction; it counts the groups so far then
                if getattr(self.context, "item_layer", None) is None:
                    raise ConfigError("the online features need a stream context with the pool's item map")
                self._online = OnlineFeatures(self.context)
            cols.update(self._online.columns(c, t))
        if want & set(PRIOR):
            cols.update(self.prior.columns(c, t, want))
        if want & set(MODEL):
            if self.signals is None:
                raise ConfigError(f"feature {sorted(want & set(MODEL))[0]!r} needs the trace's signal extras and "
                                  "routing tables fitted on training sequences (docs/learn.md, 'Model-side signals')")
            cols.update(self.signals.columns(c, int(self.context.signals.rows[t]), want))
        return np.stack([cols[n] for n in names], axis=1) if names else np.zeros((c.size, 0))

    @property
    def prior(self) -> PriorFeatures:
        """The prior columns' state (built at the first prior feature asked for)."""
        if self._prior is None:
            ctx = self.context
            if self.tables is None or getattr(ctx, "item_layer", None) is None:
                raise ConfigError("the prior features need routing tables fitted on training sequences and a stream "
                                  "context with the pool's item map (docs/learn.md, 'Routing priors')")
            tables = self.tables.for_stream(ctx.seq_id) if hasattr(self.tables, "for_stream") else self.tables
            self._prior = PriorFeatures(tables, ctx)
        return self._prior
