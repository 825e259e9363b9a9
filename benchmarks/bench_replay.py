"""Replay speed: expertcache against libCacheSim's native loop, measured in the same run.

1. A 2,000,000-request k = 1 trace (4,096 ids, Zipf-like with bursts and drifting popularity,
   one layer, one sequence: the synthetic ``bench-k1`` preset) through ``lru`` and ``belady`` at
   capacity 512, in expertcache (``expertcache.replay``, end to end from an in-memory trace,
   including its layout and, for belady, its next-use precomputation) and in libCacheSim
   (``process_trace`` over its oracleGeneral reader; writing that file is excluded). The miss
   counts must agree; requests/s of each side and the ratio are printed. The same for ``arc``,
   ``s3fifo`` and ``sieve``: rules written once as hooks of the compiled engine
   (``expertcache.policies.driver``) against libCacheSim's native ``ARC``, ``S3FIFO`` and ``Sieve``.
2. requests/s of every policy on a token-grouped trace (E=64, k=8, L=16, 4,000 tokens).

Times are the best of ``--repeat`` runs after one warm-up (numba compiles on first use).
Run: ``python benchmarks/bench_replay.py [--requests N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import expertcache as ec
from expertcache.trace.exporters import export_libcachesim
from expertcache.trace.synth import synthesize_preset


def best_of(fn, repeat):
    fn()  # warm-up: compile, page in
    best = float("inf")
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_libcachesim(trace, capacity, repeat):
    try:
        import libcachesim as lcs
    except ImportError:
        print("libcachesim is not installed (pip install libcachesim): skipping the comparison")
        return None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral"
        n = export_libcachesim(trace, path, fmt="oracle")
        for ours_name, theirs in (("lru", lcs.LRU), ("belady", lcs.Belady), ("arc", lcs.ARC), ("s3fifo", lcs.S3FIFO),
                                  ("sieve", lcs.Sieve)):
            def run_lcs():
                reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
                return round(theirs(capacity).process_trace(reader)[0] * n)

            def run_ours():
                return ec.replay(trace, capacity, ours_name, reset="none").copies_total

            t_lcs, m_lcs = best_of(run_lcs, repeat)
            t_ours, m_ours = best_of(run_ours, repeat)
            agree = "agree" if m_lcs == m_ours else "DISAGREE"
            rows.append((ours_name, n / t_ours / 1e6, n / t_lcs / 1e6, t_lcs / t_ours, m_ours, m_lcs, agree))
    print(f"\n{n:,} requests, k=1, 4,096 ids, capacity {capacity} (best of {repeat})")
    print(f"{'policy':8} {'expertcache M req/s':>20} {'libCacheSim M req/s':>20} {'ratio':>7} {'misses (ours)':>14} {'misses (lcs)':>13}")
    for name, ours, theirs, ratio, m1, m2, agree in rows:
        print(f"{name:8} {ours:20.1f} {theirs:20.1f} {ratio:6.2f}x {m1:14,} {m2:13,}  {agree}")
    return rows


def bench_grouped(repeat):
    trace = synthesize_preset("olmoe", seed=0, tokens=4000, sequences=1, num_layers=16)
    n = trace.num_requests
    print(f"\ntoken-grouped trace: E={trace.num_experts}, k={trace.top_k}, L={trace.num_layers}, "
          f"T={trace.num_tokens} ({n:,} requests), capacity 32 per layer (best of {repeat})")
    print(f"{'policy':14} {'M req/s':>8} {'copies/token':>13}")
    for policy in ("lru", "lfu", "decayed", "mean-interval", "belady", "foresight:16", "random", "arc", "s3fifo",
                   "sieve"):
        t, r = best_of(lambda: ec.replay(trace, 32, policy), repeat)
        print(f"{policy:14} {n / t / 1e6:8.1f} {r.copies_per_token:13.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2_000_000)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}, "
          f"numpy {np.__version__}")
    t0 = time.perf_counter()
    trace = synthesize_preset("bench-k1", seed=0, tokens=args.requests)
    print(f"generated bench-k1: {trace.num_tokens:,} requests in {time.perf_counter() - t0:.2f} s")
    rows = bench_libcachesim(trace, args.capacity, args.repeat)
    bench_grouped(args.repeat)
    if rows and any(r[-1] != "agree" for r in rows):
        print("miss counts disagree with libCacheSim", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
