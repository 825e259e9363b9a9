"""``expertcache bounds`` and ``expertcache verify-greedy``: how far belady is from the optimum."""

from __future__ import annotations

import argparse
import os

from ..bounds import DEFAULT_MAX_STATES, ORDERS, compute_bounds, verify_greedy
from .budget_opts import clamp_capacity
from .common import (add_json, add_replay_options, check_local_jobs, describe, emit_json, open_trace, positive_int,
                     seed_int, table)

BOUNDS_HELP = """Bound the fewest copies any lossless schedule needs, per stream (docs/bounds.md).

B_flat: classical MIN on each stream flattened to single requests (each token's ids listed
consecutively, in router, ascending and descending order; per stream the largest is kept).
B_greedy: steady copies of belady (farthest-future eviction). B_flat <= B* <= B_greedy, so belady
is within (B_greedy - B_flat) / B_flat of the optimum B*. A stream is tight when the two bounds
agree; its gap is (b_greedy - b_flat) / b_flat. All counts are steady copies
(max(0, copies_total - C) per stream) summed over streams. --exact adds B* from a dynamic program
over resident sets, feasible only for small streams (few distinct experts).
"""

VERIFY_HELP = """Check that belady matches the exact optimum on random small instances.

Instances mix uniform, Zipf-skewed and bursty demand (k = 2..4 experts per token, served ratio
k/C from 1/4..1/3 on half of them, tighter pools on the rest, 12..40 tokens, at most 18 distinct
experts). Each is solved exactly by dynamic programming and compared with the belady policy and the
flattened-MIN bound. Exits 1 and prints the first counterexample if belady is ever beaten.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bounds", help="lower/upper bounds (and the exact optimum) of lossless copies",
                       description=BOUNDS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    p.add_argument("--capacity", "-c", type=positive_int, required=True, help="experts per pool")
    p.add_argument("--exact", action="store_true", help="also compute the exact optimum B* (small streams only)")
    p.add_argument("--max-states", type=positive_int, default=DEFAULT_MAX_STATES, metavar="N",
                   help=f"with --exact: most resident sets alive after one step (default {DEFAULT_MAX_STATES:,})")
    p.add_argument("--order", action="append", dest="orders", choices=ORDERS,
                   help="flattening order, repeatable (default: all three)")
    add_replay_options(p, warm=None)
    add_json(p)
    p.set_defaults(func=run_bounds)

    v = sub.add_parser("verify-greedy", help="check belady against the exact optimum on random instances",
                       description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--instances", "-n", type=positive_int, default=42_000, help="instances to check (default 42,000)")
    v.add_argument("--jobs", "-j", type=positive_int, default=os.cpu_count() or 1,
                   help="worker processes (default: all cores; at most 4 per core)")
    v.add_argument("--seed", type=seed_int, default=0, help="instance i is a function of (seed, i) (default 0)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json(v)
    v.set_defaults(func=run_verify)


def run_bounds(args) -> int:
    trace = open_trace(args.trace)
    layers = trace.num_layers if args.layers is None else len(set(args.layers))
    n_items = trace.num_experts * (layers if args.pool == "global" else 1)
    capacity, note = clamp_capacity(args.capacity, n_items, args.pool)
    report = compute_bounds(trace, capacity, pool=args.pool, reset=args.reset, layers=args.layers,
                            orders=args.orders or ORDERS, exact=args.exact, max_states=args.max_states)
    if args.json:
        emit_json([report.to_dict()])
        return 0
    print(describe(trace))
    if note:
        print(note)
    by = "layer" if report.pool == "layer" else "sequence"
    print(f"capacity {report.capacity} per {'layer' if report.pool == 'layer' else 'pool shared by all layers'}, "
          f"{len(report.layers)} layer(s), {len(report.streams)} stream(s); steady copies per {by}:")
    rows = []
    for key in dict.fromkeys(getattr(s, by) for s in report.streams):
        group = [s for s in report.streams if getattr(s, by) == key]
        rows.append(_row(key, group, report.exact))
    rows.append(_row("all", report.streams, report.exact))
    headers = [by, "streams", "tight", "B_flat", "B_greedy"] + (["B*"] if report.exact else []) + ["gap"]
    table(rows, headers)
    n = len(report.streams)
    print(f"tight streams (B_flat = B_greedy): {report.streams_tight} of {n}; "
          f"median gap per stream {100 * report.median_gap:.2f}%; "
          f"flattening orders used: {', '.join(f'{o} {c}' for o, c in report.orders_used().items())}")
    if report.streams_unfilled:
        print(f"{report.streams_unfilled} stream(s) never fill the pool (at most {report.capacity} distinct experts)")
    print(report.statement)
    return 0


def _row(key, streams, exact):
    b_flat, b_greedy = sum(s.b_flat for s in streams), sum(s.b_greedy for s in streams)
    star = [sum(s.b_star for s in streams)] if exact else []
    gap = (b_greedy - b_flat) / b_flat if b_flat else (0.0 if b_greedy == 0 else None)
    return [key if key is not None else "-", len(streams), sum(s.tight for s in streams), b_flat, b_greedy, *star, gap]


def run_verify(args) -> int:
    check_local_jobs(args.jobs)
    progress = not (args.no_progress or args.json)  # and only on a terminal (expertcache._progress)
    report = verify_greedy(args.instances, seed=args.seed, jobs=args.jobs, progress=progress)
    failed = bool(report.mismatches or report.violations)
    if args.json:
        emit_json([report.to_dict()])
        return 1 if failed else 0
    print(f"verify-greedy: {report.instances:,} instances (seed {report.seed}, {report.jobs} job(s)) "
          f"in {report.seconds:.1f} s; {report.paper_band:,} with served ratio k/C in 1/4..1/3")
    rows = [[f, *row] for f, row in report.by_family.items()]
    table(rows, ["family", "instances", "mismatches", "B_flat < B*"])
    if report.violations:
        print(f"BUG: {len(report.violations)} instance(s) break B_flat <= B* <= B_greedy")
    if report.mismatches:
        print(f"belady was beaten by the exact optimum on {len(report.mismatches):,} instance(s)")
    else:
        print(f"belady matched the exact optimum on all {report.instances:,} instances; on "
              f"{report.flat_loose:,} of them B_flat < B*, so only the exact program could certify it")
    example = report.counterexample()
    if example is not None:
        print("first counterexample: " + ", ".join(f"{k} {v}" for k, v in example.items() if k != "requests"))
        print("  requests per token: " + " ".join("{" + ",".join(map(str, r)) + "}" for r in example["requests"]))
    return 1 if failed else 0
