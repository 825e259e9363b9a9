"""The cache-hit reward and GRPO's group-normalised advantages (numpy only, no torch).

``lru_hit_rate``: the hit rate of a simulated LRU cache of ``capacity`` slots at one layer over
one generation's routing, served by :class:`expertcache.cache.ExpertCache` with the registered
``lru`` policy (the same cache step the simulator and the live harness use). Definition:

* the pool starts empty; the first ``warm`` router passes (the prompt's tokens) are served but
  not scored, so the prompt fills and warms the pool as a serving cache's prefill would;
* every later pass (one generated token each) requests its ``k`` experts;
  ``hit rate = hits / requests`` over those passes (a hit: the expert was resident before the
  pass; fill misses of a still-filling pool are misses);
* no scored pass: NaN.

It equals ``1 - copies_total / requests`` of :func:`expertcache.replay` on the scored passes
when ``warm = 0`` (checked in tests).

``group_advantages``: ``(r - mean(r)) / (std(r) + eps)`` over one group's rewards (population
std); a group whose rewards are all equal (std below ``eps``) gets zero advantages: it carries
no preference, so it moves nothing.
"""

from __future__ import annotations

import numpy as np

from ..cache import ExpertCache
from ..errors import ConfigError

REWARDS = ("lru-hit",)
EPS = 1e-4


def lru_hit_rate(experts, capacity: int, num_experts: int, warm: int = 0) -> float:
    """Hit rate of an LRU pool of ``capacity`` over ``experts`` (``[T, k]`` ids, -1 padding) after
    ``warm`` unscored passes; see the module docstring."""
    experts = np.asarray(experts, dtype=np.int64)
    if experts.ndim != 2:
        raise ConfigError(f"routing must be [passes, k], got shape {experts.shape}")
    if not 0 <= warm <= experts.shape[0]:
        raise ConfigError(f"warm: {warm} passes outside [0, {experts.shape[0]}]")
    cache = ExpertCache(capacity, "lru", num_experts)
    hits = requests = 0
    for t, row in enumerate(experts):
        step = cache.prepare(row)
        if t >= warm:
            hits += step.hits
            requests += step.items.size
    return hits / requests if requests else float("nan")


def group_advantages(rewards, eps: float = EPS) -> np.ndarray:
    """Group-normalised advantages of one prompt's rewards (float64, same length)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0 or not np.all(np.isfinite(r)):
        raise ConfigError(f"rewards must be a non-empty 1-d array of finite numbers, got {r!r}")
    std = float(r.std())
    if std < eps:
        return np.zeros_like(r)
    return (r - r.mean()) / (std + eps)


def reward_of(name: str, experts, capacity: int, num_experts: int, warm: int = 0) -> float:
    """The reward ``name`` (one of :data:`REWARDS`) of one generation's routing."""
    if name == "lru-hit":
        return lru_hit_rate(experts, capacity, num_experts, warm)
    raise ConfigError(f"reward: {name!r} is not one of {', '.join(REWARDS)}")
