"""Side information of one stream: what the router said at each step (gate weights, router softmax).

A policy that sets ``wants_context = True`` receives a :class:`StreamContext` through
:meth:`~expertcache.policies.Policy.set_context` before each ``reset``; the simulator's Python path
(:func:`expertcache.sim.replay_layout` with no compiled plan) builds one per stream from the trace
the layout came from. Every other policy is called exactly as before.

Invariant (causality): a context holds rows for every step of the stream, but a policy may read
row ``t`` only once step ``t`` has begun: the router has run for that step (its probabilities are
known before the experts are needed), the steps after it have not. :class:`RouterView` enforces
this for the router rows: it only ever advances to the step it is asked about.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace.model_signals import SignalRows, signal_rows


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
