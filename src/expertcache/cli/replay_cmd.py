"""``expertcache replay``: copies per token, hit rate and gap recovered for one or more policies."""

from __future__ import annotations

import argparse

from ..policies import available_policies, make_policy
from ..sim import StreamOptions, build_layout, fill_gap, replay_layout
from ..trace import Trace
from .budget_opts import (add_capacity_or_budget, add_tier_options, attach_profile, budget_capacity, print_results,
                          select_sequences, sequence_positions)
from .common import (add_json, add_parallel_options, add_replay_options, describe, emit_json,
                     open_trace_or_chunked, parallel_jobs, require, setup_line)
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

A chunked trace (a folder holding chunks.json: 'expertcache synth --chunk-sequences') is replayed
one chunk (or block of layers) at a time, in bounded memory, with the same counts as the trace
loaded whole (docs/scale.md); --jobs/--ray then spread the chunks over workers.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay a trace through eviction policies", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz), or a chunked trace's folder")
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
    source = open_trace_or_chunked(args.trace)
    setup = resolve_sizing(args, source)
    policies = [make_policy(s) for s in (args.policies or ["lru", "belady"])]
    attach_profile(policies, args.profile)
    options = StreamOptions.from_args(args)
    jobs = parallel_jobs(args)
    if not isinstance(source, Trace):  # a chunked trace: unit by unit (sim.chunked)
        from ..sim.chunked import pool_shape, replay_chunked

        require(args.sequences is None, "--sequences: a chunked trace is replayed whole (select sequences when "
                                        "writing it)")
        shape = pool_shape(source, options)
        capacity, budget, note = budget_capacity(args, shape, setup)
        specs = [p if getattr(p, "takes_profile", False) else p.spec for p in policies]
        results = replay_chunked(source, capacity, specs, options, jobs=jobs, ray=args.ray)
        return _report(args, results, setup, capacity, budget, note, shape, source)
    trace = select_sequences(source, args.sequences, policies)
    layout = build_layout(trace, options)
    capacity, budget, note = budget_capacity(args, layout, setup)
    if jobs > 1 or args.ray:
        from ..sim.parallel import replay_streams_parallel

        results = replay_streams_parallel(layout, capacity, policies, jobs, ray=args.ray)
    else:
        results = [replay_layout(layout, capacity, p) for p in policies]
    fill_gap(results)
    return _report(args, results, setup, capacity, budget, note, layout, trace)


def _report(args, results, setup, capacity, budget, note, layout, trace) -> int:
    """Print (or emit as JSON) the results; ``trace`` may be chunked, ``layout`` then its PoolShape."""
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
