"""``expertcache replay``: copies per token, hit rate and gap recovered for one or more policies."""

from __future__ import annotations

import argparse

from ..policies import available_policies, make_policy
from ..sim import build_layout, fill_gap, replay_layout
from .common import add_json, add_replay_options, describe, emit_json, open_trace, positive_int, setup_line, table
from .sizing_opts import SizingSetup, add_sizing_options, resolve_sizing

HELP = """Replay a trace through eviction policies at one capacity (lossless, demand fetch).

Counts follow docs/semantics.md: copies_total counts every insertion, copies_steady those made
once the pool is full (each evicts a victim), copies/token = steady copies over all layers and
sequences / scored tokens, hit rate = 1 - misses / requests. With both lru and belady in the run,
'gap recovered' is the share of the LRU-to-Belady gap in steady copies each policy closes. The
'future' column marks policies that read the recorded future (clairvoyant: offline references).

The sizing options turn copies/token into MB/token, GB/s, ms/token, tokens/s and cache memory
(docs/sizing.md), e.g. --tau 0.51ms --c 20.41ms --expert-mb 12.6.
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
    add_sizing_options(p)
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    trace = open_trace(args.trace)
    setup = resolve_sizing(args, trace)
    policies = [make_policy(s) for s in (args.policies or ["lru", "belady"])]
    layout = build_layout(trace, pool=args.pool, reset=args.reset, layers=args.layers, warm=args.warm)
    results = [replay_layout(layout, args.capacity, p) for p in policies]
    fill_gap(results)
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name} | setup.result_record(r) for r in results)
        return 0
    print(describe(trace))
    unit = "in the global pool" if args.pool == "global" else "per layer"
    print(setup_line(results[0], f"capacity {args.capacity} {unit}"))
    print_results(results, setup)
    return 0


def future_mark(needs_future: bool) -> str:
    """The 'future' column: ``yes`` for a policy that reads the recorded future (clairvoyant)."""
    return "yes" if needs_future else ""


def print_results(results, setup: SizingSetup | None = None) -> None:
    """The policy table: copies/token, steady and total copies, hit rate, gap recovered, whether
    the policy needs the future, and the sizing figures when ``setup`` is active."""
    setup = setup or SizingSetup()
    if setup.active:
        print(setup.describe())
    rows = [
        (r.policy, future_mark(r.needs_future), r.copies_per_token, r.copies_steady, r.copies_total, r.hit_rate,
         r.gap_recovered, *setup.result_cells(r))
        for r in results
    ]
    table(rows, ["policy", "future", "copies/token", "steady", "total", "hit rate", "gap recovered", *setup.headers()])
