"""Turning a trace into the streams a replay serves.

A *stream* is one pool's life: a run of access groups served from an empty pool. A *group* is the
set of items one step requests: a token's experts at one layer (per-layer pools), or one layer of
a token in a global pool, whose items are ``(layer, expert)`` pairs numbered ``layer * E + expert``.
All streams are concatenated into one ``[G, k]`` array so a compiled loop serves them in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import numpy as np

from ..errors import ConfigError
from ..kernels import next_use
from ..trace import Trace

POOLS = ("layer", "global")
RESETS = ("sequence", "none")


@dataclass(frozen=True, eq=False)
class StreamLayout:
    """Access groups of every stream, and where each group sits in the trace.

    Attributes:
        groups: int32 ``[G, k]`` item ids, -1 pads; streams concatenated. Per-layer pools order
            the groups layer-major (``g = l * T + t``), a global pool token-major (``g = t * L + l``).
        starts: int64 ``[S + 1]`` group offsets of the streams.
        n_items: size of the item space (E per-layer, ``L * E`` global).
        steps_per_token: groups per token in one stream (1 per-layer, ``L`` global).
        token_scored: bool ``[T]`` whether each token is inside the scored window.
        layer_ids: model layer ids of the selected columns.
        tokens: number of scored tokens (the ``T`` of copies per token).
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

    @property
    def num_streams(self) -> int:
        return len(self.starts) - 1

    @property
    def tokens(self) -> int:
        return int(np.count_nonzero(self.token_scored))

    @cached_property
    def next_use(self) -> np.ndarray:
        """int64 ``[G, k]``: the next group of the same stream requesting the same item (or NEVER)."""
        return next_use(self.groups, self.starts, self.n_items)

    @cached_property
    def requests(self) -> np.ndarray:
        """int64 ``[G]``: requests (non-padding ids) of each group."""
        return np.count_nonzero(self.groups >= 0, axis=1)

    def per_layer(self, x: np.ndarray) -> np.ndarray:
        """Sum a per-group quantity over each layer's scored groups: int64 ``[L]``."""
        L, T = len(self.layer_ids), self.token_scored.size
        grid = x.reshape(L, T) if self.pool == "layer" else x.reshape(T, L).T
        if self.tokens == T:
            return grid.sum(axis=1, dtype=np.int64)
        return grid.astype(np.int64) @ self.token_scored.astype(np.int64)

    def stream_groups(self, s: int) -> np.ndarray:
        return self.groups[self.starts[s] : self.starts[s + 1]]


def build_layout(
    trace: Trace,
    *,
    pool: str = "layer",
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    warm: float = 0.0,
) -> StreamLayout:
    """Lay out ``trace`` as streams.

    ``pool``: ``"layer"`` (one pool per layer, default) or ``"global"`` (one pool keyed by
    ``(layer, expert)``; a token visits its layers in order). ``reset``: ``"sequence"`` (every pool
    starts empty at each sequence, default) or ``"none"`` (carry over). ``layers``: layer ids to
    keep. ``warm``: fraction of each stream's tokens (rounded down) that warms the pool unscored.
    """
    if pool not in POOLS:
        raise ConfigError(f"--pool: {pool!r} is not one of {', '.join(POOLS)}")
    if reset not in RESETS:
        raise ConfigError(f"--reset: {reset!r} is not one of {', '.join(RESETS)}")
    if not (0.0 <= warm < 1.0):
        raise ConfigError(f"--warm: {warm} is outside [0, 1)")
    cols = trace.layer_index(layers)
    ex = trace.experts if layers is None else trace.experts[:, cols, :]
    ex = ex.astype(np.int32, copy=False)
    T, L, k = ex.shape
    E = trace.num_experts
    bounds = trace.seq_bounds if reset == "sequence" else np.array([0, T], dtype=np.int64)

    token_scored = np.ones(T, dtype=bool)
    if warm > 0:
        for a, b in zip(bounds[:-1], bounds[1:]):
            token_scored[a : a + int(np.floor(warm * (b - a)))] = False

    if pool == "layer":
        groups = np.ascontiguousarray(ex.transpose(1, 0, 2)).reshape(L * T, k)
        starts = np.r_[(np.arange(L)[:, None] * T + bounds[None, :-1]).ravel(), L * T]
        n_items, spt = E, 1
    else:
        offset = (np.arange(L, dtype=np.int32) * E)[None, :, None]
        groups = np.where(ex >= 0, ex + offset, -1).reshape(T * L, k)
        starts = bounds * L
        n_items, spt = L * E, L
    return StreamLayout(
        groups=np.ascontiguousarray(groups, dtype=np.int32),
        starts=np.asarray(starts, dtype=np.int64),
        n_items=n_items,
        steps_per_token=spt,
        token_scored=token_scored,
        layer_ids=[trace.layer_ids[c] for c in cols],
        pool=pool,
        reset=reset,
        warm=float(warm),
    )
