"""Stream-parallel replay: one trace's independent streams split across workers.

A stream (a pool's life from empty: one per layer and sequence in per-layer pools, one per
sequence in a global pool with ``reset="sequence"``) shares no state with another, so the
per-group misses and evictions of a contiguous run of streams can be computed apart and
concatenated. The counts are then tallied exactly as :func:`~expertcache.sim.replay.replay_layout`
tallies them, so the result equals serial replay field for field (``seconds`` aside).

Hand-off: the layout's group array (the bulk: 4 bytes per request) is shared, never pickled per
task. The local backend copies it once into shared memory (:mod:`.shm`) and a pool of spawned
processes maps it once each; the Ray backend puts it once into Ray's object store, which workers
on the same node read without a copy. A :class:`StreamReplayer` keeps its workers and the shared
arrays for several replays (capacities, policies), so their start is paid once.

Invariants: only policies whose plan depends on nothing but the streams' own groups
(:attr:`~expertcache.policies.Policy.stream_local`, and no side context) are split; any other
policy, a layout with a single stream or ``jobs == 1`` replays serially in this process. A task
is a run of whole streams ``[a, b)``; its result is its groups' miss and eviction counts.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Sequence

import numpy as np

from .._text import short
from ..errors import ConfigError, is_int
from ..policies import Policy, make_policy
from .layout import StreamLayout
from .replay import ReplayResult, _tally, check_capacity, replay_layout
from .shm import SharedArrays, attach

BACKENDS = ("local", "ray")


def is_stream_local(policy: Policy) -> bool:
    """The policy reads only each stream's own requests: no trace-wide table, scorer or side context."""
    return bool(policy.stream_local) and not policy.wants_context


def replay_streams_parallel(layout: StreamLayout, capacity: int, policies: Sequence["str | Policy"],
                            jobs: int, *, ray: str | None = None) -> list[ReplayResult]:
    """Replay ``policies`` at ``capacity``, splitting the streams over ``jobs`` workers (local
    processes, or Ray tasks when ``ray`` is ``"auto"`` or a cluster address).

    Equal to ``[replay_layout(layout, capacity, p) for p in policies]`` (tests check it)."""
    with StreamReplayer(layout, jobs, ray=ray) as replayer:
        return replayer.replay(capacity, policies)


class StreamReplayer:
    """Workers holding one layout's streams, for any number of :meth:`replay` calls.

    ``with StreamReplayer(layout, jobs=2) as r: r.replay(32, ["lru", "belady"]); r.replay(64, ...)``.
    Workers start lazily, at the first replay that has a stream-local policy to split.
    """

    def __init__(self, layout: StreamLayout, jobs: int, *, ray: str | None = None):
        """``layout`` a :class:`StreamLayout` (``build_layout``), ``jobs`` an integer in ``[1, 2**62]``:
        a ConfigError otherwise (0 and -1 had become 1, 2.5 became 2, infinity an OverflowError)."""
        if not isinstance(layout, StreamLayout):
            raise ConfigError(f"StreamReplayer: layout must be a StreamLayout (build_layout(trace)), got "
                              f"{type(layout).__name__}")
        if not is_int(jobs, 1, 2**62):
            raise ConfigError(f"StreamReplayer: jobs must be an integer in [1, 2**62], got {short(jobs, 40)}")
        self.layout = layout
        self.jobs = int(jobs)
        self.ray_address = ray
        self.chunks = split_streams(layout, self.jobs)
        self._stub = _stub(layout)
        self._shared: SharedArrays | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._ray_cm = None
        self._ray = None
        self._groups_ref = None
        self.start_seconds = 0.0
        """Seconds spent starting workers and handing them the layout (paid once)."""

    def __enter__(self) -> "StreamReplayer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        if self._ray_cm is not None:
            self._groups_ref = None
            cm, self._ray_cm, self._ray = self._ray_cm, None, None
            cm.__exit__(None, None, None)

    def replay(self, capacity: int, policies: Sequence["str | Policy"]) -> list[ReplayResult]:
        """One result per policy, equal to serial replay's (``seconds`` aside)."""
        layout = self.layout
        policies = [make_policy(p) for p in policies]
        local = [p for p in policies if is_stream_local(p)]
        counts, seconds = {}, 0.0
        if len(self.chunks) > 1 and local:
            capacity = check_capacity(layout, capacity)
            specs = [p.spec for p in local]
            self._start()
            t0 = time.perf_counter()
            parts = self._map(capacity, specs)
            seconds = time.perf_counter() - t0
            for i, spec in enumerate(specs):
                counts[spec] = (np.concatenate([part[i][0] for part in parts]),
                                np.concatenate([part[i][1] for part in parts]))
        results = []
        for p in policies:
            if p.spec in counts and is_stream_local(p):
                r = _tally(layout, capacity, p.spec, *counts[p.spec], "compiled", seconds)
                r.needs_future = bool(p.needs_future)
            else:
                r = replay_layout(layout, capacity, p)
            results.append(r)
        return results

    # -- backends ----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._pool is not None or self._ray is not None:
            return
        t0 = time.perf_counter()
        if self.ray_address is None:
            self._shared = SharedArrays(groups=self.layout.groups, starts=self.layout.starts)
            self._pool = ProcessPoolExecutor(max_workers=len(self.chunks), mp_context=get_context("spawn"),
                                             initializer=attach, initargs=(self._shared.spec,))
            list(self._pool.map(_ready, range(len(self.chunks))))  # start every worker now
        else:
            from .backends import ray_session

            self._ray_cm = ray_session(self.ray_address, cpus=self.jobs)
            self._ray = self._ray_cm.__enter__()
            self._groups_ref = self._ray.put((self.layout.groups, self.layout.starts))
        self.start_seconds += time.perf_counter() - t0

    def _map(self, capacity: int, specs: list[str]) -> list:
        jobs = [(self._stub, a, b, capacity, specs) for a, b in self.chunks]
        if self._pool is not None:
            return list(self._pool.map(_run_shared, [(self._shared.spec, *job) for job in jobs]))
        remote = _ray_remote(self._ray)
        return self._ray.get([remote.remote(self._groups_ref, *job) for job in jobs])


def split_streams(layout: StreamLayout, jobs: int) -> list[tuple[int, int]]:
    """At most ``jobs`` contiguous runs of streams ``[a, b)`` with about equal group counts."""
    S = layout.num_streams
    if S <= 1 or jobs <= 1:
        return [(0, S)]
    G = int(layout.starts[-1])
    cuts = np.searchsorted(layout.starts, np.linspace(0, G, min(jobs, S) + 1)[1:-1])
    bounds = sorted({0, S, *(int(c) for c in cuts if 0 < c < S)})
    return list(zip(bounds[:-1], bounds[1:]))


def _stub(layout: StreamLayout) -> StreamLayout:
    """The layout without its bulk (groups, starts, side information): what each task is sent."""
    return dataclasses.replace(layout, groups=np.zeros((0, layout.groups.shape[1]), layout.groups.dtype),
                               starts=np.zeros(1, np.int64), streamed=None, source=None, cols=None)


def _chunk(stub: StreamLayout, groups: np.ndarray, starts: np.ndarray, a: int, b: int) -> StreamLayout:
    """Streams ``[a, b)`` as a layout of their own (views of the shared groups; no copy)."""
    g0, g1 = int(starts[a]), int(starts[b])
    return dataclasses.replace(stub, groups=groups[g0:g1], starts=np.asarray(starts[a:b + 1]) - g0)


def _run(layout: StreamLayout, capacity: int, specs: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [make_policy(spec).plan(layout).run(layout, capacity) for spec in specs]


def _ready(_) -> int:
    """A started worker (the pool spawns workers as tasks arrive: this makes them arrive)."""
    time.sleep(0.05)
    return 0


def _run_shared(job) -> list[tuple[np.ndarray, np.ndarray]]:
    spec, stub, a, b, capacity, specs = job
    arrays = attach(spec)
    return _run(_chunk(stub, arrays["groups"], arrays["starts"], a, b), capacity, specs)


def _run_ray(shared, stub, a, b, capacity, specs):
    groups, starts = shared
    return _run(_chunk(stub, groups, starts, a, b), capacity, specs)


_REMOTE = {}


def _ray_remote(ray):
    """``_run_ray`` as a Ray remote function (made once per process)."""
    if "run" not in _REMOTE:
        _REMOTE["run"] = ray.remote(_run_ray)
    return _REMOTE["run"]
