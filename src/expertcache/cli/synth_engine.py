"""``expertcache synth engine-jsonl``: write an engine-iteration routing log with speculative
decoding (:mod:`expertcache.trace.engine_gen`), the input ``expertcache import engine-jsonl`` reads."""

from __future__ import annotations

import argparse

from ..trace.engine_gen import ORDERS, generate_engine_jsonl
from ..trace.importers.engine_passes import PASS_KINDS
from .common import add_json, add_out, check_out, emit_json, float_in, positive_int, require, seed_int

HELP = """Write a synthetic engine routing log (JSONL) with speculative decoding, for tests and examples.

One record per (sequence, iteration, layer) routing event, no event tag:
  {"seq": 0, "iteration": 17, "layer": 3, "experts": [5, 1, ...]}
Each iteration is an accepted speculation (one record of 2k ids per layer: two positions, 2
accepted tokens) with probability --p-accept, a failed speculation (every layer routed with 2k or
k ids, 0 tokens, then the fallback pass with k ids, 1 token) with probability --p-fail, else a
normal step (k ids, 1 token). A path ending in .gz is written gzip-compressed. The output is a
function of the seed. Import it with 'expertcache import engine-jsonl LOG --top-k K --out T.npz'.
"""


probability = float_in(0, 1, name="a probability")


def add_parser(sub) -> None:
    p = sub.add_parser("engine-jsonl", help="an engine routing log with speculative decoding (JSONL)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p, "log to write (.jsonl, or .jsonl.gz for gzip); its folder must exist")
    p.add_argument("--iterations", type=positive_int, default=300, help="engine iterations per sequence (default 300)")
    p.add_argument("--sequences", type=positive_int, default=1, metavar="S", help="sequences, batched (default 1)")
    p.add_argument("--num-layers", type=positive_int, default=4, metavar="L", help="MoE layers (default 4)")
    p.add_argument("--num-experts", type=positive_int, default=64, metavar="E", help="experts per layer (default 64)")
    p.add_argument("--top-k", type=positive_int, default=8, metavar="K", help="router k (default 8)")
    p.add_argument("--p-accept", type=probability, default=0.6, metavar="P",
                   help="probability of an accepted speculation per iteration (default 0.6)")
    p.add_argument("--p-fail", type=probability, default=0.2, metavar="P",
                   help="probability of a failed speculation and its fallback per iteration (default 0.2)")
    p.add_argument("--order", choices=ORDERS, default="pass",
                   help="'pass' (default): a failed speculation's records for every layer, then the fallback's; "
                        "'layer': a layer's two routings next to each other")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed, a non-negative integer (default 0)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    require(args.out is not None, "--out is required (the .jsonl file to write)")
    check_out(args.out)
    log = generate_engine_jsonl(args.out, iterations=args.iterations, layers=args.num_layers,
                                num_experts=args.num_experts, top_k=args.top_k, p_accept=args.p_accept,
                                p_fail=args.p_fail, sequences=args.sequences, seed=args.seed, order=args.order)
    if args.json:
        emit_json([{"out": args.out, "records": len(log.lines), "iterations": log.iterations,
                    "sequences": args.sequences, "num_layers": args.num_layers, "num_experts": args.num_experts,
                    "top_k": args.top_k, "seed": args.seed, "passes": int(log.pass_kind.size),
                    "pass_kinds": log.kinds, "accepted_tokens": log.accepted_tokens,
                    "accepted_per_sequence": [{"sequence": s, "accepted_tokens": n} for s, n in log.accepted.items()]}])
        return 0
    kinds = ", ".join(f"{log.kinds[k]} {k}" for k in PASS_KINDS)
    print(f"wrote {args.out}: {len(log.lines)} records, {log.iterations} engine iterations over {args.sequences} "
          f"sequence(s) and {args.num_layers} layers (seed {args.seed})")
    print(f"{log.pass_kind.size} passes ({kinds}); {log.accepted_tokens} accepted tokens")
    return 0
