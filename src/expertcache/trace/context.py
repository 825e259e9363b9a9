"""Side information of one stream: what the router said at each step (gate weights, router softmax).

A policy that sets ``wants_context = True`` receives a :class:`StreamContext` through
:meth:`~expertcache.policies.Policy.set_context` before each ``reset``; the simulator's Python path
(:func:`expertcache.sim.replay_layout` with no compiled plan) builds one per stream from the trace
the layout came from. Every other policy is called exactly as before.

The live harness (:mod:`expertcache.hf`) gives a :func:`live_context`: its groups grow as the
steps are served (:class:`LiveGroups`), with the item map but no gate weights or router rows.

Invariant (causality): a context holds rows for every step of the stream, but a policy may read
row ``t`` only once step ``t`` has begun: the router has run for that step (its probabilities are
known before the experts are needed), the steps after it have not. :class:`RouterView` enforces
this for the router rows: it only ever advances to the step it is asked about.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model_signals import SignalRows, signal_rows


@dataclass(frozen=True)
class StreamContext:
    """Per-step side information of one stream, aligned with its access groups.

    Attributes:
        groups: int ``[n, k]`` the stream's access groups (item ids, -1 pads), as the cache sees them.
        probs: float32 ``[n, k]`` gate weight of each requested item (the trace's ``probs``), or None.
        router: float32 ``[n, E]`` the router softmax of the layer each step routes (``router_probs``),
            or None.
        offset: int64 ``[n]`` item id of expert 0 of each step's layer (0 per-layer; ``l * E`` in a
            global pool, where items are ``layer * E + expert``).
        steps_per_token: steps per token (1 per-layer; the number of layers in a global pool).
        signals: the model-side signals the stream can read (token ids, next-token distributions,
            hidden summaries: :class:`~expertcache.trace.model_signals.SignalRows`), or None.
        item_layer: int64 ``[n_items]`` the layer id of each item of the stream's pool, or None.
        item_expert: int64 ``[n_items]`` the expert of each item, or None.
        seq_id: the trace's sequence id of the stream (-1 when unknown).
        num_experts: E of the trace (0 when unknown).
    """

    groups: np.ndarray
    probs: np.ndarray | None
    router: np.ndarray | None
    offset: np.ndarray
    steps_per_token: int = 1
    signals: SignalRows | None = None
    item_layer: np.ndarray | None = None
    item_expert: np.ndarray | None = None
    seq_id: int = -1
    num_experts: int = 0


def stream_context(layout, s: int) -> StreamContext | None:
    """The context of stream ``s`` of a :class:`~expertcache.sim.layout.StreamLayout` built from a
    trace (``layout.source``), or None when the layout does not know its trace."""
    trace = getattr(layout, "source", None)
    if trace is None:
        return None
    a, b = int(layout.starts[s]), int(layout.starts[s + 1])
    g = np.arange(a, b, dtype=np.int64)
    cols = np.asarray(layout.cols, dtype=np.int64)
    L, T = cols.size, trace.num_tokens
    if layout.pool == "layer":
        rows, lay = g % T, g // T
        offset = np.zeros(b - a, dtype=np.int64)
    else:
        rows, lay = g // L, g % L
        offset = lay * trace.num_experts
    probs = None if trace.probs is None else np.asarray(trace.probs[rows, cols[lay]], dtype=np.float32)
    router = None if trace.router_probs is None else np.asarray(trace.router_probs[rows, cols[lay]], dtype=np.float32)
    pool_cols = cols[lay[:1]] if layout.pool == "layer" else cols
    signals = signal_rows(trace, rows, pool_cols)
    E = trace.num_experts
    lids = np.asarray(trace.layer_ids, dtype=np.int64)[pool_cols]
    return StreamContext(groups=layout.groups[a:b], probs=probs, router=router, offset=offset,
                         steps_per_token=int(layout.steps_per_token), signals=signals,
                         item_layer=np.repeat(lids, E), item_expert=np.tile(np.arange(E, dtype=np.int64), lids.size),
                         seq_id=int(trace.seq[int(rows[0])]) if rows.size else -1, num_experts=E)


class LiveGroups:
    """The access groups of a live stream (the offload harness), appended as steps are served: row ``t``
    exists once step ``t`` has begun (its request is known), later rows do not exist yet. Indexable
    like a ``[n, width]`` array of item ids (-1 pads)."""

    def __init__(self, width: int):
        self._rows = np.full((64, max(int(width), 1)), -1, dtype=np.int64)
        self.n = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self._rows.shape[1])

    def append(self, items) -> None:
        items = np.asarray(items, dtype=np.int64)
        if self.n == self._rows.shape[0]:
            self._rows = np.concatenate([self._rows, np.full_like(self._rows, -1)])
        self._rows[self.n, : items.size] = items
        self.n += 1

    def __getitem__(self, t):
        if not 0 <= t < self.n:
            raise IndexError(f"live step {t} has not begun (steps so far: {self.n})")
        return self._rows[t]


def live_context(groups: LiveGroups, layer_ids, num_experts: int, steps_per_token: int = 1) -> StreamContext:
    """The context of a live stream over the experts of ``layer_ids`` (one per-layer pool, or a global pool
    numbering items ``layer index * E + expert``): the groups as they are served and the item map; no
    gate weights, router rows or model-side signals (policies needing them stop with one line)."""
    lids = np.asarray(list(layer_ids), dtype=np.int64)
    E = int(num_experts)
    return StreamContext(groups=groups, probs=None, router=None, offset=np.zeros(0, dtype=np.int64),
                         steps_per_token=int(steps_per_token), item_layer=np.repeat(lids, E),
                         item_expert=np.tile(np.arange(E, dtype=np.int64), lids.size), num_experts=E)


class RouterView:
    """The latest router probability seen for every item, advanced one step at a time.

    ``latest[i]`` is item i's probability at the last step ``<= t`` that routed its layer (0 before
    any); ``ema[i]`` its exponential average over those steps (rate ``alpha`` per observation).
    """

    def __init__(self, context: StreamContext, n_items: int, alpha: float = 0.2):
        self.router = context.router
        self.offset = context.offset
        self.alpha = float(alpha)
        self.latest = np.zeros(n_items, dtype=np.float64)
        self.ema = np.zeros(n_items, dtype=np.float64)
        self.seen = -1

    def advance(self, t: int) -> None:
        """Observe the router rows of steps ``seen + 1 .. t`` (never beyond ``t``)."""
        while self.seen < t:
            self.seen += 1
            row = self.router[self.seen].astype(np.float64)
            o = int(self.offset[self.seen])
            self.latest[o : o + row.size] = row
            self.ema[o : o + row.size] += self.alpha * (row - self.ema[o : o + row.size])
