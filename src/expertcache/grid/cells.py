"""Cells and tasks of a grid.

A *cell* is one replay: (trace, policy, capacity or budget, pool, warm, layers, reset). Its
``key`` is the SHA-256 of a canonical JSON of those inputs, where the trace stands for its
identity (the SHA-256 of the file's bytes, or the synthetic preset with its seed and full
parameters) and the expertcache version is included: the same inputs give the same key on every
machine and run; changing the trace's bytes, a parameter or the version gives a new key.

A *task* is the unit of work a worker runs: every cell sharing (trace, pool, warm, layers, reset)
at one capacity or budget, so one stream layout serves all its policies and the lru/belady pair
that ``gap_recovered`` needs is computed together (a task's rows are written as one part).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .. import __version__
from ..sim.layout import COUNTS_REVISION
from .spec import GridSpec, TraceSource


def counts_version() -> str:
    """The package version and :data:`~expertcache.sim.layout.COUNTS_REVISION`, as cell keys and
    stored rows record it: ``0.1.0+counts.2``."""
    return f"{__version__}+counts.{COUNTS_REVISION}"


@dataclass(frozen=True)
class Cell:
    """One replay of the grid; ``capacity`` (experts per pool) or ``budget`` ((text, bytes)) is set."""

    trace: TraceSource
    policy: str
    capacity: int | None
    budget: tuple[str, int] | None
    expert_mb: float | None
    pool: str
    warm: float
    layers: tuple[int, ...] | None
    reset: str

    @property
    def key(self) -> str:
        doc = {
            "trace": self.trace.ident,
            "policy": self.policy,
            "capacity": self.capacity,
            "budget_bytes": self.budget[1] if self.budget else None,
            "expert_mb": self.expert_mb,
            "pool": self.pool,
            "warm": self.warm,
            "layers": list(self.layers) if self.layers is not None else None,
            "reset": self.reset,
            "version": counts_version(),
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Task:
    """Cells sharing a layout and a capacity or budget (see the module docstring)."""

    trace: TraceSource
    pool: str
    warm: float
    layers: tuple[int, ...] | None
    reset: str
    capacity: int | None
    budget: tuple[str, int] | None
    expert_mb: float | None
    policies: tuple[str, ...]
    """Policies of the grid at this point (all of them, finished or not)."""

    def cell(self, policy: str) -> Cell:
        return Cell(self.trace, policy, self.capacity, self.budget, self.expert_mb, self.pool, self.warm,
                    self.layers, self.reset)

    @property
    def cells(self) -> list[Cell]:
        return [self.cell(p) for p in self.policies]


def plan_tasks(spec: GridSpec) -> list[Task]:
    """Every task of the grid, trace-major (a worker keeps reusing the trace it has loaded)."""
    sizes = [(c, None) for c in spec.capacities] or [(None, b) for b in spec.budgets]
    return [
        Task(trace, pool, warm, spec.layers, reset, cap, budget, spec.expert_mb if budget else None, spec.policies)
        for trace in spec.traces
        for pool in spec.pools
        for reset in spec.resets
        for warm in spec.warm
        for cap, budget in sizes
    ]
