"""Lossless replay of a trace under an eviction policy: exact copy counts (docs/semantics.md).

Counting, per stream (a pool's life from empty):

* ``copies_total``: every insertion (= misses);
* ``copies_steady``: insertions made once the pool is full, i.e. that evict a victim; equal to
  ``max(0, copies_total - C)`` per stream when the whole stream is scored;
* ``copies_per_token``: ``copies_steady`` summed over layers and streams / scored tokens ``T``
  (accepted tokens on an engine trace: :mod:`expertcache.trace.units`);
* ``copies_per_iteration``: the same over scored engine iterations (= rows, unless the trace
  carries the ``iteration`` extra);
* ``hit_rate``: ``1 - misses / requests`` over the scored window;
* ``gap_recovered``: ``(steady(lru) - steady(p)) / (steady(lru) - steady(belady))`` when a run
  holds both ``lru`` and ``belady`` (undefined when they tie);
* ``needs_future``: the policy's own flag (:attr:`~expertcache.policies.Policy.needs_future`): it
  reads the recorded future of the stream (clairvoyant), so its counts are an offline reference,
  not something a causal cache can run.

With a warm fraction ``w`` every count covers only the scored tokens (the last ``1 - w`` of each
stream); the warm part only fills and warms the pool.

Requests served without insertion -- ``static``'s streamed misses (a pin set with bypass), or an
expert's first request under ``admission="second"`` -- are misses and steady copies: a copy is
made, nothing is evicted for it, and no pool fills with it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..cache import ExpertCache
from ..kernels import pool_slots
from ..errors import ConfigError, is_int
from ..policies import Policy, StreamFuture, make_policy
from ..trace.context import stream_context
from ..trace import Trace
from .gap import as_record, gap_recovered
from .layout import StreamLayout, build_layout

ENGINES = ("auto", "compiled", "python")


@dataclass
class LayerCounts:
    """Counts of one layer (in a global pool, the copies made for that layer's experts)."""

    layer: int
    requests: int
    copies_total: int
    copies_steady: int

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.copies_total / self.requests if self.requests else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass
class ReplayResult:
    """Counts of one policy at one capacity; see the module docstring for definitions."""

    policy: str
    capacity: int
    pool: str
    reset: str
    warm: float
    layers: list[int]
    tokens: int
    requests: int
    copies_total: int
    copies_steady: int
    per_layer: list[LayerCounts] = field(default_factory=list)
    gap_recovered: float | None = None
    engine: str = "compiled"
    seconds: float = 0.0
    needs_future: bool = False
    iterations: int = 0
    admission: str = "all"
    budget: dict | None = None
    """``{"budget_bytes", "expert_bytes", "budget_experts"}`` when the capacity came from a byte
    budget (:class:`~expertcache.sim.budget.Budget`)."""

    @property
    def copies_fill(self) -> int:
        return self.copies_total - self.copies_steady

    @property
    def copies_per_token(self) -> float:
        return self.copies_steady / self.tokens if self.tokens else float("nan")

    @property
    def copies_per_iteration(self) -> float:
        return self.copies_steady / self.iterations if self.iterations else float("nan")

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.copies_total / self.requests if self.requests else float("nan")

    def to_dict(self) -> dict:
        """The JSON record: counts first, then the run's configuration."""
        return {
            "policy": self.policy,
            "needs_future": self.needs_future,
            "capacity": self.capacity,
            "tokens": self.tokens,
            "requests": self.requests,
            "copies_total": self.copies_total,
            "copies_steady": self.copies_steady,
            "copies_fill": self.copies_fill,
            "copies_per_token": self.copies_per_token,
            "iterations": self.iterations,
            "copies_per_iteration": self.copies_per_iteration,
            "hit_rate": self.hit_rate,
            "gap_recovered": self.gap_recovered,
            **(self.budget or {}),
            "admission": self.admission,
            "pool": self.pool,
            "reset": self.reset,
            "warm": self.warm,
            "layers": self.layers,
            "per_layer": [c.to_dict() for c in self.per_layer],
            "engine": self.engine,
            "seconds": self.seconds,
        }


def replay(
    trace: Trace,
    capacity: int,
    policy: "str | Policy" = "lru",
    *,
    pool: str = "layer",
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    warm: float = 0.0,
    admission: str = "all",
    engine: str = "auto",
) -> ReplayResult:
    """Replay ``trace`` through one policy at ``capacity`` experts per pool.

    ``pool="layer"`` gives each layer its own pool of ``capacity``; ``pool="global"`` shares one
    pool of ``capacity`` ``(layer, expert)`` items among all layers. ``reset="sequence"`` empties
    the pools at each sequence; ``"none"`` carries them over. ``layers`` keeps a subset of layer
    ids; ``warm`` is the unscored warm fraction of each stream; ``admission`` ``"all"`` (default)
    or ``"second"`` (:func:`~expertcache.sim.layout.build_layout`). ``engine``: ``"compiled"`` (the
    policy's compiled plan), ``"python"`` (the reference :class:`~expertcache.cache.ExpertCache`
    driving the policy object) or ``"auto"`` (compiled when the policy has a plan).
    """
    layout = build_layout(trace, pool=pool, reset=reset, layers=layers, warm=warm, admission=admission)
    return replay_layout(layout, capacity, policy, engine=engine)


def replay_many(
    trace: Trace,
    capacity: int,
    policies: Sequence["str | Policy"],
    *,
    pool: str = "layer",
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    warm: float = 0.0,
    admission: str = "all",
    engine: str = "auto",
) -> list[ReplayResult]:
    """Replay several policies on the same streams; fills ``gap_recovered`` when both ``lru`` and
    ``belady`` are among them."""
    check_policy_list(policies)
    layout = build_layout(trace, pool=pool, reset=reset, layers=layers, warm=warm, admission=admission)
    results = [replay_layout(layout, capacity, p, engine=engine) for p in policies]
    fill_gap(results)
    return results


def check_policy_list(policies) -> None:
    """A ConfigError where ``policies`` is one policy, not a list of them (a string had been read
    character by character: "unknown policy 'l'")."""
    if isinstance(policies, (str, Policy)) or not hasattr(policies, "__iter__"):
        raise ConfigError(f"policies: expected a list of policies, such as ['lru', 'belady'], got {policies!r}")


def fill_gap(results: Sequence[ReplayResult]) -> None:
    """Set ``gap_recovered`` on every result when the list holds ``lru`` and ``belady``."""
    by_name = {r.policy: r for r in results}
    if "lru" in by_name and "belady" in by_name:
        lo, hi = by_name["belady"].copies_steady, by_name["lru"].copies_steady
        for r in results:
            r.gap_recovered = as_record(gap_recovered(r.copies_steady, hi, lo))


def replay_layout(layout: StreamLayout, capacity: int, policy: "str | Policy", *, engine: str = "auto") -> ReplayResult:
    """Replay prepared streams (build them once with :func:`build_layout` to reuse across policies)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
    policy = make_policy(policy)
    capacity = check_capacity(layout, capacity) if policy.admits else check_positive(capacity)
    t0 = time.perf_counter()
    plan = policy.plan(layout) if engine != "python" else None
    if plan is None and engine == "compiled":
        raise ConfigError(f"policy {policy.spec!r} has no compiled plan; use engine='python'")
    if plan is not None:
        misses, evictions = plan.run(layout, capacity)
        used = "compiled"
    else:
        misses, evictions = _python_loop(layout, pool_slots(layout, capacity), policy)
        used = "python"
    seconds = time.perf_counter() - t0
    result = _tally(layout, capacity, policy.spec, misses, evictions, used, seconds)
    result.needs_future = bool(policy.needs_future)
    return result


MAX_CAPACITY = 1 << 62
"""Largest capacity taken (sweep's and bounds' int64 arithmetic overflowed at 2**63)."""


def check_capacity(layout: StreamLayout, capacity) -> int:
    """``capacity`` as an int, or a ConfigError if it is not one, is above :data:`MAX_CAPACITY`, or
    cannot hold the widest group."""
    if not is_int(capacity):
        raise ConfigError(f"capacity must be an integer, got {capacity!r}")
    if capacity > MAX_CAPACITY:
        raise ConfigError(f"capacity {capacity} is above 2**62")
    widest = layout.widest
    if capacity < max(widest, 1):
        raise ConfigError(
            f"capacity {capacity} is below the {widest} experts one token requests at a layer: "
            "they could not all be resident at once"
        )
    return int(capacity)


def check_positive(capacity) -> int:
    """``capacity`` as a positive int (a pin set with bypass holds any number of experts)."""
    if not is_int(capacity, 1):
        raise ConfigError(f"capacity must be a positive integer, got {capacity!r}")
    return int(capacity)


def _python_loop(layout: StreamLayout, capacity: int, policy: Policy) -> tuple[np.ndarray, np.ndarray]:
    G = layout.groups.shape[0]
    misses = np.zeros(G, dtype=np.int32)
    evictions = np.zeros(G, dtype=np.int32)
    cache = None
    for s in range(layout.num_streams):
        a, b = layout.starts[s], layout.starts[s + 1]
        groups = layout.groups[a:b]
        future = StreamFuture(groups) if policy.needs_future else None
        if policy.wants_context:
            policy.set_context(stream_context(layout, s))
        if cache is None:
            cache = ExpertCache(capacity, policy, layout.n_items, future=future, steps_per_token=layout.steps_per_token)
        else:
            cache.reset(future)
        for g in range(b - a):
            step = cache.prepare(groups[g])
            misses[a + g] = step.misses
            evictions[a + g] = len(step.evicted)
    return misses, evictions


def _tally(layout, capacity, spec, misses, evictions, engine, seconds) -> ReplayResult:
    if layout.streamed is not None:  # requests served without insertion: misses, steady copies
        misses, evictions = misses + layout.streamed, evictions + layout.streamed
    r, m, e = layout.per_layer(layout.requests), layout.per_layer(misses), layout.per_layer(evictions)
    return ReplayResult(
        policy=spec,
        capacity=capacity,
        pool=layout.pool,
        reset=layout.reset,
        warm=layout.warm,
        layers=list(layout.layer_ids),
        tokens=layout.tokens,
        requests=int(r.sum()),
        copies_total=int(m.sum()),
        copies_steady=int(e.sum()),
        per_layer=[LayerCounts(lid, int(r[i]), int(m[i]), int(e[i])) for i, lid in enumerate(layout.layer_ids)],
        engine=engine,
        seconds=seconds,
        iterations=layout.iterations,
        admission=layout.admission,
    )
