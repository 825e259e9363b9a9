"""``expertcache batch``: merge traces into the batch union a batch-b decode requests."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..trace.batch import batch_union
from ..trace.npz import WORK_FACTOR, array_bytes, max_bytes
from .common import add_json, add_out, check_out, describe, emit_json, open_trace

HELP = """Merge b traces into their batch-b union: per layer, each step requests the union of the b
rows' expert sets (one cache step serves the batch). Sequence s merges sequence s of every input;
a finished row drops out. Engine traces (with speculative decoding) merge iteration by iteration,
pass by pass, so every speculative and fallback pass is kept. Rows hold the union sorted and -1
padded, as the live harness's batch capture writes them; the extras 'accepted' (the merged rows'
accepted tokens: per-token figures divide by all of them), 'iteration' and 'batch_rows' (which row
of each input each union row merges; -1 none) are kept. See docs/semantics.md ("Batches").
"""


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="merge traces into a batch-b union, step by step", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="canonical traces (.npz), one per batch row")
    add_out(p, "the union trace to write (.npz, atomically)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    check_out(args.out)
    traces, held, limit = [], 0, max_bytes()
    for path in args.traces:  # each file is held to the trace limit as it loads; together they are too
        traces.append(open_trace(path))
        held += array_bytes(traces[-1])
        if held > limit:
            raise ConfigError(f"{path}: the traces up to this one hold {held:,} bytes of arrays, more than the trace "
                              f"limit of {limit:,} for all of them together (the union needs up to "
                              f"{WORK_FACTOR}x; set EXPERTCACHE_MAX_TRACE_BYTES to allow more)")
    union = batch_union(traces)
    union.save(args.out)
    requests_in = sum(t.num_requests for t in traces)
    record = {
        "out": args.out, "batch": len(traces), "rows": union.num_tokens, "iterations": int(union.extras["iteration"][-1]) + 1
        if union.num_tokens else 0, "accepted_tokens": union.meta["accepted_tokens"], "width": union.top_k,
        "requests_in": requests_in, "requests_union": union.num_requests,
        "dedup": requests_in / union.num_requests if union.num_requests else None,
        "inputs": [t.name for t in traces],
    }
    if args.json:
        emit_json([record])
        return 0
    print(describe(union))
    print(f"batch of {record['batch']}: {record['rows']} union steps over {record['iterations']} iterations, "
          f"{record['accepted_tokens']} accepted tokens; {requests_in:,} requests in, {union.num_requests:,} in the "
          f"union (deduplication {record['dedup']:.3f}x)" if record["dedup"] else "empty union")
    print(f"wrote {args.out}")
    return 0
