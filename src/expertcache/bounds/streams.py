"""Per-stream copy counts, the unit every bound is stated in (docs/design.md section 2).

A bound is a statement about one stream (one pool's life from empty), so the functions here
count ``copies_total`` per stream rather than per trace. ``steady = max(0, total - C)`` per
stream; a bound summed over streams is the sum of the per-stream steady counts.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..policies import Policy, make_policy
from ..sim.layout import StreamLayout


def bare_layout(groups: np.ndarray, starts: np.ndarray, n_items: int) -> StreamLayout:
    """A layout of access groups that come from no trace (a flattened stream, a random instance).

    ``groups`` is ``[G, k]`` item ids with -1 pads, ``starts`` the ``[S + 1]`` stream offsets.
    It reads as one layer of ``G`` one-group tokens, enough for the compiled replay loops.
    """
    groups = np.ascontiguousarray(groups, dtype=np.int32)
    if groups.ndim == 1:
        groups = groups[:, None]
    return StreamLayout(
        groups=groups,
        starts=np.ascontiguousarray(starts, dtype=np.int64),
        n_items=int(n_items),
        steps_per_token=1,
        token_scored=np.ones(groups.shape[0], dtype=bool),
        layer_ids=[0],
        pool="layer",
        reset="sequence",
        warm=0.0,
    )


def per_stream_sum(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """int64 ``[S]``: a per-group quantity summed over each stream (empty streams give 0)."""
    csum = np.concatenate(([0], np.cumsum(x, dtype=np.int64)))
    return csum[starts[1:]] - csum[starts[:-1]]


def stream_totals(layout: StreamLayout, capacity: int, policy: "str | Policy") -> np.ndarray:
    """int64 ``[S]``: ``copies_total`` of each stream when ``policy`` serves it at ``capacity``.

    Runs the policy's compiled plan, the same code path as :func:`expertcache.sim.replay_layout`.
    """
    policy = make_policy(policy)
    plan = policy.plan(layout)
    if plan is None:
        raise ConfigError(f"policy {policy.spec!r} has no compiled plan to count copies per stream")
    misses, _ = plan.run(layout, int(capacity))
    return per_stream_sum(misses, layout.starts)


def steady(totals: np.ndarray, capacity: int) -> np.ndarray:
    """Steady copies per stream: ``max(0, total - C)``; the first C insertions fill the pool."""
    return np.maximum(np.asarray(totals, dtype=np.int64) - int(capacity), 0)


def distinct_per_stream(layout: StreamLayout) -> np.ndarray:
    """int64 ``[S]``: distinct items each stream requests (a stream never fills a pool larger)."""
    out = np.zeros(layout.num_streams, dtype=np.int64)
    for s in range(layout.num_streams):
        g = layout.stream_groups(s)
        out[s] = np.unique(g[g >= 0]).size
    return out
