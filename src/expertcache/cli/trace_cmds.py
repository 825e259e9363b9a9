"""``expertcache import`` and ``expertcache export``: traces in from other engines, out to other tools."""

from __future__ import annotations

import argparse
import sys

from ..trace.exporters import FORMATS, ORDERS, export_libcachesim
from ..trace.importers import JsonlFields, import_vllm_jsonl
from .common import add_json, describe, emit_json, open_trace, positive_int
from ..trace import parse_layers

IMPORT_HELP = """Convert a per-(token, layer) JSONL routing log into a canonical trace (.npz).

Each line is one record such as
  {"problem_id": 0, "layer": 3, "token_idx": 17, "experts": [5, 1], "gating_probs": [0.6, 0.4]}
(the shape vLLM routing-log patches write; rename fields with the --*-field options). Sequences
keep their order of first appearance, tokens are sorted by token index (gaps are kept in the
'step' array), layers are sorted. Every (token, layer) must be present once.
"""

EXPORT_HELP = """Write a trace as a single-request stream for libCacheSim.

Each token's experts become consecutive requests in --order; object id = layer_id * E + expert;
tokens go in order, layers in order within a token. 'csv' writes time,obj_id,obj_size (size 1, so
cache sizes count experts); 'oracle' writes libCacheSim's oracleGeneral binary with next-access
indices, which its Belady needs. libCacheSim has no sequences: pools carry over. For k = 1 its LRU
and Belady misses equal 'expertcache replay --reset none' copies_total.
"""


def add_parser(sub) -> None:
    imp = sub.add_parser("import", help="import routing logs from other engines",
                         description="Import routing logs from other engines into the canonical trace format.")
    isub = imp.add_subparsers(dest="format", metavar="FORMAT")
    isub.required = True
    p = isub.add_parser("vllm-jsonl", help="per-(token, layer) JSONL routing records", description=IMPORT_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="the .jsonl routing log")
    p.add_argument("--out", "-o", required=True, help="trace to write (.npz)")
    p.add_argument("--num-experts", type=positive_int, help="E (default: largest id + 1)")
    p.add_argument("--model", help="model name to record in the trace metadata")
    p.add_argument("--phase", default="decode", help="decode, prefill, teacher-forced, mixed or unknown (default decode)")
    p.add_argument("--drop-incomplete", action="store_true", help="drop tokens that lack a record for some layer")
    d = JsonlFields()
    p.add_argument("--seq-field", default=d.seq, help=f"sequence id field (default {d.seq})")
    p.add_argument("--layer-field", default=d.layer, help=f"layer field (default {d.layer})")
    p.add_argument("--token-field", default=d.token, help=f"token index field (default {d.token})")
    p.add_argument("--experts-field", default=d.experts, help=f"expert ids field (default {d.experts})")
    p.add_argument("--probs-field", default=d.probs, help=f"gate weights field, '' for none (default {d.probs})")
    add_json(p)
    p.set_defaults(func=run_import)

    exp = sub.add_parser("export", help="export a trace for other tools",
                         description="Export a trace for other cache simulators.")
    esub = exp.add_subparsers(dest="format", metavar="FORMAT")
    esub.required = True
    p = esub.add_parser("libcachesim", help="libCacheSim csv or oracleGeneral trace", description=EXPORT_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz)")
    p.add_argument("--out", "-o", required=True, help="file to write")
    p.add_argument("--order", choices=ORDERS, default="router", help="order of a token's experts (default router)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="csv", help="csv (default) or oracle (binary)")
    p.add_argument("--layers", type=parse_layers, default=None, metavar="IDS", help="layer ids to export (default all)")
    add_json(p)
    p.set_defaults(func=run_export)


def run_import(args) -> int:
    fields = JsonlFields(args.seq_field, args.layer_field, args.token_field, args.experts_field, args.probs_field or None)
    trace = import_vllm_jsonl(args.log, fields=fields, num_experts=args.num_experts,
                              drop_incomplete=args.drop_incomplete, model=args.model, phase=args.phase)
    trace.save(args.out)
    dropped = trace.meta["validation"]["tokens_dropped"]
    if args.json:
        emit_json([{"out": args.out, "tokens": trace.num_tokens, "sequences": trace.num_sequences,
                    "layers": trace.num_layers, "top_k": trace.top_k, "num_experts": trace.num_experts,
                    "tokens_dropped": dropped}])
        return 0
    print(describe(trace))
    if trace.meta.get("num_experts_inferred"):
        print(f"note: E = {trace.num_experts} inferred from the largest id; pass --num-experts if the model has more", file=sys.stderr)
    if dropped:
        print(f"dropped {dropped} token(s) lacking a layer record", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def run_export(args) -> int:
    trace = open_trace(args.trace)
    n = export_libcachesim(trace, args.out, order=args.order, layers=args.layers, fmt=args.fmt)
    if args.json:
        emit_json([{"out": args.out, "requests": n, "format": args.fmt, "order": args.order}])
    else:
        print(f"wrote {n} requests ({args.fmt}, {args.order} order) to {args.out}")
    return 0
