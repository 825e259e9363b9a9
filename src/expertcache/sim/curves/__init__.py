"""Curves over one trace: miss ratio against capacity (:mod:`.mrc`, LRU's in one stack pass from
:mod:`.stack`), gap recovered against foresight (:mod:`.foresight`), global pool against per-layer
split (:mod:`.pools`)."""

from .foresight import CAUSAL_RULES, DEFAULT_HORIZONS, ForesightCurve, foresight_curve
from .mrc import MissRatioCurve, capacity_bounds, lru_curve, sweep, sweep_layout
from .pools import DEFAULT_POLICIES, FAIR_WARM, PoolComparison, compare_pools

__all__ = [
    "CAUSAL_RULES", "DEFAULT_HORIZONS", "DEFAULT_POLICIES", "FAIR_WARM", "ForesightCurve", "MissRatioCurve",
    "PoolComparison", "capacity_bounds", "compare_pools", "foresight_curve", "lru_curve",
    "sweep", "sweep_layout",
]
