"""Online transitions: which experts follow which, counted on the stream's own past.

The ``online`` feature group needs no training data and no tables (docs/learn.md, "Online
transitions"): while a stream is served, per layer ``l`` of its pool, ``M[l, a, e]`` counts the
pairs of consecutive steps at ``l`` whose first group holds ``a`` and second holds ``e``,
``N[l, a]`` the steps holding ``a`` that have a successor so far, ``use[l, e]`` the steps holding
``e`` and ``steps[l]`` the steps. With ``q = use[l, e] / steps[l]`` (the stream's own usage rate):

* ``online_h1`` = the mean, over the experts ``a`` of the latest group served at the candidate's
  layer, of ``(M[l, a, e] + q) / (N[l, a] + 1)``: the stream's own estimate of P(e at l next step |
  a at l now), add-one smoothed towards ``q``.

Where the routing priors (:mod:`.prior`) carry what training text says, this carries what this
sequence says; it helps where sequences differ (Mixtral's prompts), and it needs no out-of-fold
fitting. Invariant (no leakage): the counts at step ``t`` cover the stream's groups ``0..t`` (group
``t`` is the request being served), never a later one. Both replay paths count and average through
:func:`expertcache.scorer.kernels_features.online_observe` / :func:`~expertcache.scorer.kernels_features.online_at`,
so the compiled loop computes the same bits.
"""

from __future__ import annotations

import numpy as np

from .kernels_features import online_column, online_step

ONLINE = ("online_h1",)
ONLINE_MAX_BYTES = 64 << 20
"""Largest pair-count table (float64 ``[L, E, E]`` over the pool's layers) a stream keeps: a global
pool over many layers of many experts leaves the group out (E = 384: up to 56 layers)."""


def online_bytes(n_items: int, num_experts: int) -> int:
    """Bytes of the pair counts of a pool of ``n_items`` items (layers x E)."""
    return 8 * int(n_items) * int(num_experts)


def online_fits(n_items: int, num_experts: int) -> bool:
    """Whether a pool of ``n_items`` items (layers x E) keeps its pair counts within the limit."""
    return online_bytes(n_items, num_experts) <= ONLINE_MAX_BYTES


def local_layers(item_layer) -> np.ndarray:
    """int64 ``[n_items]``: each item's layer as an index 0.. over the pool's layers (sorted ids)."""
    return np.unique(np.asarray(item_layer, dtype=np.int64), return_inverse=True)[1].astype(np.int64).ravel()


class LatestGroups:
    """Follows a stream's groups step by step (never beyond the step asked about) and keeps the latest
    group served at each layer: ``lat[l, :latn[l]]`` its experts. ``li``/``e``: each item's layer index
    and expert; subclasses add what they count in :meth:`observe`."""

    def __init__(self, groups, li: np.ndarray, e: np.ndarray, num_layers: int):
        self.groups, self.li, self.e = groups, li, e
        self.lat = np.zeros((num_layers, max(groups.shape[1], 1)), dtype=np.int64)
        self.latn = np.zeros(num_layers, dtype=np.int64)
        self.seen = -1

    def advance(self, t: int) -> None:
        """Observe the groups of steps ``seen + 1 .. t``; each becomes its layer's latest."""
        while self.seen < t:
            self.seen += 1
            row = self.groups[self.seen]
            row = row[row >= 0]
            if row.size:
                self.observe(int(self.li[row[0]]), np.ascontiguousarray(self.e[row]))

    def observe(self, li: int, es: np.ndarray) -> None:
        self.lat[li, : es.size] = es
        self.latn[li] = es.size


class OnlineFeatures(LatestGroups):
    """The online columns of one stream (``context``: a stream context with groups and the item map)."""

    def __init__(self, context):
        li = local_layers(context.item_layer)
        L, E = int(li.max()) + 1 if li.size else 0, int(context.num_experts)
        super().__init__(context.groups, li, np.asarray(context.item_expert, dtype=np.int64), L)
        self.M = np.zeros((L, E, E))
        self.N = np.zeros((L, E))
        self.use = np.zeros((L, E))
        self.steps = np.zeros(L)

    def observe(self, li: int, es: np.ndarray) -> None:
        online_step(self.M, self.N, self.use, self.steps, self.lat, self.latn, li, es)

    def columns(self, c: np.ndarray, t: int) -> dict[str, np.ndarray]:
        self.advance(t)
        return {"online_h1": online_column(self.li[c], self.e[c], self.M, self.N, self.use, self.steps, self.lat,
                                           self.latn)}
