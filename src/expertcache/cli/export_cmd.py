"""``expertcache export``: a canonical trace out to other tools (libCacheSim)."""

from __future__ import annotations

import argparse

from ..trace.exporters import FORMATS, ORDERS, export_libcachesim
from .common import add_json, add_layers, add_out, add_subcommands, check_out, emit_json, open_trace

EXPORT_HELP = """Write a trace as a single-request stream for libCacheSim.

Each token's experts become consecutive requests in --order; object id = layer_id * E + expert;
tokens go in order, layers in order within a token. 'csv' writes time,obj_id,obj_size (size 1, so
cache sizes count experts); 'oracle' writes libCacheSim's oracleGeneral binary with next-access
indices, which its Belady needs. libCacheSim has no sequences: pools carry over. For k = 1 its LRU
and Belady misses equal 'expertcache replay --reset none' copies_total.
"""


def add_parser(sub) -> None:
    exp = sub.add_parser("export", help="export a trace for other tools",
                         description="Export a trace for other cache simulators.")
    esub = add_subcommands(exp, "format", "FORMAT")
    p = esub.add_parser("libcachesim", help="libCacheSim csv or oracleGeneral trace", description=EXPORT_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz)")
    add_out(p, "file to write; its folder must exist")
    p.add_argument("--order", choices=ORDERS, default="router", help="order of a token's experts (default router)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="csv", help="csv (default) or oracle (binary)")
    add_layers(p, "layer ids to export")
    add_json(p)
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    check_out(args.out)
    trace = open_trace(args.trace)
    n = export_libcachesim(trace, args.out, order=args.order, layers=args.layers, fmt=args.fmt)
    if args.json:
        emit_json([{"out": args.out, "requests": n, "format": args.fmt, "order": args.order}])
    else:
        print(f"wrote {n} requests ({args.fmt}, {args.order} order) to {args.out}")
    return 0
