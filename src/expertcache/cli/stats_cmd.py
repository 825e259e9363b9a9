"""``expertcache stats``: the locality report of one or more traces, and their hot-set overlap."""

from __future__ import annotations

import argparse
import itertools

from ..analysis import DEFAULT_WINDOWS, hot_set_overlap, locality_report
from ..analysis.locality import DEFAULT_TOP, LocalityReport, locality_report_chunked
from ..trace import Trace
from .common import add_json, describe, emit_json, open_trace_or_chunked, positive_int, table

HELP = """Locality of router traces, per layer and overall (definitions: docs/locality.md).

  alpha       rank-frequency (Zipf) slope: least squares of log count on log rank over the
              experts a layer selected at least once
  reuse WN    share of a token's experts its sequence used at that layer within the N previous
              decode steps (tokens whose previous step is in the trace; 'step' marks dropped rows)
  topN share  share of a layer's selections taken by its N most selected experts (its hot set)
  distinct    experts a layer selected at least once; coverage = distinct / E
Overall values are means over layers. The coverage curve is the share of all L x E (layer,
expert) pairs touched by the first n tokens. With two or more traces, the Jaccard overlap of
their hot sets (top N per layer) is reported for each pair with the same E, over shared layer ids.
A chunked trace's folder is read one chunk at a time (docs/scale.md).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("stats", help="locality report of traces (skew, reuse, hot sets, coverage)", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", metavar="TRACE", help="canonical traces (.npz, or folders holding routing.npz, or chunked traces' folders)")
    p.add_argument("--top", type=positive_int, default=DEFAULT_TOP, metavar="N",
                   help=f"hot-set size: the N most selected experts per layer (default {DEFAULT_TOP})")
    p.add_argument("--windows", type=_windows, default=list(DEFAULT_WINDOWS), metavar="W,W,...",
                   help="reuse windows in decode steps (default 1,8,64)")
    p.add_argument("--summary", action="store_true", help="one row per trace instead of a per-layer table")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    lines, reports = [], []
    for path in args.traces:  # one trace held at a time: a report keeps counts, not the trace
        t = open_trace_or_chunked(path)
        lines.append(describe(t))
        reports.append((locality_report if isinstance(t, Trace) else locality_report_chunked)(
            t, windows=args.windows, top=args.top))
        del t
    pairs = [hot_set_overlap(a, b) for a, b in itertools.combinations(reports, 2)]
    if args.json:
        emit_json([r.to_dict() | {"path": path} for r, path in zip(reports, args.traces)] + [p.to_dict() for p in pairs])
        return 0
    w_heads = [f"reuse W{w}" for w in args.windows]
    share_head = f"top{args.top} share"
    if args.summary:
        rows = [(r.name, r.num_experts, r.top_k, len(r.layers), r.tokens, r.zipf_alpha,
                 *(r.reuse(w) for w in r.windows), r.top_share, r.distinct[0], r.coverage_final) for r in reports]
        table(rows, ["trace", "E", "k", "L", "tokens", "alpha", *w_heads, share_head, "distinct", "coverage"])
    else:
        for i, (line, r) in enumerate(zip(lines, reports)):
            if i:
                print()
            _print_report(line, r, w_heads, share_head)
    if pairs:
        print(f"\nhot-set overlap (Jaccard of the top {args.top} experts per layer, mean over shared layers):")
        rows = [(p.a, p.b, len(p.jaccard), p.mean if p.jaccard else None, p.min if p.jaccard else None,
                 p.max if p.jaccard else None, p.reason or "") for p in pairs]
        table(rows, ["trace A", "trace B", "layers", "jaccard", "min", "max", "note"])
    return 0


def _print_report(line: str, r: LocalityReport, w_heads: list[str], share_head: str) -> None:
    print(line)
    print(f"scored tokens (previous step present): {r.scored_tokens} of {r.tokens}")
    rows = [(x.layer, x.selections, x.distinct, x.zipf_alpha, *(x.reuse[w] for w in r.windows), x.top_share,
             x.coverage) for x in r.layers]
    mean_distinct, lo, hi = r.distinct
    rows.append(("all", sum(x.selections for x in r.layers), mean_distinct, r.zipf_alpha,
                 *(r.reuse(w) for w in r.windows), r.top_share, r.coverage_final))
    table(rows, ["layer", "selections", "distinct", "alpha", *w_heads, share_head, "coverage"])
    print(f"distinct experts per layer: mean {mean_distinct:.1f}, min {lo}, max {hi} of E={r.num_experts}")
    curve = ", ".join(f"{n} tokens {c:.3f}" for n, c in r.coverage)
    print(f"coverage of the pool ({len(r.layers)} x {r.num_experts} layer-expert pairs) after: {curve}")


def _windows(text: str) -> list[int]:
    try:
        out = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers such as '1,8,64', got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as '1,8,64', got {text!r}")
    return out
