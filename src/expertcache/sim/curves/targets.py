"""The smallest capacity that meets a target, read off a swept curve (docs/sizing.md).

A capacity *meets* the target when ``hit_rate >= target_hit_rate`` and ``copies_per_token <=
target_copies`` (either target may be left out; comparisons allow 1e-12 of floating-point
rounding). The answer is the smallest **swept** capacity that meets it, or none ("not reached up to
the largest swept capacity"). Curves need not be monotone -- a policy other than LRU can miss the
target again at a larger capacity -- so the swept capacities above the answer that miss it are
reported too (``misses_again_at``), never hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import ConfigError

TOLERANCE = 1e-12


@dataclass(frozen=True)
class CapacityTarget:
    """Where a curve first meets a target. ``capacity`` is ``None`` when no swept capacity does;
    ``max_capacity`` is the largest swept one; ``misses_again_at`` lists swept capacities above
    ``capacity`` that miss the target (empty when the curve stays on target)."""

    target_hit_rate: float | None
    target_copies: float | None
    capacity: int | None
    max_capacity: int
    misses_again_at: tuple[int, ...] = ()

    @property
    def reached(self) -> bool:
        return self.capacity is not None


def check_targets(target_hit_rate: float | None, target_copies: float | None) -> None:
    """ConfigError unless at least one target is given, ``target_hit_rate`` in (0, 1] and
    ``target_copies`` a finite number >= 0."""
    if target_hit_rate is None and target_copies is None:
        raise ConfigError("targets: give a target hit rate, a target of copies per token, or both")
    if target_hit_rate is not None and not (0.0 < target_hit_rate <= 1.0):
        raise ConfigError(f"--target-hit-rate: {target_hit_rate!r} is outside (0, 1]")
    if target_copies is not None and not (math.isfinite(target_copies) and target_copies >= 0):
        raise ConfigError(f"--target-copies: expected a finite number >= 0, got {target_copies!r}")


def smallest_capacity(
    capacities: Sequence[int],
    hit_rate: Sequence[float],
    copies_per_token: Sequence[float],
    *,
    target_hit_rate: float | None = None,
    target_copies: float | None = None,
) -> CapacityTarget:
    """The smallest of ``capacities`` (ascending, one value of ``hit_rate`` and ``copies_per_token``
    each) that meets the targets; see the module docstring. NaN values never meet a target."""
    check_targets(target_hit_rate, target_copies)
    caps = np.asarray(capacities, dtype=np.int64)
    hit = np.asarray(hit_rate, dtype=np.float64)
    copies = np.asarray(copies_per_token, dtype=np.float64)
    if caps.size == 0 or hit.shape != caps.shape or copies.shape != caps.shape:
        raise ConfigError("targets: need one hit rate and one copies/token value per capacity")
    if np.any(np.diff(caps) <= 0):
        raise ConfigError("targets: capacities must be ascending and distinct")
    ok = np.ones(caps.size, dtype=bool)
    with np.errstate(invalid="ignore"):
        if target_hit_rate is not None:
            ok &= hit >= target_hit_rate - TOLERANCE
        if target_copies is not None:
            ok &= copies <= target_copies + TOLERANCE
    hits = np.flatnonzero(ok)
    if not hits.size:
        return CapacityTarget(target_hit_rate, target_copies, None, int(caps[-1]))
    first = int(hits[0])
    again = tuple(int(c) for c in caps[first:][~ok[first:]])
    return CapacityTarget(target_hit_rate, target_copies, int(caps[first]), int(caps[-1]), again)


def curve_target(curve, *, target_hit_rate: float | None = None, target_copies: float | None = None) -> CapacityTarget:
    """:func:`smallest_capacity` on a :class:`~expertcache.sim.curves.MissRatioCurve`."""
    return smallest_capacity(curve.capacities, curve.hit_rate, curve.copies_per_token,
                             target_hit_rate=target_hit_rate, target_copies=target_copies)
