"""``learned:PATH``: evict the candidate a trained scorer ranks highest (``expertcache learn train``).

The scorer file (:mod:`expertcache.scorer.file`) names its features; the policy follows the
stream with a :class:`~expertcache.scorer.features.FeatureState` and, at each eviction, scores the
candidates (:func:`expertcache.scorer.kernels_learned.score_rows`). Key = minus the score, so the cache's
usual order applies (highest score first, ties: least recently used, then smallest id). Features
of the ``gate`` and ``router`` groups need the trace's ``probs`` / ``router_probs``: they reach the
policy through the stream context (:mod:`.context`); a cache without them (the live harness's
context has neither; the tier passes none) or a trace without the field gets one PolicyError line
at the start of the stream. The ``prior`` group reads the scorer's fitted tables, the context's
item map and the groups served so far (any trace, and the live harness).

Compiled plan (:meth:`Learned.plan`): :class:`~expertcache.scorer.kernels_learned.LearnedPlan` runs every
feature of the reuse, gate, router and prior groups in one numba loop, with exactly the Python engine's
counts (same features bit for bit, same scoring arithmetic, same residency inference; checked by
``tests/test_learned_compiled.py``). A scorer naming a feature the loop does not compute, or
needing context the layout cannot give (no trace attached, field absent), has no plan: replay
runs the Python engine as before (and reports the missing field there).

Live, and on the simulator's Python engine, the policy follows the stream with the same compiled
feature state (:class:`~expertcache.scorer.kernels_live.LiveFeatures`: one compiled call per
eviction and one per step) whenever the plan could run it; otherwise (model-side features, missing
tables) with FeatureState. ``reference=True`` always uses FeatureState, the independent Python
implementation the tests cross-check both compiled paths against.

A scorer of reuse features only, loaded from a file, is :attr:`stream_local` (``replay --jobs``
rebuilds it from its path in each worker) and asks for no context.
"""

from __future__ import annotations

import inspect

import numpy as np

from ..trace.context import RouterView, stream_context
from ..errors import PolicyError
from ..scorer.kernels_live import LiveFeatures
from ..scorer.kernels_features import score_rows
from ..scorer.kernels_learned import LearnedPlan, feature_codes
from ..scorer.features import DECAY_RATES, GATE, LOGRATE, ONLINE, PRIOR, REUSE, ROUTER, FeatureState, \
    available_features, feature_needs
from ..scorer.file import load_scorer
from ..scorer.models import Scorer
from ..scorer.online import local_layers, online_fits
from ..scorer.prior import PriorFeatures
from ..scorer.signals import HORIZONS
from .base import Policy
from .registry import register


@register
class Learned(Policy):
    name = "learned"
    wants_context = True
    stream_local = False  # a scorer made in memory has no path to rebuild it from

    def __init__(self, scorer, path: str, from_file: bool = False, reference: bool = False):
        super().__init__()
        self.scorer = scorer
        self.path = str(path)
        self.reference = bool(reference)
        self._needs_memo = None
        self._live = False
        reuse_only = set(scorer.features) <= set(REUSE)
        self.wants_context = not reuse_only
        self.stream_local = bool(from_file and reuse_only)
        self._weights = _weights(scorer)
        self._mean = np.ascontiguousarray(scorer.mean, dtype=np.float64)
        self._scale = np.ascontiguousarray(scorer.scale, dtype=np.float64)

    @classmethod
    def from_arg(cls, arg):
        if not arg:
            raise PolicyError("policy 'learned' needs a scorer file: learned:PATH (made by 'expertcache learn train')")
        return cls(load_scorer(arg), arg, from_file=True)

    @property
    def spec(self):
        return f"learned:{self.path}"

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        have = available_features(self.context)
        lacking = [f for f in self.scorer.features if f not in have]
        if lacking:
            field = feature_needs(lacking[0])
            raise PolicyError(f"policy learned:{self.path}: its feature {lacking[0]!r} needs the trace's {field}, "
                              "which this trace (or this cache) does not provide")
        self.state = None if self.reference else self._live_state()
        self._live = self.state is not None
        if self.state is None:
            self.state = FeatureState(self.n_items, self.context, self.steps_per_token,
                                      getattr(self.scorer, "tables", None))

    @property
    def compiled_state(self):
        """After :meth:`reset`: the stream's compiled feature state (LiveFeatures), or None where
        FeatureState serves (the reference path)."""
        return self.state if self._live else None

    @classmethod
    def describer(cls, names, tables=None) -> "Learned":
        """A learned policy that reads the features ``names`` and scores nothing (zero weights),
        for its :attr:`compiled_state`: the candidates' feature rows of another rule's cache
        (:meth:`~expertcache.scorer.kernels_live.LiveFeatures.describe`); ``tables``: the prior
        group's fitted tables."""
        F = len(names)
        scorer = Scorer(kind="linear", features=tuple(names), mean=np.zeros(F), scale=np.ones(F),
                        weights=[np.zeros(F)])
        scorer.tables = tables
        return cls(scorer, "<features>")

    def _live_state(self):
        """The compiled feature state of this stream, or None where the plan could not run (then FeatureState)."""
        needs = self._needs()
        if needs is None:
            return None
        plan, (gate, router, prior, online) = needs
        ctx = self.context
        if any(needs[1]) and (ctx is None or not self._compilable(ctx.probs, ctx.router, ctx.item_layer is not None)):
            return None
        arrays = _arrays_of(ctx, False, False, self.scorer.tables if prior else None, online) if (prior or online) else {}
        return LiveFeatures(plan, self.n_items, self.steps_per_token, ctx, arrays)

    def _compilable(self, probs, router_probs, item_map: bool = True) -> bool:
        """Whether the compiled state has what this scorer reads (one rule for the compiled replay and
        the live state): gate weights (``probs``), router rows, and for the prior group fitted tables
        with transitions and the pool's item map."""
        _, (gate, router, prior, _) = self._needs()
        if (gate and probs is None) or (router and router_probs is None):
            return False
        tables = getattr(self.scorer, "tables", None)
        return not prior or (tables is not None and getattr(tables, "trans", 0) is not None and item_map)

    def keys(self, candidates, t):
        if self._live:
            return self.state.keys(candidates, t)
        X = np.ascontiguousarray(self.state.features(candidates, t, self.scorer.features), dtype=np.float64)
        k = -score_rows(X, self._mean, self._scale, *self._weights)
        self.state.note_keys(candidates, k, t)
        return k

    def on_access(self, items, t):
        self.state.on_access(items, t)

    def _needs(self):
        """``(plan without context, (gate, router, prior, online))`` when every feature has a code, else None."""
        if self._needs_memo is None:
            codes = feature_codes(DECAY_RATES, HORIZONS)
            feats = self.scorer.features
            if any(f not in codes for f in feats):
                self._needs_memo = (None,)
            else:
                groups = tuple(bool(set(feats) & set(g)) for g in (GATE, ROUTER, PRIOR, ONLINE))
                alpha = inspect.signature(RouterView).parameters["alpha"].default  # FeatureState's router average
                plan = LearnedPlan([codes[f] for f in feats], self._mean, self._scale, self._weights, LOGRATE, alpha,
                                   gate=groups[0], router=groups[1])
                self._needs_memo = (plan, groups)
        return None if self._needs_memo[0] is None else self._needs_memo

    def plan(self, layout):
        needs = self._needs()
        if needs is None:
            return None
        base, (gate, router, prior, online) = needs
        if not any(needs[1]):
            return base
        trace = getattr(layout, "source", None)
        if trace is None or not self._compilable(trace.probs, trace.router_probs):
            return None  # the Python engine reports what is missing
        return base.with_context(_context_arrays(gate, router, self.scorer.tables if prior else None, online))


def _weights(scorer):
    """``(mlp, w, W1, b1, w2)`` as :func:`~expertcache.scorer.kernels_learned.score_row` takes them."""
    F = len(scorer.features)
    f64 = lambda a: np.ascontiguousarray(a, dtype=np.float64)  # noqa: E731
    if scorer.kind == "linear":
        return False, f64(scorer.weights[0]), np.zeros((F, 0)), np.zeros(0), np.zeros(0)
    W1, b1, w2 = scorer.weights
    return True, np.zeros(0), f64(W1), f64(b1), f64(w2)


def _context_arrays(gate: bool, router: bool, tables=None, online: bool = False):
    """``(layout, s) ->`` the arrays of stream ``s`` :class:`~expertcache.scorer.kernels_learned.LearnedPlan`
    reads, from the trace's stream context (:func:`_arrays_of`)."""
    return lambda layout, s: _arrays_of(stream_context(layout, s), gate, router, tables, online)


def _arrays_of(ctx, gate: bool, router: bool, tables=None, online: bool = False) -> dict:
    """The compiled feature state's arrays of one stream context: its gate weights and router rows
    (``gate``/``router``), the prior group's item map and tables (``tables``: Tables or FoldedTables),
    the online group's item map (``online``)."""
    out = {"probs": ctx.probs if gate else None, "router": ctx.router if router else None,
           "offset": ctx.offset if router else None}
    if online:
        if not online_fits(ctx.item_layer.size, ctx.num_experts):
            raise PolicyError(f"policy learned: its feature 'online_h1' needs pair counts over {ctx.item_layer.size} "
                              f"items x E={ctx.num_experts}, above the limit (docs/learn.md, 'Online transitions')")
        out.update(item_ll=local_layers(ctx.item_layer), item_e=ctx.item_expert)
    if tables is not None:  # the Python engine's own lookups: one item map and one set of float64 tables
        pf = PriorFeatures(tables.for_stream(ctx.seq_id) if hasattr(tables, "for_stream") else tables, ctx)
        out.update(item_li=pf.li, item_e=pf.e, pop=pf.pop, trans=pf.trans, succp=pf.succp)
    return out
