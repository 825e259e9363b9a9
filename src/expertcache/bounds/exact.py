"""``B*``: the exact optimum over lossless schedules, by dynamic programming over resident sets.

The program searches demand-fetch schedules only, which lose nothing (the paper's proposition:
a prefetched insertion can always be delayed to the item's next request or deleted). Two further
reductions keep it small and are exact as well:

* *lazy eviction*: a step evicts only as many residents as the missing items overflow the pool
  (evicting earlier never saves an insertion);
* *dead items are free*: once an item is never requested again in the stream, it is dropped from
  the state, as if evicted at no cost; evicting such an item is always at least as good as
  evicting any live one (the classical exchange argument).

A state is the bitmask of live resident items (at most ``C`` bits); its value is the fewest
insertions that reach it. Step ``t`` maps every state ``R`` to ``(R | S_t) - V`` for every
``V`` of ``overflow = |R | S_t| - C`` items among ``R - S_t``, at the cost of ``|S_t - R|``.
States are indexed directly by their mask, so a stream may request at most :data:`MAX_ITEMS`
distinct items; the number of states alive after one step is capped by ``max_states``.
Beyond either limit the answer is a :class:`~expertcache.errors.ConfigError` naming it.

Tests check the program against a brute force over all schedules with prefetching.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._jit import njit
from ..errors import ConfigError, is_int
from ..sim.layout import StreamLayout

MAX_ITEMS = 24
"""Most distinct items one stream may request (states are indexed by a ``2**n`` table)."""

DEFAULT_MAX_STATES = 2_000_000
"""Default cap on the resident sets alive after one step."""


@dataclass(frozen=True)
class ExactResult:
    """Optimum of one stream: ``total`` insertions (``copies_total`` of the best lossless
    schedule) and ``peak_states``, the most resident sets alive after any step."""

    total: int
    peak_states: int


class InstanceTooLarge(ConfigError):
    """The exact program would exceed :data:`MAX_ITEMS` or the state cap on this stream."""


def optimal_total(groups: np.ndarray, capacity: int, *, max_states: int = DEFAULT_MAX_STATES) -> ExactResult:
    """The fewest insertions of any lossless schedule serving ``groups`` from an empty pool.

    ``groups`` is ``[T, k]`` item ids of one stream (-1 pads). Raises :class:`InstanceTooLarge`
    when the stream requests more than :data:`MAX_ITEMS` distinct items (unless they all fit in
    the pool) or more than ``max_states`` resident sets are alive after one step.
    """
    groups = np.asarray(groups)
    if groups.ndim == 1:
        groups = groups[:, None]
    if groups.ndim != 2 or (groups.size and groups.dtype.kind not in "iu"):  # a float was floored, NaN a pad
        raise ConfigError(f"groups: expected integer ids [T, k], got {groups.dtype} of shape {groups.shape}")
    if groups.size and int(groups.min()) < -1:
        raise ConfigError(f"groups: id {int(groups.min())} is below -1 (the padding)")
    for name, value, most in (("capacity", capacity, 1 << 62), ("max_states", max_states, 1 << 62)):
        if not is_int(value, 1, most):
            raise ConfigError(f"{name} must be an integer in [1, 2**62], got {value!r}")
    ids, local = np.unique(groups, return_inverse=True)
    local = local.reshape(groups.shape) - (1 if ids.size and ids[0] < 0 else 0)
    n = int(np.count_nonzero(ids >= 0))
    widest = int(np.count_nonzero(groups >= 0, axis=1).max()) if groups.size else 0
    if capacity < widest:
        raise ConfigError(f"capacity {capacity} is below the {widest} items one step requests")
    if n <= capacity:  # the pool never fills: every item is fetched once
        return ExactResult(total=n, peak_states=1)
    if n > MAX_ITEMS:
        raise InstanceTooLarge(
            f"the stream requests {n} distinct items, more than capacity {capacity}; "
            f"the exact program handles at most {MAX_ITEMS} distinct items per stream"
        )
    req, live = _masks(np.where(groups >= 0, local, -1).astype(np.int64))
    total, peak, failed_at = _dp(req, live, n, int(capacity), int(max_states))
    if total < 0:
        raise InstanceTooLarge(
            f"more than {max_states:,} resident sets are alive after step {failed_at} "
            f"(state limit {max_states:,}; {n} distinct items, capacity {capacity})"
        )
    return ExactResult(total=int(total), peak_states=int(peak))


def exact_stream_totals(layout: StreamLayout, capacity: int, *, max_states: int = DEFAULT_MAX_STATES,
                        label=None) -> np.ndarray:
    """int64 ``[S]``: the optimal ``copies_total`` of every stream of ``layout``.

    ``label(s)`` names stream ``s`` in the error raised when one is too large.
    """
    out = np.zeros(layout.num_streams, dtype=np.int64)
    for s in range(layout.num_streams):
        try:
            out[s] = optimal_total(layout.stream_groups(s), capacity, max_states=max_states).total
        except InstanceTooLarge as err:
            where = label(s) if label else f"stream {s}"
            raise InstanceTooLarge(f"exact optimum of {where}: {err}") from None
    return out


@njit(cache=True)
def _masks(local):
    """Per step: the requested items' mask, and the mask of items requested at a later step."""
    T, k = local.shape
    req = np.zeros(T, dtype=np.int64)
    live = np.zeros(T, dtype=np.int64)
    later = np.int64(0)
    for t in range(T - 1, -1, -1):
        live[t] = later
        m = np.int64(0)
        for j in range(k):
            if local[t, j] >= 0:
                m |= np.int64(1) << local[t, j]
        req[t] = m
        later |= m
    return req, live


@njit(cache=True, inline="always")
def _popcount(x):
    c = 0
    while x:
        x &= x - 1
        c += 1
    return c


@njit(cache=True)
def _dp(req, live, n, capacity, max_states):
    """Forward DP; returns ``(optimal total, peak states, -1)`` or ``(-1, peak, failing step)``."""
    T = req.size
    table = np.full(np.int64(1) << n, -1, dtype=np.int32)  # best cost of a state in the next layer
    cap = min(np.int64(1) << n, np.int64(max_states) + 1)
    cur_mask = np.zeros(cap, dtype=np.int64)
    cur_cost = np.zeros(cap, dtype=np.int32)
    nxt_mask = np.zeros(cap, dtype=np.int64)
    nxt_cost = np.zeros(cap, dtype=np.int32)
    bits = np.zeros(64, dtype=np.int64)
    n_cur = 1  # the empty pool, no insertions yet
    peak = 1
    for t in range(T):
        s_t = req[t]
        keep = live[t]
        n_nxt = 0
        for i in range(n_cur):
            r = cur_mask[i]
            cost = cur_cost[i] + _popcount(s_t & ~r)
            u = r | s_t
            over = _popcount(u) - capacity
            c = 0
            if over > 0:
                cand = r & ~s_t
                while cand:
                    low = cand & -cand
                    bits[c] = low
                    c += 1
                    cand ^= low
            # enumerate victim sets: the bit patterns x of `over` ones among c (Gosper's hack)
            x = (np.int64(1) << max(over, 0)) - 1
            limit = np.int64(1) << c
            while True:
                v = np.int64(0)
                y = x
                b = 0
                while y:
                    if y & 1:
                        v |= bits[b]
                    y >>= 1
                    b += 1
                s = (u & ~v) & keep
                old = table[s]
                if old < 0:
                    if n_nxt == max_states:
                        return -1, peak, t
                    table[s] = cost
                    nxt_mask[n_nxt] = s
                    n_nxt += 1
                elif cost < old:
                    table[s] = cost
                if over <= 0:
                    break
                low = x & -x
                ripple = x + low
                x = ripple | (((x ^ ripple) >> 2) // low)
                if x >= limit:
                    break
        for i in range(n_nxt):
            s = nxt_mask[i]
            nxt_cost[i] = table[s]
            table[s] = -1
        cur_mask, nxt_mask = nxt_mask, cur_mask
        cur_cost, nxt_cost = nxt_cost, cur_cost
        n_cur = n_nxt
        if n_cur > peak:
            peak = n_cur
    best = cur_cost[0]
    for i in range(1, n_cur):
        if cur_cost[i] < best:
            best = cur_cost[i]
    return best, peak, -1
