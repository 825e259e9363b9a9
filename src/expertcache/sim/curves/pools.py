"""Global pool against an equal per-layer split at the same total budget (docs/curves.md).

With ``L`` layers and a per-layer capacity ``C``, the split gives every layer its own pool of
``C`` experts; the global pool shares ``L * C`` ``(layer, expert)`` slots among all layers, so
demand sets the split. Both serve the same streams under the same policy, reset and fair window
(by default ``warm = 0.6``: the first 60% of each sequence warms the pools unscored), so their hit
rates and copies per token are directly comparable. Differences are global minus split:
``hit_rate_diff_pp`` in percentage points, ``copies_per_token_diff`` in copies per token.

Records name things as ``expertcache replay`` does: ``capacity`` is the per-layer capacity ``C``
(``capacity_global`` = ``L * C``), ``policy``, ``layers`` (a list), ``needs_future``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ...policies import Policy
from ...trace import Trace
from ..layout import build_layout
from ..replay import ReplayResult, replay_layout
from .mrc import Progress

DEFAULT_POLICIES = ("lru", "lfu", "belady")
FAIR_WARM = 0.6


@dataclass
class PoolComparison:
    """One policy at one budget: ``split`` (per-layer pools of ``capacity``) and ``shared`` (one
    global pool of ``L * capacity``)."""

    policy: str
    split: ReplayResult
    shared: ReplayResult

    @property
    def capacity(self) -> int:
        """Per-layer capacity of the split."""
        return self.split.capacity

    @property
    def hit_rate_diff_pp(self) -> float:
        return 100.0 * (self.shared.hit_rate - self.split.hit_rate)

    @property
    def copies_per_token_diff(self) -> float:
        return self.shared.copies_per_token - self.split.copies_per_token

    def to_dict(self) -> dict:
        s, g = self.split, self.shared
        return {
            "policy": self.policy,
            "needs_future": s.needs_future,
            "capacity": s.capacity,
            "capacity_global": g.capacity,
            "layers": s.layers,
            "tokens": s.tokens,
            "requests": s.requests,
            "warm": s.warm,
            "reset": s.reset,
            "hit_rate_split": s.hit_rate,
            "hit_rate_global": g.hit_rate,
            "hit_rate_diff_pp": self.hit_rate_diff_pp,
            "copies_per_token_split": s.copies_per_token,
            "copies_per_token_global": g.copies_per_token,
            "copies_per_token_diff": self.copies_per_token_diff,
            "copies_steady_split": s.copies_steady,
            "copies_steady_global": g.copies_steady,
        }


def compare_pools(
    trace: Trace,
    capacities: "int | Iterable[int]",
    policies: Sequence["str | Policy"] = DEFAULT_POLICIES,
    *,
    warm: float = FAIR_WARM,
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    engine: str = "auto",
    progress: Progress | None = None,
) -> list[PoolComparison]:
    """Compare the split and the global pool for each policy at each per-layer capacity
    (ascending capacity, then policy order)."""
    caps = sorted({int(capacities)} if isinstance(capacities, int) else {int(c) for c in capacities})
    split = build_layout(trace, pool="layer", reset=reset, layers=layers, warm=warm)
    shared = build_layout(trace, pool="global", reset=reset, layers=layers, warm=warm)
    L = len(split.layer_ids)
    tick = progress or (lambda n: None)
    out = []
    for c in caps:
        for spec in policies:
            a = replay_layout(split, c, spec, engine=engine)
            b = replay_layout(shared, L * c, spec, engine=engine)
            tick(2)
            out.append(PoolComparison(a.policy, a, b))
    return out
