"""``decayed[:beta]``: evict the lowest exponentially decayed use count.

The score of an item at step t is ``sum over its past uses u of beta ** ((t - u) / steps_per_token)``
(beta per token, default 0.95). All residents decay at the same rate, so their order only changes
when one of them is used: the order of ``log(score at last use) + c * (step of last use)``, with
``c = -ln(beta) / steps_per_token``, is the order of their current scores. That key is fixed from
one use of an item to the next, so the compiled replay keeps residents in a heap. The reference
methods and the compiled plan share the two scalar functions below, so they agree exactly.
"""

from __future__ import annotations

import math

import numpy as np

from .._jit import njit
from ..kernels import StaticKeyPlan
from .base import Policy, parse_float
from .registry import register


@njit(cache=True, inline="always")
def _updated_score(score_at_last, elapsed, c):
    """Score right after a use, ``elapsed`` steps after the previous one."""
    return score_at_last * math.exp(-c * elapsed) + 1.0


@njit(cache=True, inline="always")
def _order_key(score_at_last, last, c):
    return math.log(score_at_last) + c * last


@njit(cache=True)
def _access(score, updated, items, t, c):
    for e in items:
        score[e] = 1.0 if updated[e] < 0 else _updated_score(score[e], t - updated[e], c)
        updated[e] = t


@njit(cache=True)
def _keys(score, updated, candidates, c):
    out = np.empty(candidates.size, dtype=np.float64)
    for i in range(candidates.size):
        out[i] = _order_key(score[candidates[i]], updated[candidates[i]], c)
    return out


@njit(cache=True)
def access_keys(groups, starts, n_items, c):
    """``[G, k]``: the order key each access leaves its item with (streams reset the scores)."""
    G, k = groups.shape
    keys = np.zeros((G, k), dtype=np.float64)
    score = np.zeros(n_items, dtype=np.float64)
    updated = np.full(n_items, -1, dtype=np.int64)
    for s in range(starts.size - 1):
        a, b = starts[s], starts[s + 1]
        for g in range(a, b):
            t = g - a
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    score[e] = 1.0 if updated[e] < 0 else _updated_score(score[e], t - updated[e], c)
                    updated[e] = t
                    keys[g, j] = _order_key(score[e], t, c)
        for g in range(a, b):
            for j in range(k):
                e = groups[g, j]
                if e >= 0:
                    updated[e] = -1
    return keys


@register
class Decayed(Policy):
    name = "decayed"
    takes_parameter = True

    def __init__(self, beta: float = 0.95):
        super().__init__()
        self.beta = parse_float(beta, "decayed:beta", 0.0, 1.0, lo_open=True)

    @property
    def spec(self):
        return f"decayed:{self.beta:g}"

    def rate(self, steps_per_token: int) -> float:
        return -math.log(self.beta) / steps_per_token

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        self.score = np.zeros(self.n_items, dtype=np.float64)
        self.updated = np.full(self.n_items, -1, dtype=np.int64)
        self._c = self.rate(self.steps_per_token)

    def on_access(self, items, t):
        _access(self.score, self.updated, np.asarray(items, dtype=np.int64), t, self._c)

    def keys(self, candidates, t):
        return _keys(self.score, self.updated, np.asarray(candidates, dtype=np.int64), self._c)

    def plan(self, layout):
        c = self.rate(layout.steps_per_token)
        return StaticKeyPlan(lambda lay: access_keys(lay.groups, lay.starts, lay.n_items, c))
