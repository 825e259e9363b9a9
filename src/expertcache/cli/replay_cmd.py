"""``expertcache replay``: copies per token, hit rate and gap recovered for one or more policies."""

from __future__ import annotations

import argparse

from ..policies import available_policies, make_policy
from ..sim import build_layout, fill_gap, replay_layout
from .common import add_json, add_replay_options, describe, emit_json, open_trace, positive_int, setup_line, table

HELP = """Replay a trace through eviction policies at one capacity (lossless, demand fetch).

Counts follow DESIGN section 2: copies_total counts every insertion, copies_steady those made
once the pool is full (each evicts a victim), copies/token = steady copies over all layers and
sequences / scored tokens, hit rate = 1 - misses / requests. With both lru and belady in the run,
'gap recovered' is the share of the LRU-to-Belady gap in steady copies each policy closes.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a trace through eviction policies", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    p.add_argument("--capacity", "-c", type=positive_int, required=True, help="experts per pool")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=f"repeatable; one of {', '.join(available_policies())}, with a parameter as in "
                        "'decayed:0.9', 'foresight:16', 'random:7' (default: lru and belady)")
    add_replay_options(p)
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    trace = open_trace(args.trace)
    policies = [make_policy(s) for s in (args.policies or ["lru", "belady"])]
    layout = build_layout(trace, pool=args.pool, reset=args.reset, layers=args.layers, warm=args.warm)
    results = [replay_layout(layout, args.capacity, p) for p in policies]
    fill_gap(results)
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name} for r in results)
        return 0
    print(describe(trace))
    unit = "in the global pool" if args.pool == "global" else "per layer"
    print(setup_line(results[0], f"capacity {args.capacity} {unit}"))
    print_results(results)
    return 0


def print_results(results) -> None:
    """The policy table: copies/token, steady and total copies, hit rate, gap recovered."""
    rows = [
        (r.policy, r.copies_per_token, r.copies_steady, r.copies_total, r.hit_rate, r.gap_recovered)
        for r in results
    ]
    table(rows, ["policy", "copies/token", "steady", "total", "hit rate", "gap recovered"])
