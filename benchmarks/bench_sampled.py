"""Sampled curves against exact ones (issue 36, item 3): the mean absolute error of the miss ratio
and the speed-up over the exact sweep, at 1% and 10% sampling, on the shared real traces (when
../shared/traces is beside the checkout) and on synthetic presets drawn with a seed the presets
were not fitted on (seed 1), for LRU and Belady, per-layer and global pools.

    .venv/bin/python benchmarks/bench_sampled.py [--rates 0.01,0.1] [--seeds 3] [--json]

Capacities: 10%, 25% and 50% of a pool's items (E per layer, L x E global), at least k. The error
of a rate is the mean over --seeds hashes; the time of a rate is its mean, against one exact sweep
in the same run (both include laying the trace out; the exact LRU curve is one stack pass).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from expertcache.errors import ConfigError
from expertcache.sim import StreamOptions, build_layout
from expertcache.sim.curves.mrc import sweep_layout
from expertcache.sim.sampled import curve_error, sampled_curve
from expertcache.trace import load_trace
from expertcache.trace.synth import synthesize_preset

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
SYNTH = {"kimi-k3": {"tokens": 2000, "sequences": 4}, "deepseek-v3": {"tokens": 2000, "sequences": 4},
         "qwen3-30b-a3b": {"tokens": 2000, "sequences": 4}, "olmoe": {}}


def traces():
    for path in sorted(SHARED.glob("*/routing.npz")):
        yield f"real {path.parent.name}", load_trace(path)
    for name, overrides in SYNTH.items():
        yield f"synth {name} (seed 1)", synthesize_preset(name, 1, **overrides)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.01,0.1")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    records = []
    print(f"{'trace':40} {'pool':6} {'rule':6} {'items/pool':>10} " + " ".join(
        f"{'MAE@' + format(r, 'g'):>9} {'x faster':>8} {'kept/pool':>9}" for r in rates))
    for label, trace in traces():
        for pool in ("layer", "global"):
            options = StreamOptions.of(pool=pool)
            pool_items = trace.num_experts * (trace.num_layers if pool == "global" else 1)
            caps = sorted({max(trace.top_k, int(pool_items * f)) for f in (0.1, 0.25, 0.5)})
            for rule in ("lru", "belady"):
                t0 = time.perf_counter()
                exact = sweep_layout(build_layout(trace, options), caps, [rule])[0]
                t_exact = time.perf_counter() - t0
                row = {"trace": label, "pool": pool, "rule": rule, "pool_items": pool_items, "capacities": caps,
                       "exact_seconds": t_exact, "rates": {}}
                cells = []
                for rate in rates:
                    try:
                        runs = [sampled_curve(trace, caps, rule, rate, seed=s, options=options) for s in range(args.seeds)]
                    except ConfigError:  # some hash kept no item at all
                        row["rates"][str(rate)] = None
                        cells.append(f"{'no item kept':>28}")
                        continue
                    mae = float(np.mean([curve_error(r, exact) for r in runs]))
                    secs = float(np.mean([r.seconds for r in runs]))
                    kept = float(np.mean([r.pool_kept for r in runs]))
                    row["rates"][str(rate)] = {"mae": mae, "seconds": secs, "speedup": t_exact / secs,
                                               "pool_items_kept": kept}
                    cells.append(f"{mae:9.4f} {t_exact / secs:8.1f} {kept:9.1f}")
                records.append(row)
                print(f"{label:40} {pool:6} {rule:6} {pool_items:10d} " + " ".join(cells), flush=True)
    if args.json:
        print(json.dumps(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
