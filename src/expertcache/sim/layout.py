"""Turning a trace into the streams a replay serves.

A *stream* is one pool's life: a run of access groups served from an empty pool. A *group* is the
set of items one step requests: a token's experts at one layer (per-layer pools), or one layer of
a token in a global pool, whose items are ``(layer, expert)`` pairs numbered ``layer * E + expert``.
All streams are concatenated into one ``[G, k]`` array so a compiled loop serves them in one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
import numpy as np

from ..errors import ConfigError
from ..kernels import next_use
from ..trace import Trace
from ..trace.units import accepted_per_row, iteration_ids

from .options import StreamOptions


@dataclass(frozen=True, eq=False)
class StreamLayout:
    """Access groups of every stream, and where each group sits in the trace.

    Attributes:
        groups: int32 ``[G, k]`` item ids, -1 pads; streams concatenated. Per-layer pools order
            the groups layer-major (``g = l * T + t``), a global pool token-major (``g = t * L + l``).
        starts: int64 ``[S + 1]`` group offsets of the streams.
        n_items: size of the item space (E per-layer, ``L * E`` global).
        steps_per_token: groups per token in one stream (1 per-layer, ``L`` global).
        token_scored: bool ``[T]`` whether each row (token, or router pass of an engine trace) is
            inside the scored window.
        row_tokens: int64 ``[T]`` accepted tokens each row stands for (1 unless the trace carries
            the ``accepted`` extra of an engine trace: :mod:`expertcache.trace.units`).
        row_starts_iteration: bool ``[T]`` whether each row opens an engine iteration (every row,
            unless the trace carries the ``iteration`` extra).
        layer_ids: model layer ids of the selected columns.
        tokens: scored accepted tokens (the ``T`` of copies per token).
        iterations: scored engine iterations (the denominator of copies per iteration).
        streamed: int32 ``[G]`` requests of each group served without admission (``admission``
            other than ``"all"``; they are removed from ``groups`` and count as misses).
        source, cols: the trace the layout came from and its selected layer columns (side
            information for policies that read it: :mod:`expertcache.trace.context`).
    """

    groups: np.ndarray
    starts: np.ndarray
    n_items: int
    steps_per_token: int
    token_scored: np.ndarray
    layer_ids: list[int]
    pool: str
    reset: str
    warm: float
    row_tokens: np.ndarray | None = None
    row_starts_iteration: np.ndarray | None = None
    admission: str = "all"
    streamed: np.ndarray | None = None
    source: Trace | None = None
    cols: np.ndarray | None = None

    @property
    def num_streams(self) -> int:
        return len(self.starts) - 1

    @property
    def tokens(self) -> int:
        if self.row_tokens is None:
            return int(np.count_nonzero(self.token_scored))
        return int(self.row_tokens[self.token_scored].sum())

    @property
    def iterations(self) -> int:
        if self.row_starts_iteration is None:
            return int(np.count_nonzero(self.token_scored))
        return int(np.count_nonzero(self.row_starts_iteration & self.token_scored))

    @cached_property
    def next_use(self) -> np.ndarray:
        """int64 ``[G, k]``: the next group of the same stream requesting the same item (or NEVER)."""
        return next_use(self.groups, self.starts, self.n_items)

    @cached_property
    def held(self) -> np.ndarray:
        """int64 ``[G]``: the ids each group asks to hold (padding excluded; admitted requests only)."""
        G, k = self.groups.shape
        if G and k and int(self.groups.min()) >= 0:  # no padding (most traces): a min is ~30x cheaper than the count
            return np.full(G, k, dtype=np.int64)
        return np.count_nonzero(self.groups >= 0, axis=1).astype(np.int64, copy=False)

    @cached_property
    def requests(self) -> np.ndarray:
        """int64 ``[G]``: requests of each group: the ids it holds (padding excluded), plus the
        requests served without admission (:attr:`streamed`)."""
        return self.held if self.streamed is None else self.held + self.streamed

    @cached_property
    def widest(self) -> int:
        """The most items one group asks to hold at once (admitted requests only)."""
        return int(self.held.max()) if self.groups.shape[0] else 0

    @cached_property
    def group_layer(self) -> np.ndarray:
        """int64 ``[G]``: the layer index (column of :attr:`layer_ids`) of each group."""
        L, T = len(self.layer_ids), self.token_scored.size
        rows = np.arange(L, dtype=np.int64)
        return np.repeat(rows, T) if self.pool == "layer" else np.tile(rows, T)

    @cached_property
    def group_scored(self) -> np.ndarray:
        """bool ``[G]``: whether each group lies in the scored window."""
        L = len(self.layer_ids)
        return np.tile(self.token_scored, L) if self.pool == "layer" else np.repeat(self.token_scored, L)

    def per_layer(self, x: np.ndarray) -> np.ndarray:
        """Sum a per-group quantity over each layer's scored groups: int64 ``[L]``."""
        L, T = len(self.layer_ids), self.token_scored.size
        grid = x.reshape(L, T) if self.pool == "layer" else x.reshape(T, L).T
        if self.token_scored.all():  # not tokens == T: an engine trace's tokens count accepted tokens, not
            return grid.sum(axis=1, dtype=np.int64)  # rows, and a warm window had then been summed in
        return grid.astype(np.int64) @ self.token_scored.astype(np.int64)

    def stream_groups(self, s: int) -> np.ndarray:
        return self.groups[self.starts[s] : self.starts[s + 1]]


COUNTS_REVISION = 2
"""Bumped whenever a replay of the same trace and options counts otherwise (a fix, never a speed-up):
stored results keyed by the version (``grid``) are then computed again, not reused. 2 (stop 51):
the warm window is ``floor(w x n)`` of the decimal ``w`` (a float floor had warmed one token less,
0.7 x 90), and an engine trace's warm rows stay out when its scored tokens equal its rows."""


def warm_count(warm: float, n: int) -> int:
    """``floor(w * n)``, the warm tokens (or iterations) of a stream of ``n``, with ``w`` read as the
    decimal it was written as: in binary ``0.7 * 90`` is 62.99999999999999, and a float floor had
    scored one token more than the docs' 27 of 90 (``Fraction(repr(w))`` is 7/10 exactly)."""
    return math.floor(Fraction(repr(float(warm))) * int(n))


def build_layout(trace: Trace, options: StreamOptions | None = None, **kwargs) -> StreamLayout:
    """Lay out ``trace`` as streams, shaped by ``options`` (a :class:`~expertcache.sim.options.StreamOptions`)
    or by its fields given as keywords (``pool=``, ``reset=``, ``layers=``, ``warm=``, ``admission=``),
    checked there once.

    ``pool``: ``"layer"`` (one pool per layer, default) or ``"global"`` (one pool keyed by
    ``(layer, expert)``; a token visits its layers in order). ``reset``: ``"sequence"`` (every pool
    starts empty at each sequence, default) or ``"none"`` (carry over). ``layers``: layer ids to
    keep. ``warm``: fraction of each stream's tokens (rounded down) that warms the pool unscored;
    on an engine trace (``iteration`` extra) the fraction counts engine iterations, so a failed
    speculation and its fallback pass fall on the same side. ``admission``: ``"all"`` (every miss
    is inserted: the default, docs/design.md section 2) or ``"second"`` (an expert's first request in a
    stream is streamed without insertion; it is admitted from its second request on).
    """
    if options is not None and kwargs:
        raise TypeError("build_layout: give StreamOptions or keywords, not both")
    if not isinstance(trace, Trace):  # an array had met an AttributeError deep inside
        raise ConfigError(f"trace: expected a Trace (expertcache.Trace.from_arrays(experts, ...) or load_trace(path)), "
                          f"got {type(trace).__name__}")
    opts = options if options is not None else StreamOptions.of(**kwargs)
    pool, reset, layers, warm, admission = opts.pool, opts.reset, opts.layers, opts.warm, opts.admission
    cols = trace.layer_index(layers)
    ex = trace.experts if layers is None else trace.experts[:, cols, :]
    ex = ex.astype(np.int32, copy=False)
    T, L, k = ex.shape
    E = trace.num_experts
    bounds = trace.seq_bounds if reset == "sequence" else np.array([0, T], dtype=np.int64)

    row_tokens, iter_starts = row_units(trace)
    token_scored = np.ones(T, dtype=bool)
    if warm > 0:
        for a, b in zip(bounds[:-1], bounds[1:]):
            if iter_starts is None:
                token_scored[a : a + warm_count(warm, b - a)] = False
            else:  # whole iterations: the first floor(w * n) of the stream's n iterations
                ordinal = np.cumsum(iter_starts[a:b]) - 1
                token_scored[a:b] = ordinal >= warm_count(warm, ordinal[-1] + 1 if b > a else 0)

    if pool == "layer":
        groups = np.ascontiguousarray(ex.transpose(1, 0, 2)).reshape(L * T, k)
        starts = np.r_[(np.arange(L)[:, None] * T + bounds[None, :-1]).ravel(), L * T]
        n_items, spt = E, 1
    else:
        offset = (np.arange(L, dtype=np.int32) * E)[None, :, None]
        groups = np.where(ex >= 0, ex + offset, -1).reshape(T * L, k)
        starts = bounds * L
        n_items, spt = L * E, L
    groups = np.ascontiguousarray(groups, dtype=np.int32)
    streamed = None
    if admission == "second":
        groups, streamed = first_requests_streamed(groups, np.asarray(starts, dtype=np.int64), n_items)
    return StreamLayout(
        groups=groups,
        starts=np.asarray(starts, dtype=np.int64),
        n_items=n_items,
        steps_per_token=spt,
        token_scored=token_scored,
        layer_ids=[trace.layer_ids[c] for c in cols],
        pool=pool,
        reset=reset,
        warm=float(warm),
        row_tokens=row_tokens,
        row_starts_iteration=iter_starts,
        admission=admission,
        streamed=streamed,
        source=trace,
        cols=np.asarray(cols, dtype=np.int64),
    )


def row_units(trace: Trace) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(accepted tokens per row, whether each row opens an engine iteration)`` of an engine
    trace; ``None`` for a trace without the ``accepted`` / ``iteration`` extras (one row = one
    token = one iteration)."""
    row_tokens = accepted_per_row(trace) if "accepted" in trace.extras else None
    starts = None
    if "iteration" in trace.extras:
        ids = iteration_ids(trace)
        starts = np.ones(ids.shape[0], dtype=bool)
        starts[1:] = ids[1:] != ids[:-1]
    return row_tokens, starts


def first_requests_streamed(groups: np.ndarray, starts: np.ndarray, n_items: int) -> tuple[np.ndarray, np.ndarray]:
    """Admission ``"second"``: remove every item's first request in each stream from ``groups``
    (it is streamed, never inserted) and count those per group. Exact for every eviction rule: an
    item never requested before in its stream cannot be resident, so its first request is a miss
    whatever the rule, and leaving the cache untouched is what bypass means."""
    out = groups.copy()
    streamed = np.zeros(groups.shape[0], dtype=np.int64)
    for s in range(starts.size - 1):
        a, b = int(starts[s]), int(starts[s + 1])
        block = out[a:b]
        rows, cols = np.nonzero(block >= 0)
        items = block[rows, cols]
        # first occurrence of each item within this stream (rows are in step order)
        _, first = np.unique(items, return_index=True)
        block[rows[first], cols[first]] = -1
        np.add.at(streamed, a + rows[first], 1)
    return out, streamed

