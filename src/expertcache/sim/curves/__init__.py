"""Curves over one trace: miss ratio against capacity (:mod:`.mrc`, LRU's in one stack pass from
:mod:`.stack`), gap recovered against foresight (:mod:`.foresight`), global pool against per-layer
split (:mod:`.pools`); the smallest capacity meeting a target (:mod:`.targets`)."""

from .foresight import CAUSAL_RULES, DEFAULT_HORIZONS, ForesightCurve, foresight_curve
from .mrc import MissRatioCurve, capacity_bounds, lru_curve, sweep, sweep_layout
from .pools import DEFAULT_POLICIES, FAIR_WARM, PoolComparison, compare_pools
from .targets import CapacityTarget, curve_target, smallest_capacity

__all__ = [
    "CAUSAL_RULES", "CapacityTarget", "DEFAULT_HORIZONS", "DEFAULT_POLICIES", "FAIR_WARM", "ForesightCurve",
    "MissRatioCurve", "PoolComparison", "capacity_bounds", "compare_pools", "foresight_curve", "lru_curve",
    "curve_target", "smallest_capacity", "sweep", "sweep_layout",
]
