"""The demand model and the advice-addressable headroom of a tier cell (docs/tier.md).

Demand model. The measured process reads the trace twice (a warm pass, then the measured pass)
with one global pool keyed by (layer, expert), never reset between sequences. The demand model
replays exactly that through the replay engine (:mod:`expertcache.sim`): the trace's rows
concatenated twice, ``pool="global"``, ``reset="none"``, ``warm=0.5`` (the first copy warms, the
second is scored), LRU at ``floor(capacity_bytes / expert_bytes)`` experts.
``demand_miss_bytes = demand_misses * expert_bytes``.

Advice-addressable headroom. The harness posts, while group g (row t, layer l) is read, the hint
source's experts for group g + 1. ``advice_addressable_misses`` counts the demand-model misses of
the measured pass at groups g >= 1 whose expert the hint source named for g (the first group of
the measured pass gets no hint). They are the misses a perfect one-layer-ahead prefetch of the
hints could have turned into hits, without changing what LRU would otherwise keep. The per-miss
view comes from the reference cache (:class:`~expertcache.cache.ExpertCache`), whose total is
checked against the compiled engine's count (``demand_engines_agree``).
"""

from __future__ import annotations

import numpy as np

from ..cache import ExpertCache
from ..sim import build_layout, replay_layout
from ..trace import Trace


def doubled_layout(experts: np.ndarray, num_experts: int):
    """The global-pool layout of the trace read twice, the first copy unscored."""
    twice = np.concatenate([experts, experts]).astype(np.int32)
    trace = Trace.from_arrays(twice, np.zeros(len(twice), dtype=np.int32), num_experts=num_experts)
    return build_layout(trace, pool="global", reset="none", warm=0.5)


def demand_model(experts: np.ndarray, num_experts: int, capacity_bytes: int, expert_bytes: int,
                 hints: np.ndarray | None = None, layout=None) -> dict:
    """Demand misses of the measured pass at this capacity and, with ``hints``, the headroom."""
    cap = int(capacity_bytes // expert_bytes)
    layout = layout if layout is not None else doubled_layout(experts, num_experts)
    widest = int(layout.requests.max()) if layout.requests.size else 0
    out = {"capacity_experts": cap, "demand_misses": None, "demand_miss_bytes": None, "demand_note": None,
           "advice_addressable_misses": None, "advice_addressable_share": None}
    if cap < max(widest, 1):
        out["demand_note"] = (f"capacity holds {cap} experts, fewer than the {widest} one layer requests: "
                              "no lossless LRU schedule exists")
        return out
    res = replay_layout(layout, cap, "lru")
    out["demand_misses"] = res.copies_total
    out["demand_miss_bytes"] = res.copies_total * int(expert_bytes)
    out["demand_hit_rate"] = res.hit_rate
    if hints is not None:
        addressable, total = _addressable(layout, cap, hints, num_experts)
        out["advice_addressable_misses"] = addressable
        out["advice_addressable_share"] = addressable / total if total else None
        out["demand_engines_agree"] = total == res.copies_total
    return out


def _addressable(layout, cap: int, hints: np.ndarray, num_experts: int) -> tuple[int, int]:
    T, L, _ = hints.shape
    cache = ExpertCache(cap, "lru", layout.n_items, steps_per_token=L)
    first_scored = T * L
    offset = (np.arange(L, dtype=np.int64) * num_experts)[:, None]
    flat_hints = np.where(hints >= 0, hints + offset[None], -1).reshape(T * L, -1)
    addressable = total = 0
    for g, group in enumerate(layout.groups):
        step = cache.prepare(group)
        if g < first_scored or not step.loads:
            continue
        total += len(step.loads)
        m = g - first_scored
        if m == 0:
            continue
        named = flat_hints[m]
        addressable += sum(1 for item, _ in step.loads if item in named)
    return addressable, total
