"""``expertcache synth``: write a synthetic trace from a calibrated preset (``--list`` shows them)."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from ..errors import ConfigError
from ..trace.chunked import ChunkWriter, open_chunked
from ..trace.synth import PRESETS, get_preset, synthesize, synthesize_chunks
from .common import add_json, add_out, check_out, describe, emit_json, positive_int, require, seed_int, table

HELP = """Generate a synthetic router trace with realistic locality and save it (.npz, atomically).

Each (layer, sequence) stream fills a token's k slots by copying a recently used expert (lag
drawn from a power law) or drawing by popularity (Zipf with an exponential tail cutoff, steeper
with depth, drifting by random rank swaps, reshuffled in part per sequence). Presets are
calibrated to published statistics; 'expertcache synth --list' shows their targets. Any
parameter can be overridden; the seed makes the output identical on every machine.

'expertcache synth engine-jsonl' writes an engine-iteration routing log with speculative decoding
instead (see 'expertcache synth engine-jsonl --help').

With --chunk-sequences N it writes a chunked trace instead: a folder (--out without .npz) of
chunks of N sequences each, generated and written one at a time in bounded memory, which replay
and sweep read chunk by chunk (docs/scale.md). Chunks share the model (each layer's popularity
order comes from the seed) and draw their sequences from their own streams: the same output for
the same seed and N, equal in distribution to the one-file trace but not token for token.
"""

# Generator parameters with a flag of their own below; the rest get --<name-with-dashes>.
_NAMED = {"num_experts": "--num-experts", "top_k": "--top-k", "num_layers": "--num-layers", "tokens": "--tokens",
          "sequences": "--sequences"}
_HELP = {
    "zipf_first": "popularity exponent of the first layer",
    "zipf_last": "popularity exponent of the last layer",
    "depth_power": "shape of the exponent's rise with depth (1: linear, below 1: early)",
    "zipf_cutoff": "scale of the popularity tail cutoff, as a fraction of E (0: none)",
    "cutoff_power": "shape of the cutoff exp(-(r / (cutoff * E))^X): 1 exponential, larger sharper",
    "reuse_prob": "probability that a slot copies a recent choice",
    "lag_exponent": "copy lag m is drawn with P(m) ~ m^-X",
    "max_lag": "largest copy lag in tokens",
    "drift_rate": "expected popularity rank swaps per token",
    "domain_shuffle": "share of ranks reshuffled at each sequence start",
}
MAX_SELECTIONS = 2_000_000_000
"""Refuse traces with more expert selections than this (they would not fit in memory)."""


def add_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic trace from a calibrated preset", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the presets with their calibration targets and exit")
    p.add_argument("--preset", metavar="NAME", help=f"one of {', '.join(PRESETS)}")
    add_out(p, "output trace (.npz); its folder must exist", required=False)
    p.add_argument("--seed", type=seed_int, default=0, help="random seed, a non-negative integer (default 0)")
    p.add_argument("--tokens", type=positive_int, metavar="T", help="tokens per sequence (default: the preset's)")
    p.add_argument("--sequences", type=positive_int, metavar="S", help="number of sequences (default: the preset's)")
    p.add_argument("--num-layers", type=positive_int, metavar="L", help="number of MoE layers (default: the preset's)")
    p.add_argument("--num-experts", type=positive_int, metavar="E", help="experts per layer (default: the preset's)")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="experts per token and layer (default: the preset's)")
    p.add_argument("--chunk-sequences", type=positive_int, metavar="N",
                   help="write a chunked trace: --out is a folder, each chunk N whole sequences (docs/scale.md)")
    for name, help_text in _HELP.items():
        kind = int if name == "max_lag" else float
        p.add_argument("--" + name.replace("_", "-"), type=kind, metavar="X", help=help_text)
    add_json(p)
    p.set_defaults(func=run)
    from .synth_engine import add_parser as add_engine  # 'synth engine-jsonl': a routing log, not a trace

    add_engine(p.add_subparsers(dest="synth_kind", metavar="KIND"))


def run(args) -> int:
    if args.list:
        return _list(args.json)
    require(args.preset is not None, "--preset is required (see 'expertcache synth --list')")
    require(args.out is not None, "--out is required (the .npz file to write)")
    if args.chunk_sequences is not None:
        return _run_chunked(args)
    require(args.out.endswith(".npz"), f"--out: expected a path ending in .npz, got {args.out!r}")
    check_out(args.out)
    preset, params = _params(args)
    selections = params.tokens * params.sequences * params.num_layers * params.top_k
    require(selections <= MAX_SELECTIONS,
            f"{selections:,} expert selections (tokens x sequences x layers x k) is more than {MAX_SELECTIONS:,} "
            "(write it chunked: --chunk-sequences)")
    t0 = time.perf_counter()
    trace = synthesize(params, args.seed, preset=preset.name)
    try:
        path = trace.save(args.out)
    except OSError as err:
        raise ConfigError(f"--out {args.out}: cannot write it ({err.strerror or err})") from None
    seconds = time.perf_counter() - t0
    if args.json:
        emit_json([{"out": str(path), "preset": preset.name, "seed": args.seed, "tokens": trace.num_tokens,
                    "sequences": trace.num_sequences, "layers": trace.layer_ids, "num_layers": trace.num_layers,
                    "num_experts": trace.num_experts,
                    "top_k": trace.top_k, "params": asdict(params), "seconds": seconds}])
        return 0
    print(f"wrote {path} ({seconds:.2f} s, seed {args.seed})")
    print(describe(trace))
    return 0


def _params(args):
    """The preset and its parameters with the command line's overrides."""
    preset = get_preset(args.preset)
    overrides = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in _NAMED.items()}
    overrides |= {name: getattr(args, name) for name in _HELP}
    return preset, preset.params.with_overrides(**overrides)


def _run_chunked(args) -> int:
    """``--chunk-sequences N``: a chunked trace in the folder ``--out``, one chunk at a time."""
    require(not args.out.endswith(".npz"), f"--out: with --chunk-sequences it is a folder, got {args.out!r}")
    preset, params = _params(args)
    n = min(args.chunk_sequences, params.sequences)
    selections = params.tokens * n * params.num_layers * params.top_k
    require(selections <= MAX_SELECTIONS, f"{selections:,} expert selections in one chunk is more than "
                                          f"{MAX_SELECTIONS:,}: lower --chunk-sequences")
    t0 = time.perf_counter()
    try:
        with ChunkWriter(args.out) as writer:
            for piece in synthesize_chunks(params, args.seed, chunk_sequences=n, preset=preset.name):
                writer.add(piece)
    except OSError as err:
        raise ConfigError(f"--out {args.out}: cannot write it ({err.strerror or err})") from None
    seconds = time.perf_counter() - t0
    ct = open_chunked(args.out)
    if args.json:
        emit_json([{"out": str(ct.root), "preset": preset.name, "seed": args.seed, "tokens": ct.num_tokens,
                    "sequences": ct.num_sequences, "chunks": ct.num_chunks, "layers": ct.layer_ids,
                    "num_layers": ct.num_layers, "num_experts": ct.num_experts, "top_k": ct.top_k,
                    "requests": ct.num_requests_upper, "params": asdict(params), "seconds": seconds}])
        return 0
    print(f"wrote {ct.root}/ ({ct.num_chunks} chunks, {ct.num_requests_upper:,} requests, {seconds:.2f} s, "
          f"seed {args.seed})")
    print(describe(ct))
    return 0


def _list(as_json: bool) -> int:
    if as_json:
        emit_json({"preset": p.name, "description": p.description, "source": p.source, "params": asdict(p.params),
                   "targets": {n: {"lo": t.lo, "hi": t.hi, "tol": t.tol} for n, t in p.targets.items()},
                   "replay_layers": list(p.replay_layers), "replay_capacity": p.replay_capacity or None}
                  for p in PRESETS.values())
        return 0
    rows = [(p.name, p.params.num_experts, p.params.top_k, p.params.num_layers, p.params.tokens, p.params.sequences,
             p.description) for p in PRESETS.values()]
    table(rows, ["preset", "E", "k", "L", "tokens/seq", "seqs", "what"])
    for p in PRESETS.values():
        if not p.targets:
            continue
        where = f" (replay of layers {list(p.replay_layers)} at C={p.replay_capacity})" if p.replay_layers else " (per sequence)"
        print(f"\n{p.name} targets{where}, from {p.source}:")
        table([(n, str(t), t.tol) for n, t in p.targets.items()], ["statistic", "target", "tolerance"])
    return 0
