"""The smallest capacity that meets a target, read off a swept curve (docs/sizing.md).

A capacity *meets* the target when ``hit_rate >= target_hit_rate`` and ``copies_per_token <=
target_copies`` (either target may be left out; comparisons allow 1e-12 of floating-point
rounding). The answer is the smallest **swept** capacity that meets it, or none ("not reached up to
the largest swept capacity"). Curves need not be monotone -- a policy other than LRU can miss the
target again at a larger capacity -- so the swept capacities above the answer that miss it are
reported too (``misses_again_at``), never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import ConfigError, is_real

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
    if target_copies is not None and not (is_real(target_copies) and target_copies >= 0):
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


# ----------------------------------------------------------------------------- the ceiling
@dataclass(frozen=True)
class HitRateCeiling:
    """The highest hit rate any lossless rule reaches on a layout: every expert resident
    (capacity ``n_items``), so the only misses are the cold fills of empty pools (after each
    sequence reset, and at the start). ``warm`` is the layout's warm fraction; ``fair`` the same
    ceiling on a fair window (the first :data:`~expertcache.sim.curves.pools.FAIR_WARM` of each
    stream warms unscored), ``None`` when not computed."""

    hit_rate: float
    capacity: int
    warm: float
    fair: float | None = None
    fair_warm: float | None = None

    def note(self, target: float) -> str:
        """One line saying why ``target`` is out of reach, or ``""`` when it is within the ceiling."""
        if target <= self.hit_rate + TOLERANCE:
            return ""
        window = f"warm fraction {self.warm:g}" if self.warm else "every request scored"
        line = (f"hit rate {target:g} is above the ceiling {self.hit_rate:.4f}: even with every expert resident "
                f"(C={self.capacity}) the cold fills of empty pools ({window}) miss")
        if self.fair is not None:
            line += (f"; on a fair window (--warm {self.fair_warm:g}: the first {self.fair_warm:.0%} of each stream "
                     f"warms unscored) the ceiling is {self.fair:.4f}: target the warm hit rate with --warm "
                     f"{self.fair_warm:g}")
        return line


def hit_rate_ceiling(layout, *, fair_layout=None) -> HitRateCeiling:
    """:class:`HitRateCeiling` of ``layout`` (and of ``fair_layout``, the same streams on a fair
    window, when given), from LRU's one-pass curve at ``n_items``: with every item resident all
    lossless rules make exactly the same copies, the first request of each item in each stream."""
    from .mrc import lru_curve

    def top(lay) -> float:
        return float(lru_curve(lay, [int(lay.n_items)]).hit_rate[0])

    fair = top(fair_layout) if fair_layout is not None else None
    return HitRateCeiling(top(layout), int(layout.n_items), float(layout.warm), fair,
                          float(fair_layout.warm) if fair_layout is not None else None)
