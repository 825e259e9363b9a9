"""Miss-ratio curves: copies and hit rate against capacity, for any policy.

:func:`sweep` lays the trace out once and serves every capacity from that one layout. For ``lru``
it needs no replay at all: LRU with co-requested experts protected is a stack algorithm (see
:mod:`.stack`), so one pass over the trace yields every capacity's counts, equal to
:func:`~expertcache.sim.replay.replay_layout` count for count -- ``copies_total``,
``copies_steady``, hits, per layer, in per-layer and global pools, with warm windows and either
reset. Other policies are replayed at each capacity.

Valid capacities run from the widest group (the most experts one token requests at one layer, i.e.
``k`` on unpadded traces) upwards; beyond ``n_items`` (``E`` per layer, ``L * E`` in a global
pool) nothing changes any more.
"""

from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable, Sequence

import numpy as np

from ...errors import ConfigError, is_int
from ...policies import Policy, make_policy
from ...trace import Trace
from ..gap import as_record, gap_recovered
from ..layout import StreamLayout, build_layout
from ..replay import LayerCounts, ReplayResult, check_capacity, check_policy_list, replay_layout
from .stack import stack_histograms

Progress = Callable[[int], None]
"""Called with a number of finished replays (a one-pass curve counts as one)."""


@dataclass(eq=False)
class MissRatioCurve:
    """One policy's counts at ascending capacities, held as arrays (row ``i`` is capacity
    ``capacities[i]``; column ``j`` is layer ``layers[j]``), with the definitions of
    :class:`~expertcache.sim.replay.ReplayResult`; :attr:`results` gives those objects.

    ``method``: ``"stack"`` (one LRU stack pass) or ``"replay"`` (one replay per capacity).
    ``gap_recovered[i]`` is NaN where undefined (no lru/belady pair swept, or they tie).
    ``needs_future``: the policy reads the recorded future (clairvoyant; an offline reference).
    """

    policy: str
    capacities: np.ndarray
    layer_requests: np.ndarray
    layer_copies_total: np.ndarray
    layer_copies_steady: np.ndarray
    tokens: int
    layers: list[int]
    pool: str
    reset: str
    warm: float
    method: str
    seconds: float
    engine: str = "compiled"
    gap_recovered: np.ndarray | None = None
    needs_future: bool = False
    iterations: int = 0
    admission: str = "all"

    @classmethod
    def from_results(cls, policy: str, results: Sequence[ReplayResult], seconds: float) -> "MissRatioCurve":
        r0 = results[0]
        return cls(
            policy=policy,
            capacities=np.array([r.capacity for r in results], dtype=np.int64),
            layer_requests=np.array([c.requests for c in r0.per_layer], dtype=np.int64),
            layer_copies_total=np.array([[c.copies_total for c in r.per_layer] for r in results], dtype=np.int64),
            layer_copies_steady=np.array([[c.copies_steady for c in r.per_layer] for r in results], dtype=np.int64),
            tokens=r0.tokens, layers=list(r0.layers), pool=r0.pool, reset=r0.reset, warm=r0.warm,
            method="replay", seconds=seconds, engine=r0.engine, needs_future=r0.needs_future,
            iterations=r0.iterations, admission=r0.admission,
        )

    @property
    def requests(self) -> int:
        return int(self.layer_requests.sum())

    @property
    def copies_total(self) -> np.ndarray:
        return self.layer_copies_total.sum(axis=1)

    @property
    def copies_steady(self) -> np.ndarray:
        return self.layer_copies_steady.sum(axis=1)

    @property
    def copies_per_token(self) -> np.ndarray:
        return self.copies_steady / self.tokens if self.tokens else np.full(self.capacities.size, np.nan)

    @property
    def hit_rate(self) -> np.ndarray:
        return 1.0 - self.copies_total / self.requests if self.requests else np.full(self.capacities.size, np.nan)

    @cached_property
    def results(self) -> list[ReplayResult]:
        """One :class:`~expertcache.sim.replay.ReplayResult` per capacity (``seconds``: the curve's
        time divided by the number of capacities)."""
        gap = self.gap_recovered
        return [
            ReplayResult(
                policy=self.policy, capacity=int(c), pool=self.pool, reset=self.reset, warm=self.warm,
                layers=list(self.layers), tokens=self.tokens, requests=self.requests,
                copies_total=int(self.layer_copies_total[i].sum()), copies_steady=int(self.layer_copies_steady[i].sum()),
                per_layer=[
                    LayerCounts(lid, int(self.layer_requests[j]), int(self.layer_copies_total[i, j]),
                                int(self.layer_copies_steady[i, j]))
                    for j, lid in enumerate(self.layers)
                ],
                gap_recovered=None if gap is None else as_record(gap[i]),
                engine=self.engine, seconds=self.seconds / self.capacities.size, needs_future=self.needs_future,
                iterations=self.iterations, admission=self.admission,
            )
            for i, c in enumerate(self.capacities)
        ]

    def at(self, capacity: int) -> ReplayResult:
        """The result at ``capacity`` (which must be on the curve)."""
        hit = np.flatnonzero(self.capacities == capacity)
        if not hit.size:
            raise ConfigError(f"capacity {capacity} is not on the {self.policy} curve")
        return self.results[int(hit[0])]


def capacity_bounds(layout: StreamLayout) -> tuple[int, int]:
    """``(lowest, highest)`` capacities worth sweeping: the widest group and ``n_items``."""
    widest = layout.widest
    return max(widest, 1), max(int(layout.n_items), widest, 1)


def sweep(
    trace: Trace,
    capacities: Iterable[int] | None = None,
    policies: Sequence["str | Policy"] = ("lru",),
    *,
    pool: str = "layer",
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    warm: float = 0.0,
    admission: str = "all",
    engine: str = "auto",
    one_pass: bool = True,
    progress: Progress | None = None,
) -> list[MissRatioCurve]:
    """Miss-ratio curves of ``policies`` at ``capacities`` (default: every capacity from the widest
    group to ``n_items``, or :data:`DEFAULT_GRID` evenly spaced ones when there are more). Replay
    options as in :func:`~expertcache.sim.replay.replay`.

    ``lru`` takes one stack pass when ``one_pass`` (default) and ``engine`` is ``"auto"``; set
    ``one_pass=False`` to replay it at each capacity instead. When both ``lru`` and ``belady`` are
    swept, every curve carries ``gap_recovered`` at each capacity (as :func:`~expertcache.sim.fill_gap`).
    """
    layout = build_layout(trace, pool=pool, reset=reset, layers=layers, warm=warm, admission=admission)
    return sweep_layout(layout, capacities, policies, engine=engine, one_pass=one_pass, progress=progress)


def sweep_layout(
    layout: StreamLayout,
    capacities: Iterable[int] | None = None,
    policies: Sequence["str | Policy"] = ("lru",),
    *,
    engine: str = "auto",
    one_pass: bool = True,
    progress: Progress | None = None,
    jobs: int = 1,
    ray: str | None = None,
) -> list[MissRatioCurve]:
    """:func:`sweep` on prepared streams. ``jobs`` > 1 or ``ray`` replays each capacity with the
    streams split over workers started once for the whole sweep (:class:`~expertcache.sim.parallel.StreamReplayer`;
    the same numbers)."""
    check_policy_list(policies)
    with contextlib.ExitStack() as stack:
        replayer = None
        if (jobs > 1 or ray is not None) and engine != "python":
            from ..parallel import StreamReplayer

            replayer = stack.enter_context(StreamReplayer(layout, jobs, ray=ray))
        return _sweep(layout, _capacities(layout, capacities), policies, engine, one_pass, progress, replayer)


def _sweep(layout, caps, policies, engine, one_pass, progress, replayer) -> list[MissRatioCurve]:
    tick = progress or (lambda n: None)
    curves = []
    for spec in policies:
        policy = make_policy(spec)
        stack_fits = len(layout.layer_ids) * (layout.n_items + 1) <= MAX_STACK_CELLS
        if policy.stack_curve and one_pass and engine == "auto" and stack_fits:
            curve = _lru_curve(layout, np.asarray(caps, dtype=np.int64))
            curve.needs_future = bool(policy.needs_future)
            curves.append(curve)
            tick(1)
            continue
        t0 = time.perf_counter()
        results = []
        for c in caps:  # a fresh policy object per replay unless the caller handed one in
            each = make_policy(spec) if isinstance(spec, str) else policy
            if replayer is not None:
                results.append(replayer.replay(c, [each])[0])
            else:
                results.append(replay_layout(layout, c, each, engine=engine))
            tick(1)
        curves.append(MissRatioCurve.from_results(policy.spec, results, time.perf_counter() - t0))
    _fill_gaps(curves)
    return curves


def lru_curve(layout: StreamLayout, capacities: Iterable[int] | None = None) -> MissRatioCurve:
    """LRU's curve from one stack pass: equal, count for count, to replaying each capacity."""
    return _lru_curve(layout, np.asarray(_capacities(layout, capacities), dtype=np.int64))


def _lru_curve(layout: StreamLayout, caps: np.ndarray) -> MissRatioCurve:
    """:func:`lru_curve` at capacities already checked (ascending int64)."""
    t0 = time.perf_counter()
    depth, first = _histograms(layout)
    requests = depth.sum(axis=1)
    col = np.minimum(caps, layout.n_items)
    beyond = requests[:, None] - np.cumsum(depth, axis=1)  # [:, c]: requests of finite depth > c
    misses = (beyond[:, col] + depth[:, :1]).T  # [n, L]; depth[:, 0] = first requests
    steady = misses - np.cumsum(first, axis=1)[:, col].T  # minus the fill among the first c items
    if layout.streamed is not None:  # first requests served without insertion (admission "second")
        streamed = layout.per_layer(layout.streamed)
        requests, misses, steady = requests + streamed, misses + streamed[None, :], steady + streamed[None, :]
    return MissRatioCurve(
        policy="lru", capacities=caps, layer_requests=requests, layer_copies_total=misses,
        layer_copies_steady=steady, tokens=layout.tokens, layers=list(layout.layer_ids), pool=layout.pool,
        reset=layout.reset, warm=layout.warm, method="stack", seconds=time.perf_counter() - t0, engine="stack",
        iterations=layout.iterations, admission=layout.admission,
    )


def _fill_gaps(curves: Sequence[MissRatioCurve]) -> None:
    """``gap_recovered`` of every curve at every capacity, when ``lru`` and ``belady`` are swept:
    ``(steady(lru) - steady(p)) / (steady(lru) - steady(belady))``, NaN where they tie."""
    by_name = {c.policy: c for c in curves}
    if "lru" not in by_name or "belady" not in by_name:
        return
    hi, lo = by_name["lru"].copies_steady, by_name["belady"].copies_steady
    for c in curves:
        c.gap_recovered = np.atleast_1d(gap_recovered(c.copies_steady, hi, lo))
        c.__dict__.pop("results", None)  # rebuild the result objects with their gaps


def _histograms(layout: StreamLayout) -> tuple[np.ndarray, np.ndarray]:
    """Run :func:`.stack.stack_histograms` with each group's layer row and scored flag."""
    return stack_histograms(layout.groups, layout.starts, layout.n_items, layout.group_layer, layout.group_scored,
                            len(layout.layer_ids))


DEFAULT_GRID = 1024
"""The default sweep holds every capacity when there are at most this many, else this many
evenly spaced ones, both ends included (a global pool of a large model has millions)."""

MAX_STACK_CELLS = 1 << 26
"""Largest ``layers x (items + 1)`` histogram the one-pass LRU curve builds (512 MB per table);
beyond it LRU is replayed at each capacity, with the same counts."""


def _capacities(layout: StreamLayout, capacities: Iterable[int] | None) -> list[int]:
    if capacities is None:
        lo, hi = capacity_bounds(layout)
        if hi - lo + 1 <= DEFAULT_GRID:
            return list(range(lo, hi + 1))
        return sorted({int(round(x)) for x in np.linspace(lo, hi, DEFAULT_GRID)})
    values = list(capacities)
    for c in values:
        if not is_int(c):
            check_capacity(layout, c)  # raises the replay's message
    caps = sorted({int(c) for c in values})
    if not caps:
        raise ConfigError("capacities: none given")
    check_capacity(layout, caps[0])  # the smallest must hold the widest group
    check_capacity(layout, caps[-1])  # and the largest fit int64's arithmetic
    return caps
