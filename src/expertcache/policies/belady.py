"""``belady``: farthest-future eviction (clairvoyant). Never requested again counts as farthest."""

from __future__ import annotations

import numpy as np

from ..kernels import StaticKeyPlan, local_steps
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
        return StaticKeyPlan(_farthest_keys)


def _farthest_keys(layout):
    nu = layout.next_use
    G = nu.shape[0]
    start = (np.arange(G) - local_steps(layout.starts, G))[:, None]
    return np.where(nu == NEVER, -np.inf, -(nu - start).astype(np.float64))
