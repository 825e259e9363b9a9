"""Stream-parallel replay: one trace's independent streams split across worker processes.

A stream (a pool's life from empty: one per layer and sequence in per-layer pools, one per
sequence in a global pool with ``reset="sequence"``) shares no state with another, so the
per-group misses and evictions of a contiguous run of streams can be computed apart and
concatenated. The counts are then tallied exactly as :func:`~expertcache.sim.replay.replay_layout`
tallies them, so the result equals serial replay field for field (``seconds`` aside).

Invariants: only policies whose plan depends on nothing but the streams' own groups
(:attr:`~expertcache.policies.Policy.stream_local`, and no side context) are split; any other policy, a layout with a single stream or ``jobs == 1``
replays serially. Workers receive only their streams' groups (memory per worker bounded by its
share).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Sequence

import numpy as np

from ..policies import Policy, make_policy
from .layout import StreamLayout
from .replay import ReplayResult, _tally, check_capacity, replay_layout

def is_stream_local(policy: Policy) -> bool:
    """The policy reads only each stream's own requests: no trace-wide table, scorer or side context."""
    return bool(policy.stream_local) and not policy.wants_context


def replay_streams_parallel(layout: StreamLayout, capacity: int, policies: Sequence["str | Policy"],
                            jobs: int) -> list[ReplayResult]:
    """Replay ``policies`` at ``capacity``, splitting the streams over ``jobs`` processes.

    Equal to ``[replay_layout(layout, capacity, p) for p in policies]`` (a test checks it)."""
    policies = [make_policy(p) for p in policies]
    chunks = split_streams(layout, jobs)
    local = [p for p in policies if is_stream_local(p)]
    counts = {}
    if len(chunks) > 1 and local:
        capacity = check_capacity(layout, capacity)
        specs = [p.spec for p in local]
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=len(chunks), mp_context=get_context("spawn")) as pool:
            parts = list(pool.map(_run_chunk, [(_sub_layout(layout, a, b), capacity, specs) for a, b in chunks]))
        seconds = time.perf_counter() - t0
        for i, spec in enumerate(specs):
            misses = np.concatenate([part[i][0] for part in parts])
            evictions = np.concatenate([part[i][1] for part in parts])
            counts[spec] = (misses, evictions)
    results = []
    for p in policies:
        if p.spec in counts and is_stream_local(p):
            misses, evictions = counts[p.spec]
            r = _tally(layout, capacity, p.spec, misses, evictions, "compiled", seconds)
            r.needs_future = bool(p.needs_future)
        else:
            r = replay_layout(layout, capacity, p)
        results.append(r)
    return results


def split_streams(layout: StreamLayout, jobs: int) -> list[tuple[int, int]]:
    """At most ``jobs`` contiguous runs of streams ``[a, b)`` with about equal group counts."""
    S = layout.num_streams
    if S <= 1 or jobs <= 1:
        return [(0, S)]
    G = int(layout.starts[-1])
    cuts = np.searchsorted(layout.starts, np.linspace(0, G, min(jobs, S) + 1)[1:-1])
    bounds = sorted({0, S, *(int(c) for c in cuts if 0 < c < S)})
    return list(zip(bounds[:-1], bounds[1:]))


def _sub_layout(layout: StreamLayout, a: int, b: int) -> StreamLayout:
    """Streams ``[a, b)`` alone (their groups and offsets; no trace attached)."""
    g0, g1 = int(layout.starts[a]), int(layout.starts[b])
    return dataclasses.replace(
        layout, groups=layout.groups[g0:g1], starts=layout.starts[a:b + 1] - g0,
        streamed=None if layout.streamed is None else layout.streamed[g0:g1], source=None, cols=None)


def _run_chunk(job) -> list[tuple[np.ndarray, np.ndarray]]:
    layout, capacity, specs = job
    out = []
    for spec in specs:
        plan = make_policy(spec).plan(layout)
        out.append(plan.run(layout, capacity))
    return out
