"""``belady``: farthest-future eviction (clairvoyant). Never requested again counts as farthest."""

from __future__ import annotations

import numpy as np

from ..kernels import StaticKeyPlan
from .base import NEVER, Policy
from .registry import register


@register
class Belady(Policy):
    name = "belady"
    needs_future = True

    def keys(self, candidates, t):
        nu = self.future.next_use(candidates, t)
        return np.where(nu == NEVER, -np.inf, -nu.astype(np.float64))

    def plan(self, layout):
        # Key -next_use (group index): within a stream it orders residents exactly as the Python
        # keys above (-(distance), never = -inf: NEVER is larger than any group index).
        return StaticKeyPlan(lambda lay: lay.next_use, negate=True)
