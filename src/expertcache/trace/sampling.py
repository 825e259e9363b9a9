"""Spatial sampling of (layer, expert) items (SHARDS-style, :mod:`expertcache.sim.sampled`): the hash
that keeps an item, and the trace with the other items made padding.

Invariants: an item's fate depends only on ``(layer column, expert, seed, rate)``, so every token,
chunk and worker keeps the same items; a sampled trace keeps every token, sequence and group (the
unkept ids become padding in place, which every rule and the layout take anywhere in a group).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .core import Trace


def item_mask(num_layers: int, num_experts: int, rate: float, seed: int = 0) -> np.ndarray:
    """bool ``[L, E]``: the items a hash of ``(layer, expert, seed)`` keeps at ``rate``."""
    if not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0) or isinstance(rate, bool):
        raise ConfigError(f"--sample-rate: {rate!r} is outside (0, 1]")
    layer = np.arange(num_layers, dtype=np.uint64)[:, None]
    expert = np.arange(num_experts, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        x = (layer << np.uint64(32)) ^ expert ^ (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < rate


def sample_trace(trace: Trace, mask: np.ndarray) -> Trace:
    """``trace`` with the ids of items outside ``mask`` (``[L, E]``, by layer column) made padding
    in place (every rule and the layout take padding anywhere in a group). Tokens, sequences and
    extras are unchanged; gate weights are dropped."""
    ex = trace.experts
    flat = (np.arange(trace.num_layers, dtype=np.int64) * trace.num_experts)[None, :, None] + ex
    keep = (ex >= 0) & mask.reshape(-1)[np.maximum(flat, 0)]
    return trace._with(experts=np.where(keep, ex, -1).astype(ex.dtype, copy=False), probs=None, router_probs=None)
