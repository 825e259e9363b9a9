"""Scale: a kimi-k3-shaped trace of 100,000 tokens (E = 896, k = 16, L = 92: about 147 M requests)
through lru and belady at 3 capacities, serial against stream-parallel replay (``--jobs 2``),
in the same run. Prints requests/s, the speed-up and the peak resident memory.

    .venv/bin/python benchmarks/bench_scale.py [--tokens 25000] [--sequences 4] [--jobs 2]

Counts must agree exactly between serial and parallel (checked here too). Ray is not measured:
the Ray backend is not built yet (issue 14).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time

from expertcache.sim import build_layout, replay_layout
from expertcache.sim.parallel import replay_streams_parallel
from expertcache.trace.synth import PRESETS, synthesize


def peak_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: kilobytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=25_000, help="tokens per sequence (default 25,000)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--capacities", default="32,64,128", help="experts per layer")
    args = ap.parse_args()
    params = dataclasses.replace(PRESETS["kimi-k3"].params, tokens=args.tokens, sequences=args.sequences)
    t0 = time.perf_counter()
    trace = synthesize(params, 0, preset="kimi-k3")
    t_synth = time.perf_counter() - t0
    t0 = time.perf_counter()
    layout = build_layout(trace)
    t_layout = time.perf_counter() - t0
    requests = int(layout.requests.sum())
    print(f"trace: T={trace.num_tokens:,} tokens, L={trace.num_layers}, k={trace.top_k}, E={trace.num_experts}: "
          f"{requests:,} requests in {layout.num_streams} streams (synth {t_synth:.1f} s, layout {t_layout:.1f} s)")
    print(f"{'policy':7} {'C':>4} {'serial M req/s':>15} {'jobs=' + str(args.jobs) + ' M req/s':>15} {'speed-up':>9}  counts")
    for cap in [int(c) for c in args.capacities.split(",")]:
        for policy in ("lru", "belady"):
            t0 = time.perf_counter()
            serial = replay_layout(layout, cap, policy)
            ts = time.perf_counter() - t0
            t0 = time.perf_counter()
            par = replay_streams_parallel(layout, cap, [policy], args.jobs)[0]
            tp = time.perf_counter() - t0
            same = (serial.copies_total, serial.copies_steady) == (par.copies_total, par.copies_steady)
            print(f"{policy:7} {cap:4d} {requests / ts / 1e6:15.1f} {requests / tp / 1e6:15.1f} {ts / tp:8.2f}x  "
                  f"{'agree' if same else 'DIFFER'} ({serial.copies_steady:,} steady)")
    print(f"peak resident memory: this process {peak_mb(resource.RUSAGE_SELF):,.0f} MB, "
          f"largest worker {peak_mb(resource.RUSAGE_CHILDREN):,.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
