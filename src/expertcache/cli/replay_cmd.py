"""``expertcache replay``: copies per token, hit rate and gap recovered for one or more policies."""

from __future__ import annotations

import argparse

from ..policies import available_policies, make_policy
from ..sim import StreamOptions, build_layout, fill_gap, replay_layout
from .budget_opts import (add_capacity_or_budget, add_tier_options, attach_profile, budget_capacity, print_results,
                          select_sequences, sequence_positions)
from .common import add_json, add_parallel_options, add_replay_options, describe, emit_json, open_trace, parallel_jobs, setup_line
from .sizing_opts import add_sizing_options, resolve_sizing

HELP = """Replay a trace through eviction policies at one capacity (lossless, demand fetch).

Counts follow docs/semantics.md: copies_total counts every insertion, copies_steady those made
once the pool is full (each evicts a victim), copies/token = steady copies over all layers and
sequences / scored tokens, hit rate = 1 - misses / requests. With both lru and belady in the run,
'gap recovered' is the share of the LRU-to-Belady gap in steady copies each policy closes. The
'future' column marks policies that read the recorded future (clairvoyant: offline references).

The sizing options turn copies/token into MB/token, GB/s, ms/token, tokens/s and cache memory
(docs/sizing.md), e.g. --tau 0.51ms --c 20.41ms --expert-mb 12.6.

The tiering paper's options (docs/semantics.md): --budget 12GB with --expert-mb 17.5 gives the
capacity from bytes (split equally over layers for per-layer pools); -p static pins the top experts
of the warm window (or of --profile TRACE) and streams every other request (bypass); --admission
second streams an expert's first request instead of inserting it; --unit iteration divides by
engine iterations instead of accepted tokens (engine traces with speculative decoding).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a trace through eviction policies", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    add_capacity_or_budget(p)
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=f"repeatable; one of {', '.join(available_policies())}, with a parameter as in "
                        "'decayed:0.9', 'foresight:16', 'random:7' (default: lru and belady)")
    add_replay_options(p)
    add_tier_options(p)
    p.add_argument("--sequences", type=sequence_positions, default=None, metavar="POS",
                   help="replay only these sequences: positions such as '0-7', or 'heldout': those the learned:PATH "
                        "scorers were not trained on (default all)")
    add_sizing_options(p)
    add_parallel_options(p)
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    trace = open_trace(args.trace)
    setup = resolve_sizing(args, trace)
    policies = [make_policy(s) for s in (args.policies or ["lru", "belady"])]
    attach_profile(policies, args.profile)
    trace = select_sequences(trace, args.sequences, policies)
    layout = build_layout(trace, StreamOptions.from_args(args))
    capacity, budget, note = budget_capacity(args, layout, setup)
    jobs = parallel_jobs(args)
    if jobs > 1 or args.ray:
        from ..sim.parallel import replay_streams_parallel

        results = replay_streams_parallel(layout, capacity, policies, jobs, ray=args.ray)
    else:
        results = [replay_layout(layout, capacity, p) for p in policies]
    fill_gap(results)
    if budget is not None:
        for r in results:
            r.budget = budget.record(layout.pool, len(layout.layer_ids))
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name, "unit": args.unit} | setup.result_record(r) for r in results)
        return 0
    print(describe(trace))
    where = "in the global pool" if args.pool == "global" else "per layer"
    print(setup_line(results[0], f"capacity {capacity} {where}"))
    if budget is not None:
        print(budget.describe(layout.pool, len(layout.layer_ids)))
    if note:
        print(note + (" (admission 'second' still streams each expert's first request)"
                      if args.admission != "all" else ""))
    if args.admission != "all":
        print("admission 'second': an expert's first request in each stream is streamed, not inserted")
    print_results(results, setup, unit=args.unit)
    return 0

