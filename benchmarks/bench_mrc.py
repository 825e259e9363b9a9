"""One-pass LRU miss-ratio curve against one single-capacity replay, measured in the same run.

For each trace below, four timings (best of ``--repeat`` after a warm-up that compiles numba):

* ``replay``: ``expertcache.replay(trace, C, "lru")`` at one capacity (C = half the item space),
  end to end from an in-memory trace (layout, compiled LRU loop, tally);
* ``curve``: ``sweep(trace, None, ["lru"])``, every capacity from k to E (``L * E`` in a global
  pool), also end to end -- one stack pass;
* ``replays``: the same curve by replaying every capacity on one shared layout (what the stack pass
  replaces); the curve must equal it count for count, which is checked;
* the two compiled loops alone on one layout (``lru_loop`` vs ``stack_histograms``).

Target: curve / replay <= 2. The traces are "sticky Zipf" token-grouped routing: per layer a Zipf
popularity over a random permutation of the experts, each of the previous token's experts kept
with probability ``keep``, the rest drawn by popularity without replacement (Gumbel top-k). The
k=8 trace is set to OLMoE-like locality: LRU hits about 85% at C=32 of 64, as the 9.6 copies per
token over 8 layers of seed 001 imply.

Run: ``python benchmarks/bench_mrc.py [--repeat R]``.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

import expertcache as ec
from expertcache.kernels import lru_loop
from expertcache.sim import build_layout
from expertcache.sim.curves import sweep, sweep_layout
from expertcache.sim.curves.mrc import _histograms


def sticky_zipf(T: int, L: int, E: int, k: int, *, sequences: int, keep: float, alpha: float, seed: int) -> ec.Trace:
    rng = np.random.default_rng(seed)
    logp = np.stack([-alpha * np.log1p(rng.permutation(E)) for _ in range(L)])  # [L, E]
    ex = np.empty((T, L, k), dtype=np.int32)
    rows = np.arange(L)[:, None]
    prev = None
    for t in range(T):
        score = logp - np.log(-np.log(rng.random((L, E))))  # Gumbel: top-k ~ draws without replacement
        if prev is not None and t % (T // sequences):
            kept = np.where(rng.random((L, k)) < keep, prev, -1)
            score[rows, np.where(kept >= 0, kept, 0)] = np.where(kept >= 0, np.inf, score[rows, np.where(kept >= 0, kept, 0)])
        prev = np.argpartition(-score, k - 1, axis=1)[:, :k].astype(np.int32)
        ex[t] = prev
    seq = np.repeat(np.arange(sequences), T // sequences)
    seq = np.r_[seq, np.full(T - seq.size, sequences - 1)]
    return ec.Trace.from_arrays(ex, seq, num_experts=E, meta={"name": f"sticky-zipf E={E} k={k} L={L} T={T}"})


def best_of(fn, repeat):
    out = fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench(trace: ec.Trace, pool: str, repeat: int) -> None:
    layout = build_layout(trace, pool=pool)
    C = layout.n_items // 2
    t_one, _ = best_of(lambda: ec.replay(trace, C, "lru", pool=pool), repeat)
    t_curve, (curve,) = best_of(lambda: sweep(trace, None, ["lru"], pool=pool), repeat)
    t_many, (many,) = best_of(lambda: sweep_layout(layout, None, ["lru"], one_pass=False), max(1, repeat // 4))
    same = all(
        (a.copies_total, a.copies_steady, a.requests) == (b.copies_total, b.copies_steady, b.requests)
        for a, b in zip(curve.results, many.results)
    ) and len(curve.results) == len(many.results)
    t_loop, _ = best_of(lambda: lru_loop(layout.groups, layout.starts, layout.n_items, C), repeat)
    t_stack, _ = best_of(lambda: _histograms(layout), repeat)
    caps = curve.capacities
    print(f"\n{trace.name}, {trace.num_sequences} sequences, {trace.num_requests:,} requests, {pool} pool"
          f" (LRU hit rate at C={C}: {curve.at(C).hit_rate:.3f})")
    print(f"  replay lru, C={C:<5}            {1e3 * t_one:9.2f} ms")
    print(f"  curve, {caps.size} capacities {caps[0]}..{caps[-1]:<6} {1e3 * t_curve:9.2f} ms"
          f"   ratio curve/replay {t_curve / t_one:5.2f}x   (target <= 2)")
    print(f"  {caps.size} replays, one per capacity  {1e3 * t_many:9.2f} ms"
          f"   one pass is {t_many / t_curve:5.1f}x faster; counts {'equal' if same else 'DIFFER'}")
    print(f"  compiled loops alone: stack {1e3 * t_stack:.2f} ms vs lru_loop {1e3 * t_loop:.2f} ms"
          f" = {t_stack / t_loop:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="timed runs per measurement (best is kept)")
    args = ap.parse_args()
    print(f"bench_mrc: python {platform.python_version()}, numpy {np.__version__}, best of {args.repeat}")
    grouped = sticky_zipf(4000, 16, 64, 8, sequences=8, keep=0.5, alpha=1.0, seed=0)
    single = sticky_zipf(4000, 16, 64, 1, sequences=8, keep=0.3, alpha=1.0, seed=1)
    bench(grouped, "layer", args.repeat)
    bench(grouped, "global", args.repeat)
    bench(single, "layer", args.repeat)


if __name__ == "__main__":
    main()
