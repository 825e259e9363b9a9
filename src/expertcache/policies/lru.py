"""``lru``: evict the candidate whose last use is oldest."""

from __future__ import annotations

import numpy as np

from ..kernels import LRUPlan
from .base import Policy
from .registry import register


@register
class LRU(Policy):
    name = "lru"
    stack_curve = True

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        self.last = np.full(self.n_items, -1, dtype=np.int64)

    def on_access(self, items, t):
        self.last[items] = t

    def keys(self, candidates, t):
        return self.last[candidates].astype(np.float64)

    def plan(self, layout):
        return LRUPlan()
