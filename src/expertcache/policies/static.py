"""``static``: a pin set with bypass (the incumbent tier design; docs/design.md section 2, "Bypass").

The pool holds the ``C`` experts most requested in a profile window and never changes: a request
outside the pin set is a miss whose expert is streamed, not inserted, so nothing is ever evicted.

* Profile: by default the warm window of the stream it serves (``warm`` > 0: the unscored first
  part of each stream -- a (layer, sequence) pair, or one sequence of a global pool -- so each
  sequence, e.g. each domain of a multi-domain trace, gets its own same-domain table); or a whole
  other trace (:meth:`use_profile`, the CLI's ``--profile``: one off-domain table for every
  stream), whose layer ids must include the replayed ones and whose ``num_experts`` must match.
* Pin set: per-layer pools pin each layer's top ``C`` experts; a global pool pins the top ``C``
  ``(layer, expert)`` pairs over all layers. Ties: more requests first, then the smaller layer,
  then the smaller expert id (a table has no recency to break them with).
* Counts: ``hit_rate`` = share of scored requests that hit the pin set; every other scored request
  is a streamed miss, counted in ``copies_total`` and ``copies_steady`` alike (a copy is made,
  nothing is evicted). The pin load itself (``C`` per pool, before the first step) is not a copy
  of the scored window.

The pin set is a table, not a rule the cache consults at eviction time, so ``static`` has no
``keys``: it runs only in the simulator (:func:`expertcache.sim.replay_layout`), with any
capacity >= 1 (``admits = False``).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError, PolicyError
from .base import Policy
from .registry import register


@register
class StaticPins(Policy):
    name = "static"
    admits = False
    takes_profile = True
    stream_local = False

    def __init__(self) -> None:
        super().__init__()
        self.profile = None

    def use_profile(self, trace) -> "StaticPins":
        """Count the pin set's frequencies on ``trace`` (all of it) instead of the warm window."""
        self.profile = trace
        return self

    def reset(self, n_items, future=None, steps_per_token=1):
        raise PolicyError("policy 'static' is a pin set with bypass: it runs in the simulator's replay "
                          "(expertcache replay/sweep), not as an eviction rule of a cache")

    def plan(self, layout):
        return PinPlan(self.profile)


class PinPlan:
    """Streamed misses of a pin set; ``run`` has the compiled plans' signature."""

    def __init__(self, profile=None):
        self.profile = profile

    def run(self, layout, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """``(misses, evictions)`` per group: both the requests outside the pin set."""
        if layout.admission != "all":
            raise ConfigError("--admission: 'static' has its own admission (bypass); "
                              "--admission applies to the lossless rules")
        L = len(layout.layer_ids)
        E = layout.n_items // L if layout.pool == "global" else layout.n_items
        if self.profile is not None:
            keys = group_keys(layout)
            pinned = pin_mask(self.profile_counts(layout, L, E), capacity, layout.pool)
            outside = (keys >= 0) & ~pinned[np.maximum(keys, 0)]
        else:
            if layout.warm <= 0:
                raise ConfigError("policy 'static' pins the most requested experts of a profile window: give "
                                  "--warm W (the warm window is the profile) or --profile TRACE")
            outside = np.zeros(layout.groups.shape, dtype=bool)
            unscored = ~layout.group_scored
            # one table per stream, from its warm window, over the stream's own items: a per-layer
            # stream's are its layer's E expert ids (one row), a global stream's all L x E pairs
            size = layout.n_items
            for a, b in zip(layout.starts[:-1], layout.starts[1:]):
                block = layout.groups[a:b]
                counts = _bincount(block[unscored[a:b]], size).reshape(size // E, E)
                pinned = pin_mask(counts, capacity, layout.pool)
                outside[a:b] = (block >= 0) & ~pinned[np.maximum(block, 0)]
        misses = np.count_nonzero(outside, axis=1).astype(np.int32)
        return misses, misses.copy()

    def profile_counts(self, layout, L: int, E: int) -> np.ndarray:
        """int64 ``[L, E]``: requests of each (layer, expert) over the whole profile trace."""
        prof = self.profile
        if prof.num_experts != E:
            raise ConfigError(f"--profile {prof.source}: it has {prof.num_experts} experts per layer, "
                              f"the replayed trace {E}")
        ex = prof.experts[:, prof.layer_index(layout.layer_ids), :].astype(np.int64)
        keys = np.where(ex >= 0, ex + (np.arange(L) * E)[None, :, None], -1)
        return _bincount(keys, L * E).reshape(L, E)


def group_keys(layout) -> np.ndarray:
    """int64 ``[G, k]``: each request as ``layer index * E + expert`` (-1 pads), in either pool."""
    g = layout.groups.astype(np.int64)
    if layout.pool == "global":
        return g
    return np.where(g >= 0, g + layout.group_layer[:, None] * layout.n_items, -1)


def pin_mask(counts: np.ndarray, capacity: int, pool: str) -> np.ndarray:
    """bool ``[L * E]``: the pin set: top ``capacity`` per layer row, or over all rows for a global
    pool; more requests first, then the smaller (layer, expert)."""
    L, E = counts.shape
    mask = np.zeros(L * E, dtype=bool)
    if pool == "global":
        order = np.lexsort((np.arange(L * E), -counts.ravel()))
        mask[order[:capacity]] = True
        return mask
    for l in range(L):
        order = np.lexsort((np.arange(E), -counts[l]))
        mask[l * E + order[:capacity]] = True
    return mask


def _bincount(keys: np.ndarray, size: int) -> np.ndarray:
    k = keys[keys >= 0]
    return np.bincount(k, minlength=size).astype(np.int64)
