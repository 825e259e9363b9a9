"""Scale: a kimi-k3-shaped trace of 100,000 tokens (E = 896, k = 16, L = 92: about 147 M requests)
through lru and belady at 3 capacities: serial, stream-parallel on a local process pool
(``--jobs 2``) and on a local Ray with 2 workers, in the same run. Prints requests/s, the speed-up
over serial, the one-time start of each backend's workers and the peak resident memory.

    .venv/bin/python benchmarks/bench_scale.py [--tokens 25000] [--sequences 4] [--jobs 2] [--no-ray]

Counts must agree exactly between serial and every parallel run (checked here too). The workers
of each backend are started once and serve all six replays (``StreamReplayer``); their start
(spawning, handing over the group array) is printed apart from the per-replay times.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import time
from pathlib import Path

from expertcache.sim import build_layout, replay_layout
from expertcache.sim.parallel import StreamReplayer
from expertcache.trace.synth import PRESETS, synthesize


def peak_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: kilobytes


def ray_workers_peak_mb() -> float:
    """The largest peak RSS (VmHWM) among this machine's Ray worker processes ('ray::' in their title)."""
    best = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if not (d / "cmdline").read_bytes().startswith(b"ray::"):
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]) / 1024)
        except OSError:
            continue
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=25_000, help="tokens per sequence (default 25,000)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--capacities", default="32,64,128", help="experts per layer")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray backend")
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
    cells = [(int(c), p) for c in args.capacities.split(",") for p in ("lru", "belady")]
    serial = {}
    for cap, policy in cells:
        t0 = time.perf_counter()
        serial[cap, policy] = (replay_layout(layout, cap, policy), time.perf_counter() - t0)
    backends = [("jobs", None)] + ([] if args.no_ray else [("ray", "auto")])
    runs = {}
    for name, ray in backends:
        with StreamReplayer(layout, args.jobs, ray=ray) as rp:
            for cap, policy in cells:
                t0 = time.perf_counter()
                r = rp.replay(cap, [policy])[0]
                runs[name, cap, policy] = (r, time.perf_counter() - t0)
            start = rp.start_seconds
            ray_peak = ray_workers_peak_mb() if ray else 0.0
        print(f"{name} backend ({args.jobs} workers): start {start:.1f} s (once, not in the times below)"
              + (f"; peak RSS of a Ray worker {ray_peak:,.0f} MB" if ray else ""))
    heads = "".join(f" {n + '=' + str(args.jobs) + ' M req/s':>16} {'speed-up':>9}" for n, _ in backends)
    print(f"{'policy':7} {'C':>4} {'serial M req/s':>15}{heads}  counts")
    for cap, policy in cells:
        s, ts = serial[cap, policy]
        line = f"{policy:7} {cap:4d} {requests / ts / 1e6:15.1f}"
        agree = True
        for name, _ in backends:
            r, tp = runs[name, cap, policy]
            line += f" {requests / tp / 1e6:16.1f} {ts / tp:8.2f}x"
            agree &= (s.copies_total, s.copies_steady, s.per_layer) == (r.copies_total, r.copies_steady, r.per_layer)
        print(f"{line}  {'agree' if agree else 'DIFFER'} ({s.copies_steady:,} steady)")
    print(f"peak resident memory: this process {peak_mb(resource.RUSAGE_SELF):,.0f} MB, "
          f"largest local worker {peak_mb(resource.RUSAGE_CHILDREN):,.0f} MB; cores {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
