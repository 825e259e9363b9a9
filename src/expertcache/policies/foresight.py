"""``foresight:h``: farthest-future eviction that sees only the next h tokens.

Candidates whose next request lies more than h tokens ahead (or never comes) are equal and go
first, least recently used first; among the visible ones the farthest goes. In a global pool the
horizon is ``h * steps_per_token`` steps. ``foresight:0`` sees nothing: it is LRU, and does not
need (is not marked as reading) the future.
"""

from __future__ import annotations

import numpy as np

from .kernels_foresight import ForesightPlan
from .base import Policy, parse_int
from .registry import register


@register
class Foresight(Policy):
    name = "foresight"
    takes_parameter = True
    needs_future = True

    def __init__(self, horizon: int = 16):
        super().__init__()
        self.horizon = parse_int(horizon, "foresight:h", 0, 2**40)
        if self.horizon == 0:  # sees nothing ahead: exactly LRU, so it does not need the future
            self.needs_future = False

    @property
    def spec(self):
        return f"foresight:{self.horizon}"

    def keys(self, candidates, t):
        if self.horizon == 0:  # every next request lies beyond the horizon: all equal, LRU breaks the tie
            return np.full(len(candidates), -np.inf)
        nu = self.future.next_use(candidates, t)
        return np.where(nu - t > self.horizon * self.steps_per_token, -np.inf, -nu.astype(np.float64))

    def plan(self, layout):
        return ForesightPlan(self.horizon * layout.steps_per_token)
