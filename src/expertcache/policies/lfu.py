"""``lfu``: evict the candidate with the fewest uses so far in this stream."""

from __future__ import annotations

import numpy as np

from ..kernels import StaticKeyPlan, access_history
from .base import Policy
from .registry import register


@register
class LFU(Policy):
    name = "lfu"

    def reset(self, n_items, future=None, steps_per_token=1):
        super().reset(n_items, future, steps_per_token)
        self.count = np.zeros(self.n_items, dtype=np.int64)

    def on_access(self, items, t):
        self.count[items] += 1

    def keys(self, candidates, t):
        return self.count[candidates].astype(np.float64)

    def plan(self, layout):
        return StaticKeyPlan(lambda lay: access_history(lay.groups, lay.starts, lay.n_items)[0])
