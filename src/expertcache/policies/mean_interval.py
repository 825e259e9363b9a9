"""``mean-interval``: evict the largest predicted time to next use, predicting each item's next
request one mean inter-request interval after its last one. An item requested only once has no
interval yet and counts as farthest (ties: least recently used, then smallest id)."""

from __future__ import annotations

import numpy as np

from ..kernels import StaticKeyPlan, access_history, local_steps
from .base import Policy
from .registry import register


def predicted_next(last, first, count):
    """``last + (last - first) / (count - 1)``; ``+inf`` where ``count < 2`` (integer steps and counts)."""
    return _predicted_in_place(np.asarray(last), np.array(first, dtype=np.int64), np.array(count, dtype=np.int64))


def _predicted_in_place(last, first, count):
    """:func:`predicted_next` in ``first``'s own memory, returned as float64, overwriting ``count`` too
    (int64 arrays of one shape; ``last`` broadcasts to it): nothing else of their size is made, where
    the plain expression made six (the compiled plan's keys of a whole trace peaked at 24x its
    arrays). ``last - first`` is taken in integers, exact below 2^53, so every value equals the
    float expression's."""
    np.subtract(last, first, out=first)
    pred = first.view(np.float64)
    np.copyto(pred, first, casting="unsafe")  # element by element in place: int64 to float64, same width
    count -= 1
    with np.errstate(divide="ignore", invalid="ignore"):
        pred /= count
    pred += last
    pred[count < 1] = np.inf
    return pred


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
    """Minus :func:`predicted_next` of every access, its step the access's own."""
    count, first = access_history(layout.groups, layout.starts, layout.n_items)
    keys = _predicted_in_place(local_steps(layout.starts, layout.groups.shape[0])[:, None], first, count)
    return np.negative(keys, out=keys)
