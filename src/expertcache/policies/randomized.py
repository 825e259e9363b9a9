"""``random[:seed]``: evict a uniformly random candidate, reproducibly.

Each candidate's key at step t is a hash of (seed, t, item) (splitmix64), so every implementation
draws the same victims."""

from __future__ import annotations

import numpy as np

from ..kernels import MIX_M1 as _M1
from ..kernels import MIX_M2 as _M2
from ..kernels import MIX_M3 as _M3
from ..kernels import RandomPlan
from .base import Policy, parse_int
from .registry import register


def hash_keys(seed: int, t: int, items: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from splitmix64(seed * M1 + t * M2 + item * M3): the reference
    twin of :func:`expertcache.kernels.mix64`, written independently with numpy."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * _M1 + np.uint64(t) * _M2 + np.asarray(items, dtype=np.uint64) * _M3
        x = (x ^ (x >> np.uint64(30))) * _M2
        x = (x ^ (x >> np.uint64(27))) * _M3
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


@register
class Random(Policy):
    name = "random"

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = int(seed)

    @classmethod
    def from_arg(cls, arg):
        return cls() if arg is None else cls(parse_int(arg, "random:seed", 0))

    @property
    def spec(self):
        return f"random:{self.seed}"

    def keys(self, candidates, t):
        return hash_keys(self.seed, t, candidates)

    def plan(self, layout):
        return RandomPlan(self.seed)
