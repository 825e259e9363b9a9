"""A deliberately naive replay, written from DESIGN section 2's definitions alone.

Every rule recomputes its key from the raw stream at each decision (no incremental state), as in
the seeds' blog code. It is slow and independent of the library's caches, which is the point.
"""

from __future__ import annotations

import math

INF = float("inf")


def _uses(stream, e, t):
    return [u for u in range(t) if e in stream[u]]


def _next(stream, e, t):
    return next((u for u in range(t + 1, len(stream)) if e in stream[u]), INF)


def rule_key(rule: str, stream, e, t, steps_per_token=1):
    """Eviction key of candidate e at step t (lowest goes first)."""
    name, _, arg = rule.partition(":")
    past = _uses(stream, e, t)
    if name == "lru":
        return past[-1]
    if name == "lfu":
        return len(past)
    if name == "decayed":
        beta = float(arg or 0.95)
        return sum(beta ** ((t - u) / steps_per_token) for u in past)
    if name == "belady":
        return -_next(stream, e, t)
    if name == "foresight":
        nu = _next(stream, e, t)
        return -INF if nu - t > int(arg or 16) * steps_per_token else -nu
    if name == "mean-interval":
        if len(past) < 2:
            return -INF
        return -(past[-1] + (past[-1] - past[0]) / (len(past) - 1))
    raise ValueError(rule)


def naive_stream(stream, capacity, rule, steps_per_token=1):
    """(copies_total, copies_steady) of one stream: a list of sets of items."""
    pool: set = set()
    total = steady = 0
    for t, demand in enumerate(stream):
        for e in sorted(demand - pool):
            if len(pool) == capacity:
                cands = pool - demand
                victim = min(cands, key=lambda c: (rule_key(rule, stream, c, t, steps_per_token), _uses(stream, c, t)[-1], c))
                pool.remove(victim)
                steady += 1
            pool.add(e)
            total += 1
    return total, steady


def naive_replay(trace, capacity, rule, pool="layer"):
    """(copies_total, copies_steady) summed over the trace's streams (reset at each sequence)."""
    total = steady = 0
    bounds = trace.seq_bounds
    L = trace.num_layers
    for a, b in zip(bounds[:-1], bounds[1:]):
        if pool == "layer":
            streams = [[{int(e) for e in trace.experts[t, l] if e >= 0} for t in range(a, b)] for l in range(L)]
            spt = 1
        else:
            streams = [[{(l, int(e)) for e in trace.experts[t, l] if e >= 0} for t in range(a, b) for l in range(L)]]
            spt = L
        for s in streams:
            n, m = naive_stream(s, capacity, rule, spt)
            total += n
            steady += m
    return total, steady


assert math.isinf(INF)
