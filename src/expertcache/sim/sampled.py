"""Sampled miss-ratio curves: spatially hashed sampling of (layer, expert) items, in the style of
SHARDS (Waldspurger et al., FAST '15), for any rule and both pools.

An item is kept when a hash of ``(layer, expert, seed)`` falls below ``rate`` (the same items in
every token: spatial, not temporal sampling). The sampled trace keeps every token and every
group: a token's sampled experts at a layer are still requested together, in the same step, and
the others become padding. It is replayed at the capacity scaled by the share of items kept,
``C' = round(C * kept / items)`` (per pool: ``L * E`` items in a global pool, ``E`` per layer;
the kept share is counted, not assumed, which is SHARDS' adjustment for the sample's size), never
below the widest sampled group. The estimates:

* ``hit_rate`` = 1 - sampled misses / sampled requests;
* ``copies_per_token`` = sampled steady copies / (kept share) / tokens.

Where it is accurate: SHARDS relies on many items; a sample of n items has a relative error of
about ``1/sqrt(n)`` in each of its counts. A global pool of a large model (Kimi-K3: 82,432 items)
at 1% keeps 824 items; per-layer pools of E = 64 at 1% keep 0.6 items a layer, and the scaled
capacity rounds to nothing. :func:`sampled_curve` says how many items it kept; :func:`choose_rate`
picks the smallest rate whose estimates from :data:`SEEDS` independent hashes agree within a target.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from ..policies import Policy
from ..trace import Trace
from ..trace.chunked import ChunkedTrace
from ..trace.sampling import item_mask, sample_trace
from .chunked import selected_cols, sweep_chunked, widest_group
from .curves.mrc import MissRatioCurve, sweep_layout
from .layout import build_layout
from .options import StreamOptions

SEEDS = 4
"""Independent hashes :func:`choose_rate` compares at each rate."""
MIN_POOL_ITEMS = 64
"""Fewest items one sampled pool may expect to keep (``rate x`` its items) before seeds' agreement
means anything: below it a sample's capacity covers every kept item and every hash says 'all hits'."""


@dataclasses.dataclass
class SampledCurve:
    """Estimates of one rule's curve from a sample (see the module docstring).

    ``capacities``: the full trace's; ``sampled_capacities``: those replayed on the sample;
    ``kept``/``items``: items kept of the pool's items (a per-layer pool's counted over all layers).
    """

    policy: str
    rate: float
    seed: int
    capacities: np.ndarray
    sampled_capacities: np.ndarray
    kept: int
    items: int
    hit_rate: np.ndarray
    copies_per_token: np.ndarray
    requests: int
    seconds: float

    pool_items: int = 0
    """Items one pool holds in the full trace (E per layer, L x E global)."""

    @property
    def share(self) -> float:
        return self.kept / self.items if self.items else 0.0

    @property
    def pool_kept(self) -> float:
        """Items one sampled pool keeps, on average."""
        return self.pool_items * self.share

    def records(self) -> list[dict]:
        return [{"policy": self.policy, "capacity": int(c), "sampled_capacity": int(sc), "hit_rate": float(h),
                 "miss_ratio": float(1 - h), "copies_per_token": float(cpt), "rate": self.rate, "seed": self.seed,
                 "kept_items": self.kept, "items": self.items, "pool_items_kept": self.pool_kept,
                 "sampled_requests": self.requests,
                 "seconds": self.seconds}
                for c, sc, h, cpt in zip(self.capacities, self.sampled_capacities, self.hit_rate, self.copies_per_token)]


def sampled_curve(trace: "Trace | ChunkedTrace", capacities: Sequence[int], policy: "str | Policy", rate: float, *,
                  seed: int = 0, options: StreamOptions | None = None, jobs: int = 1,
                  ray: str | None = None) -> SampledCurve:
    """The estimated curve of ``policy`` at ``capacities`` from the items sampled at ``rate``. A
    chunked trace is sampled unit by unit (:mod:`expertcache.sim.chunked`: the same items in every
    chunk, ``jobs``/``ray`` as its sweep), with the whole trace's estimates: one pass finds the
    widest sampled group, a second sweeps."""
    t0 = time.perf_counter()
    options = options or StreamOptions()
    cols = selected_cols(trace, options)
    mask = np.zeros((trace.num_layers, trace.num_experts), dtype=bool)
    mask[cols] = item_mask(len(cols), trace.num_experts, rate, seed)
    kept, items = int(mask[cols].sum()), len(cols) * trace.num_experts
    if not kept:
        raise ConfigError(f"--sample-rate {rate:g} keeps none of the {items:,} items (layer, expert): raise it")
    if isinstance(trace, ChunkedTrace):
        widest = max(widest_group(trace, options, mask=mask, jobs=jobs, ray=ray), 1)

        def sweep_at(caps):
            return sweep_chunked(trace, caps, [policy], options, jobs=jobs, ray=ray, mask=mask)[0]
    else:
        layout = build_layout(sample_trace(trace, mask), options)
        widest = max(layout.widest, 1)

        def sweep_at(caps):
            return sweep_layout(layout, caps, [policy])[0]
    share = kept / items
    pool_items = items if options.pool == "global" else trace.num_experts
    caps = np.asarray(sorted({int(c) for c in capacities}), dtype=np.int64)
    scaled = np.maximum(widest, np.minimum(np.rint(caps * share), max(widest, round(pool_items * share)))).astype(np.int64)
    curve = sweep_at(sorted({int(c) for c in scaled}))
    at = {int(c): i for i, c in enumerate(curve.capacities)}
    idx = np.array([at[int(c)] for c in scaled])
    tokens = curve.tokens
    return SampledCurve(
        policy=curve.policy, rate=float(rate), seed=int(seed), capacities=caps, sampled_capacities=scaled,
        kept=kept, items=items, hit_rate=curve.hit_rate[idx],
        copies_per_token=(curve.copies_steady[idx] / share / tokens) if tokens else np.full(idx.size, np.nan),
        requests=curve.requests, seconds=time.perf_counter() - t0, pool_items=pool_items)


def curve_error(sampled: SampledCurve, exact: MissRatioCurve) -> float:
    """Mean absolute error of the sampled miss ratio against the exact curve, over the capacities."""
    at = {int(c): i for i, c in enumerate(exact.capacities)}
    truth = np.array([exact.hit_rate[at[int(c)]] for c in sampled.capacities])
    return float(np.mean(np.abs((1 - sampled.hit_rate) - (1 - truth))))


def choose_rate(trace: "Trace | ChunkedTrace", capacities: Sequence[int], policy: "str | Policy", target: float, *,
                options: StreamOptions | None = None, start: float = 0.01, jobs: int = 1,
                ray: str | None = None) -> tuple[float, float]:
    """``(rate, spread)``: the smallest of ``start, 2 start, 4 start, ... 1`` at which a pool expects
    at least :data:`MIN_POOL_ITEMS` items and :data:`SEEDS` independent hashes give miss ratios whose
    standard error (their standard deviation over ``sqrt(SEEDS)``, the mean over capacities) is at
    most ``target``; rate 1 is exact (spread 0). The spread measures the hash's variance only, not
    the bias of a small sample (docs/scale.md gives the errors against exact curves)."""
    if not (isinstance(target, float) and 0 < target < 1):
        raise ConfigError(f"--target-error: {target!r} is outside (0, 1)")
    options = options or StreamOptions()
    L = len(selected_cols(trace, options))
    pool_items = trace.num_experts * (L if options.pool == "global" else 1)
    rate = start
    while rate < 1.0 and rate * pool_items < MIN_POOL_ITEMS:  # too few items for any estimate
        rate = min(1.0, rate * 2)
    while rate < 1.0:
        runs = []
        for seed in range(SEEDS):
            try:
                runs.append(1 - sampled_curve(trace, capacities, policy, rate, seed=seed, options=options, jobs=jobs,
                                              ray=ray).hit_rate)
            except ConfigError:  # no item kept at this rate with this seed
                runs = []
                break
        if runs:
            spread = float(np.mean(np.std(np.stack(runs), axis=0, ddof=1)) / math.sqrt(SEEDS))
            if spread <= target:
                return rate, spread
        rate = min(1.0, rate * 2)
    return 1.0, 0.0
