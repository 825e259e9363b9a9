"""``expertcache demo``: the main job on the embedded default trace, in one command.

It replays the synthetic ``olmoe`` preset (calibrated to the eviction paper's OLMoE setting: 8 of
16 layers offloaded, 32 of 64 experts resident per layer) through every policy, certifies how far
Belady is from the optimum, and draws the miss-ratio and foresight curves. When the real traces
in ``../shared/traces`` are beside the checkout it also shows the policy table of a real one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from ..bounds import compute_bounds
from ..report.plots import plot_foresight, plot_mrc
from ..sim import replay_many
from ..sim.curves import foresight_curve, sweep
from ..trace import load_trace
from ..trace.synth import get_preset, synthesize_preset
from .common import describe, emit_json, open_trace, positive_int, setup_line
from .replay_cmd import print_results

POLICIES = ("lru", "lfu", "decayed", "mean-interval", "random", "foresight:16", "belady")
PAPER = ("seed 001 (OLMoE-1B-7B, 8 layers, C=32): lru 9.6 and belady 4.6 copies/token; "
         "decayed recovers 27% of the gap, foresight:16 96%")
REAL_TRACE = "flame-moe-290m-teacher-forced"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="replay the embedded default trace: policy table, bounds, plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo-out", help="folder for the PNG plots (default demo-out)")
    p.add_argument("--trace", help="run on this trace instead of the embedded default")
    p.add_argument("--capacity", "-c", type=positive_int, help="experts per layer (default 32, or E/2 with --trace)")
    p.add_argument("--seed", type=int, default=0, help="seed of the embedded default trace (default 0)")
    p.add_argument("--json", action="store_true", help="print the policy records as JSON lines, no tables")
    p.set_defaults(func=run)


def run(args) -> int:
    out = Path(args.out)
    if args.trace:
        trace, layers = open_trace(args.trace), None
        capacity = args.capacity or max(trace.top_k, trace.num_experts // 2)
    else:
        preset = get_preset("olmoe")
        trace = synthesize_preset("olmoe", seed=args.seed)
        layers, capacity = list(preset.replay_layers), args.capacity or preset.replay_capacity
    results = replay_many(trace, capacity, POLICIES, layers=layers)
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name} for r in results)
        return 0

    print(describe(trace))
    print(setup_line(results[0], f"capacity {capacity} per layer"))
    print_results(results)
    if not args.trace:
        print(f"(reference, {PAPER})")

    bounds = compute_bounds(trace, capacity, layers=layers)
    print(f"\nbounds on the optimum over all lossless schedules (steady copies): "
          f"B_flat {bounds.b_flat:,} <= B* <= B_greedy {bounds.b_greedy:,}")
    print(f"  {bounds.statement}; the bounds meet on {bounds.streams_tight} of {len(bounds.streams)} streams")

    curve = foresight_curve(trace, capacity, layers=layers)
    print("\nshare of the LRU-to-Belady gap recovered with h tokens of foresight:")
    print("  " + "  ".join(f"h={h}: {_pct(g)}" for h, g in zip(curve.horizons, curve.gap)))
    print("  causal rules: " + "  ".join(f"{r.policy}: {_pct(r.gap_recovered)}" for r in curve.references))

    lo = trace.top_k
    caps = sorted(set(range(lo, trace.num_experts + 1, max(1, (trace.num_experts - lo) // 28))) | {capacity})
    curves = sweep(trace, caps, ["lru", "decayed", "belady"], layers=layers)
    if importlib.util.find_spec("matplotlib") is None:
        print("\nplots skipped: matplotlib is not installed (pip install 'expertcache[plot]')")
    else:
        mrc = plot_mrc(curves, out / "mrc.png", trace=trace.name)
        fs = plot_foresight(curve, out / "foresight.png", trace=trace.name)
        print(f"\nwrote {mrc} and {fs}")

    real = _shared_trace()
    if real is not None and not args.trace:
        t = load_trace(real)
        c = t.num_experts // 2
        print(f"\nreal router trace from ../shared/traces: {describe(t)}")
        real_results = replay_many(t, c, POLICIES)
        print(setup_line(real_results[0], f"capacity {c} per layer"))
        print_results(real_results)
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _shared_trace() -> Path | None:
    root = Path(os.environ.get("EXPERTCACHE_SHARED_TRACES", Path.cwd().parent / "shared" / "traces"))
    path = root / REAL_TRACE / "routing.npz"
    return path if path.is_file() else None
