"""``expertcache demo``: the main job on the embedded default trace, in one command.

It replays the synthetic ``olmoe`` preset (calibrated to the eviction paper's OLMoE setting: 8 of
16 layers offloaded, 32 of 64 experts resident per layer) through every policy, certifies how far
Belady is from the optimum, and draws the miss-ratio and foresight curves. On that trace it sizes
the copies with the eviction paper's L40S figures (expert 12.6 MB in bf16, tau = 0.51 ms per copy,
c = 1000/49.0 ms per token with every expert resident): MB/token, GB/s, ms/token and tokens/s
(docs/sizing.md); the sizing options override them. When the real traces in ``../shared/traces``
are beside the checkout it also shows the policy table of a real one. Last (unless --no-live),
where torch and ``models/small-moe`` are present: lossless and set-holding rules run live on the
small trained MoE, and the policy ``expertcache choose`` picks, checked against slowed copies.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from .._io import check_not_input
from ..bounds import compute_bounds
from ..costmodel import Sizing
from ..errors import ConfigError
from ..report.plots import plot_foresight, plot_mrc
from ..sim import replay_many
from ..sim.curves import foresight_curve, sweep
from ..trace import load_trace
from ..trace.synth import get_preset, synthesize_preset
from .budget_opts import print_results
from .common import describe, emit_json, open_trace, positive_int, seed_int, setup_line
from .sizing_opts import add_sizing_options, resolve_sizing

POLICIES = ("lru", "lfu", "decayed", "mean-interval", "random", "foresight:16", "belady")
PAPER = ("the eviction paper (OLMoE-1B-7B on an L40S, 8 layers, C=32): lru 9.6 and belady 4.6 copies/token; "
         "lru decoded at 38.3 tok/s measured, 49.0 with every expert resident; decayed recovers 27% of the gap, "
         "foresight:16 96%")
L40S = Sizing(expert_bytes=3 * 2048 * 1024 * 2, tau_ms=0.51, c_ms=1000 / 49.0)
"""The eviction paper's Table 1 on the L40S: OLMoE bf16 experts (12.6 MB), 0.51 ms per copy, 49.0
tok/s with every expert resident (c = 1000/49.0 ms)."""
L40S_SOURCE = "the eviction paper's L40S"
REAL_TRACE = "flame-moe-290m-teacher-forced"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="replay the embedded default trace: policy table, sizing, bounds, plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo-out", help="folder for the PNG plots (default demo-out; created if missing)")
    p.add_argument("--trace", help="run on this trace instead of the embedded default")
    p.add_argument("--capacity", "-c", type=positive_int, help="experts per layer (default 32, or E/2 with --trace)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the embedded default trace (default 0)")
    add_sizing_options(p)
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="live part: time every run N times, interleaved; the median is shown and a lead inside "
                        "the spread is a tie (default 3)")
    p.add_argument("--no-live", action="store_true",
                   help="skip the live part (eval of lossless and set-holding rules on models/small-moe, and choose)")
    p.add_argument("--json", action="store_true", help="print the policy records as JSON lines, no tables")
    p.set_defaults(func=run)


PLOTS = ("mrc.png", "foresight.png")
"""The files the demo writes into ``--out``."""


def run(args) -> int:
    out = Path(args.out)
    if not args.json:
        for name in PLOTS:  # a --trace inside --out under a plot's name had been replaced by the plot
            check_not_input(out / name, [args.trace] if args.trace else [], "--out")
        _make_folder(out)  # before any work: a bad --out fails at once
    if args.trace:
        trace, layers = open_trace(args.trace), None
        capacity = args.capacity or max(trace.top_k, trace.num_experts // 2)
        setup = resolve_sizing(args, trace)
    else:
        preset = get_preset("olmoe")
        trace = synthesize_preset("olmoe", seed=args.seed)
        layers, capacity = list(preset.replay_layers), args.capacity or preset.replay_capacity
        setup = resolve_sizing(args, trace, defaults=L40S, default_source=L40S_SOURCE)
    _check_capacity(capacity, trace)  # before anything is printed
    results = replay_many(trace, capacity, POLICIES, layers=layers)
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name} | setup.result_record(r) for r in results)
        return 0

    print(describe(trace))
    print(setup_line(results[0], f"capacity {capacity} per layer"))
    print_results(results, setup)
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
        mrc = plot_mrc(curves, out / PLOTS[0], trace=trace.name)
        if any(g is not None for g in curve.gap):
            print(f"\nwrote {mrc} and {plot_foresight(curve, out / PLOTS[1], trace=trace.name)}")
        else:
            print(f"\nwrote {mrc}; foresight plot skipped: LRU and Belady tie at capacity {capacity}, no gap to share")

    real = _shared_trace()
    if real is not None and not args.trace:
        t = load_trace(real)
        c = t.num_experts // 2
        print(f"\nreal router trace from ../shared/traces: {describe(t)}")
        real_results = replay_many(t, c, POLICIES)
        print(setup_line(real_results[0], f"capacity {c} per layer"))
        print_results(real_results, resolve_sizing(args, t))  # the paper's figures are OLMoE's, not this model's
    if not args.trace and not args.no_live:
        from .demo_live import live_section

        live_section(args.repeats)
    return 0


def _check_capacity(capacity: int, trace) -> None:
    """The demo compares policies: at or above E every expert fits and none matters, below k none
    can serve a token. Refused in one line before the report starts."""
    E, k = trace.num_experts, trace.top_k
    if capacity >= E:
        raise ConfigError(f"-c {capacity}: at or above E={E} every expert fits and no policy makes a copy, so there "
                          f"is nothing to compare; give a capacity from {k} to {E - 1} (default {max(k, E // 2)})")
    if capacity < k:
        raise ConfigError(f"-c {capacity}: below the {k} experts one token requests at a layer; give {k} to {E - 1}")


def _make_folder(out: Path) -> None:
    """The demo's output folder: created if missing, but its parent must exist."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, expected a folder")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create it ({exc.strerror or exc})") from None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _shared_trace() -> Path | None:
    root = Path(os.environ.get("EXPERTCACHE_SHARED_TRACES", Path.cwd().parent / "shared" / "traces"))
    path = root / REAL_TRACE / "routing.npz"
    return path if path.is_file() else None
