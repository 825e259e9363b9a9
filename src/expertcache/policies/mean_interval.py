"""``mean-interval``: evict the largest predicted time to next use, predicting each item's next
request one mean inter-request interval after its last one. An item requested only once has no
interval yet and counts as farthest (ties: least recently used, then smallest id)."""

from __future__ import annotations

import numpy as np

from ..kernels import StaticKeyPlan, access_history, local_steps
from .base import Policy
from .registry import register


def predicted_next(last, first, count):
    """``last + (last - first) / (count - 1)``; ``+inf`` where ``count < 2``."""
    last = np.asarray(last, dtype=np.float64)
    first = np.asarray(first, dtype=np.float64)
    count = np.asarray(count)
    with np.errstate(divide="ignore", invalid="ignore"):
        pred = last + (last - first) / (count - 1)
    return np.where(count >= 2, pred, np.inf)


@register
class MeanInterval(Policy):
    name = "mean-interval"

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        self.count = np.zeros(self.n_items, dtype=np.int64)
        self.first = np.zeros(self.n_items, dtype=np.int64)
        self.last = np.zeros(self.n_items, dtype=np.int64)

    def on_access(self, items, t):
        new = items[self.count[items] == 0]
        self.first[new] = t
        self.count[items] += 1
        self.last[items] = t

    def keys(self, candidates, t):
        return -predicted_next(self.last[candidates], self.first[candidates], self.count[candidates])

    def plan(self, layout):
        return StaticKeyPlan(_keys)


def _keys(layout):
    """:func:`predicted_next` of every access, negated, computed in place: the same float64 operations
    on the same values (integers below 2^53 subtract exactly either way), in three ``[G, k]`` arrays
    where the expression made eight (a trace's replay peaked at 24x its arrays)."""
    count, first = access_history(layout.groups, layout.starts, layout.n_items)
    t = local_steps(layout.starts, layout.groups.shape[0])[:, None]
    np.subtract(t, first, out=first)  # last - first, with last the access's own step
    keys = first.astype(np.float64)
    del first
    count -= 1
    with np.errstate(divide="ignore", invalid="ignore"):
        keys /= count
    keys += t
    keys[count < 1] = np.inf
    np.negative(keys, out=keys)
    return keys
