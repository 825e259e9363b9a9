"""``verify-greedy``: is farthest-future eviction optimal on random small instances?

For each instance (:mod:`.instances`) three numbers are computed, all ``copies_total`` of one
stream from an empty pool:

* ``greedy``: the package's ``belady`` policy (its compiled replay plan, the code users run);
* ``optimum``: the exact program (:mod:`.exact`), ``B*``;
* ``flat``: the largest flattened-MIN count over the three orders (:mod:`.flat`).

Invariants checked on every instance: ``flat <= optimum <= greedy``. An instance with
``greedy > optimum`` is a *mismatch*, a counterexample to the paper's claim that greedy matched
the optimum on 42,000 instances; one that breaks the sandwich is a *violation* (a bug here).
``flat_loose`` counts instances with ``flat < optimum``: there the lower bound alone could not
certify greedy, and only the exact program could.

Instances are checked in chunks, in parallel over processes; the summary is the same for every
number of workers because instance ``i`` depends only on ``(seed, i)``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .._text import short
from ..errors import ConfigError, is_int
from .exact import optimal_total
from .flat import flat_min_totals
from .instances import FAMILIES, Instance, make_instance
from .streams import bare_layout, stream_totals

CHUNK = 250
"""Instances per work unit handed to a worker."""


@dataclass(frozen=True)
class InstanceCheck:
    """The three counts of one instance (``copies_total``)."""

    index: int
    family: str
    paper_band: bool
    greedy: int
    optimum: int
    flat: int

    @property
    def mismatch(self) -> bool:
        return self.greedy != self.optimum

    @property
    def violation(self) -> bool:
        return not (self.flat <= self.optimum <= self.greedy)


def check_instance(inst: Instance) -> InstanceCheck:
    """Greedy, optimum and flattened bound of one instance."""
    layout = bare_layout(inst.groups, np.array([0, inst.tokens]), inst.n_items)
    return InstanceCheck(
        index=inst.index,
        family=inst.family,
        paper_band=0.25 <= inst.served_ratio <= 1 / 3,
        greedy=int(stream_totals(layout, inst.capacity, "belady")[0]),
        optimum=optimal_total(inst.groups, inst.capacity).total,
        flat=int(flat_min_totals(layout, inst.capacity).max()),
    )


@dataclass
class VerifyReport:
    """Summary of a run; ``mismatches``/``violations`` hold instance indices, ascending."""

    seed: int
    instances: int = 0
    mismatches: list[int] = field(default_factory=list)
    violations: list[int] = field(default_factory=list)
    flat_loose: int = 0
    paper_band: int = 0
    by_family: dict = field(default_factory=lambda: {f: [0, 0, 0] for f in FAMILIES})
    jobs: int = 1
    seconds: float = 0.0

    def add(self, c: InstanceCheck) -> None:
        self.instances += 1
        self.paper_band += c.paper_band
        self.flat_loose += c.flat < c.optimum
        row = self.by_family[c.family]  # instances, mismatches, flat_loose
        row[0] += 1
        row[1] += c.mismatch
        row[2] += c.flat < c.optimum
        if c.mismatch:
            self.mismatches.append(c.index)
        if c.violation:
            self.violations.append(c.index)

    def merge(self, other: "VerifyReport") -> None:
        self.instances += other.instances
        self.paper_band += other.paper_band
        self.flat_loose += other.flat_loose
        for f, row in other.by_family.items():
            self.by_family[f] = [a + b for a, b in zip(self.by_family[f], row)]
        self.mismatches = sorted(self.mismatches + other.mismatches)
        self.violations = sorted(self.violations + other.violations)

    def counterexample(self) -> dict | None:
        """The lowest-index mismatch (or violation), rebuilt with its counts; ``None`` if none."""
        found = sorted(self.mismatches + self.violations)
        if not found:
            return None
        inst = make_instance(self.seed, found[0])
        c = check_instance(inst)
        return {**inst.describe(), "greedy_total": c.greedy, "optimal_total": c.optimum, "flat_total": c.flat}

    def to_dict(self) -> dict:
        return {
            "instances": self.instances,
            "mismatches": len(self.mismatches),
            "violations": len(self.violations),
            "greedy_optimal": self.instances - len(self.mismatches),
            "flat_loose": self.flat_loose,
            "paper_band": self.paper_band,
            "by_family": {f: dict(zip(("instances", "mismatches", "flat_loose"), row))
                          for f, row in self.by_family.items()},
            "counterexample": self.counterexample(),
            "seed": self.seed,
            "jobs": self.jobs,
            "seconds": self.seconds,
        }


def check_range(seed: int, start: int, stop: int) -> VerifyReport:
    """Check instances ``start..stop-1`` of ``seed`` (one work unit)."""
    report = VerifyReport(seed=seed)
    for i in range(start, stop):
        report.add(check_instance(make_instance(seed, i)))
    return report


def _check_unit(unit: tuple[int, int, int]) -> VerifyReport:
    return check_range(*unit)


def verify_greedy(instances: int, *, seed: int = 0, jobs: int = 1, progress: bool = False) -> VerifyReport:
    """Check ``instances`` random instances with ``jobs`` processes; see the module docstring.

    ``instances`` and ``jobs`` are integers in ``[1, 2**62]``, ``seed`` one in ``[0, 2**63)``, as the
    command's options are (a ConfigError otherwise: ``jobs=2.5`` had started 2 processes, ``seed=inf``
    ended as OverflowError and ``instances=0`` reported an empty check). The work is handed out
    ``CHUNK`` instances at a time and at most ``8 x`` the workers' units ahead, so memory stays bounded
    whatever the count (a list of every unit had taken this machine's 24 GB for 10**30), to at most
    one spawned worker per unit (``jobs=2**62`` had asked for as many forked processes)."""
    for name, value, lo, hi in (("instances", instances, 1, 2**62), ("jobs", jobs, 1, 2**62),
                                ("seed", seed, 0, 2**63 - 1)):
        if not is_int(value, lo, hi):
            raise ConfigError(f"verify_greedy: {name} must be an integer in [{lo}, {hi}], got {short(value, 40)}")
    t0 = time.perf_counter()
    units = ((seed, a, min(a + CHUNK, instances)) for a in range(0, instances, CHUNK))
    report = VerifyReport(seed=seed, jobs=jobs)
    bar = _progress_bar(instances, progress)
    if jobs <= 1 or instances <= CHUNK:
        parts = map(_check_unit, units)
        for part in parts:
            report.merge(part)
            bar(part.instances)
    else:
        # spawned, not forked: a fork of this process (numpy's BLAS thread is running) once hung a
        # worker, and multiprocessing.Pool then waited for its unit forever (a README check stopped
        # at 600 s where it takes 3); a worker that dies is a BrokenProcessPool here, not a hang
        workers = min(jobs, -(-instances // CHUNK))
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            while batch := list(itertools.islice(units, 8 * workers)):
                for part in pool.map(_check_unit, batch):
                    report.merge(part)
                    bar(part.instances)
    bar(None)
    report.seconds = time.perf_counter() - t0
    return report


def _progress_bar(total: int, enabled: bool):
    """A callback ``advance(n)``; ``advance(None)`` closes (:func:`expertcache._progress.progress`)."""
    from .._progress import progress

    bar = progress(total=total, desc="verify-greedy", disable=not enabled)
    return lambda n: bar.close() if n is None else bar.update(n)
