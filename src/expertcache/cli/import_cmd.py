"""``expertcache import``: routing logs from other engines in, as canonical traces."""

from __future__ import annotations

import argparse
import os
import sys

from .._text import id_ranges
from ..errors import ConfigError
from ..trace import units
from ..trace.importers import (
    FORMATS as IMPORT_FORMATS,
    PASS_KINDS,
    SEQUENCE_MODES,
    EngineFields,
    JsonlFields,
    TokenFields,
    detect_format,
    import_chunked,
    import_trace,
)
from .common import add_json, add_out, check_out, describe, emit_json, positive_int

IMPORT_HELP = """Convert a routing log from another engine into a canonical trace (.npz).

FORMAT is one of the formats below; without it, --format decides (default auto: the shape is
detected from the file's first bytes and records). JSONL input may be plain, gzip or zstd
(found by magic bytes, not by name; zstd needs the zstandard package); a line may hold at most
64 MiB.

formats and their record shapes (default field names; rename with the --*-field options):
  vllm-jsonl   one record per sequence, token and layer:
                 {"problem_id": 0, "layer": 3, "token_idx": 17, "experts": [5, 1], "gating_probs": [0.6, 0.4]}
  token-jsonl  one record per sequence and token, every layer in it:
                 {"problem_id": 0, "token_idx": 17, "experts": [[5, 1], [2, 7]]}         layer i = position i
                 {"problem_id": 0, "token_idx": 17, "experts": [[5, 1], [2, 7]], "layer_ids": [0, 3]}
                 {"problem_id": 0, "token_idx": 17, "experts": {"0": [5, 1], "3": [2, 7]}}
               gate weights ("gating_probs") in the same shape as the experts
  engine-jsonl one record per engine iteration and layer, speculative decoding, no event tag:
                 {"seq": 0, "iteration": 17, "layer": 3, "experts": [5, 1]}
               typed per (seq, iteration): a layer routed once with k ids is a normal pass (1
               accepted token), with 2k ids an accepted speculation (two positions, 2 tokens); a
               layer routed twice is a failed speculation (0 tokens) then its fallback pass (k ids,
               1 token). One trace row per pass, replayed as issued; the extras 'iteration',
               'accepted' and 'pass_kind' keep both units (docs/importers.md)
  sglang       the torch.save dump SGLang's expert-distribution recorder writes in per_token mode
               (expert_distribution_recorder_<time>_<rank>.pt), or a folder of them; read without
               unpickling; physical expert ids are mapped to logical ones
  sglang-r3    SGLang server responses (--enable-return-routed-experts, "return_routed_experts":
               true), one per line: /v1/completions, /v1/chat/completions or /generate, streamed
               (SSE 'data:' lines or chunk objects) or not, or {"request": ..., "response": ...}:
                 {"choices": [...], "usage": {...}, "sglext": {"routed_experts": "<base64 int32>"}}
                 {"text": "...", "meta_info": {"prompt_tokens": 5, ..., "routed_experts": "<base64>"}}
               the payload is int32 [rows, layers, k] without a shape: --num-layers and --top-k,
               or learned from the first response stating prompt and completion token counts
  vllm-r3      vLLM server responses (--enable-return-routed-experts, stream=false):
                 {"choices": [{..., "routed_experts": "<base64 .npy>"}], "usage": {...}}
               (vLLM 0.21: nested lists, and "prompt_routed_experts")
               both r3 formats: rows are token positions (from the request's routed_experts_start_len; the
               last sampled token has none); suffixes continue their conversation's sequence;
               layers whose ids are all 0 (dense layers) are left out; extras 'position' and
               'row_phase' (1 prompt, 0 decode, -1 unknown) (docs/importers.md)

Sequences keep their order of first appearance, tokens are sorted by token index (gaps kept in the
'step' array), layers are sorted. Every token needs every layer (--drop-incomplete drops tokens
that lack one) and every id list the same length k (--pad pads shorter ones with -1). A field
named by an option must be present; the default gate-weight and layer-id fields are read when
present in every record. Errors name the file, the line (or dump record) and the field.
"""

def add_parser(sub) -> None:
    p = sub.add_parser("import", help="import routing logs from other engines (vllm-jsonl, token-jsonl, engine-jsonl, sglang, "
                            "sglang-r3, vllm-r3)",
                       description=IMPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="expertcache import [FORMAT] PATH --out T.npz [options]")
    p.add_argument("source", nargs="+", metavar="[FORMAT] PATH",
                   help=f"optional format ({', '.join(IMPORT_FORMATS)}), then the routing log, dump or folder")
    p.add_argument("--format", dest="import_format", choices=("auto", *IMPORT_FORMATS), default=None,
                   help="format of PATH when no FORMAT is given (default auto)")
    add_out(p, "trace to write (.npz); its folder must exist")
    p.add_argument("--num-experts", type=positive_int, help="E (default: from the dump's expert map, else largest id + 1)")
    p.add_argument("--model", help="model name to record in the trace metadata")
    p.add_argument("--phase", help="decode, prefill, teacher-forced, mixed or unknown (default decode for the "
                                   "JSONL formats, mixed for sglang, what the rows show for sglang-r3/vllm-r3)")
    p.add_argument("--drop-incomplete", action="store_true",
                   help="drop tokens that lack some layer (r3: rows whose ids at a MoE layer are all 0)")
    p.add_argument("--pad", action="store_true", help="pad id lists shorter than the longest with -1 (default: an error)")
    p.add_argument("--chunk-sequences", type=positive_int, default=None, metavar="N",
                   help="write a chunked trace instead (--out a folder), N sequences a chunk; the JSONL and R3 logs "
                        "are written while they are read (two passes), in memory bounded by the sequences open at "
                        "once rather than the log; a dump is read whole, then written chunked (docs/scale.md)")
    d, t, e = JsonlFields(), TokenFields(), EngineFields()
    g = p.add_argument_group("JSONL field names (vllm-jsonl, token-jsonl, engine-jsonl)")
    g.add_argument("--seq-field", help=f"sequence id field (default {d.seq}; engine-jsonl: {e.seq}, read when present)")
    g.add_argument("--token-field", help=f"token index field (default {d.token})")
    g.add_argument("--experts-field", help=f"expert ids field (default {d.experts})")
    g.add_argument("--probs-field", help=f"gate weights field, '' for none (default {d.probs}, read when present)")
    g.add_argument("--layer-field", help=f"vllm-jsonl, engine-jsonl: layer field (default {d.layer})")
    g.add_argument("--layers-field", help=f"token-jsonl: layer ids of the per-layer lists (default {t.layers}, read when present)")
    g = p.add_argument_group("engine-jsonl")
    g.add_argument("--iteration-field", help=f"engine iteration field (default {e.iteration})")
    g.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="the router's k (default: the smallest record width, noted in the trace metadata; "
                        "sglang-r3: the payload's k, default inferred from the ids)")
    g.add_argument("--expect-tokens", type=positive_int, default=None, metavar="N",
                   help="every sequence's accepted tokens must add up to N (an error naming the sequence otherwise)")
    g = p.add_argument_group("sglang")
    g.add_argument("--sequences", choices=SEQUENCE_MODES, default=None,
                   help="'positions': a new sequence wherever a position does not follow the previous one; "
                        "'stream': one sequence per dump file; 'auto' (default): positions when every forward "
                        "pass serves one request, else stream")
    g.add_argument("--rank", type=int, default=None, help="keep only this rank's records")
    g = p.add_argument_group("sglang-r3")
    g.add_argument("--num-layers", type=positive_int, default=None, metavar="L",
                   help="layers in the payload: the model's num_hidden_layers, dense ones included (default: "
                        "learned from the first response stating its prompt and completion token counts)")
    add_json(p)
    p.set_defaults(func=run_import)


_APPLIES = {
    "seq_field": ("vllm-jsonl", "token-jsonl", "engine-jsonl"), "token_field": ("vllm-jsonl", "token-jsonl"),
    "experts_field": ("vllm-jsonl", "token-jsonl", "engine-jsonl"), "probs_field": ("vllm-jsonl", "token-jsonl"),
    "layer_field": ("vllm-jsonl", "engine-jsonl"), "layers_field": ("token-jsonl",), "sequences": ("sglang",),
    "rank": ("sglang",), "iteration_field": ("engine-jsonl",), "top_k": ("engine-jsonl", "sglang-r3"),
    "expect_tokens": ("engine-jsonl",), "num_layers": ("sglang-r3",),
}


def _source(args) -> tuple[str, str]:
    """(format or 'auto', path) from the positionals and --format."""
    src = args.source
    if len(src) > 2:
        raise ConfigError(f"expected [FORMAT] PATH, got {len(src)} arguments ({' '.join(src)})")
    if len(src) == 2:
        fmt, path = src
        if fmt not in IMPORT_FORMATS:
            raise ConfigError(f"{fmt!r} is not a format (one of {', '.join(IMPORT_FORMATS)}); give FORMAT PATH or PATH alone")
        if args.import_format not in (None, fmt):
            raise ConfigError(f"FORMAT {fmt} contradicts --format {args.import_format}")
        return fmt, path
    if src[0] in IMPORT_FORMATS and not os.path.exists(src[0]):
        raise ConfigError(f"missing the path after the format {src[0]}")
    return args.import_format or "auto", src[0]


def _fields(args) -> tuple[JsonlFields, TokenFields]:
    d, t = JsonlFields(), TokenFields()
    probs = d.probs if args.probs_field is None else (args.probs_field or None)
    common = dict(seq=args.seq_field or d.seq, token=args.token_field or d.token, experts=args.experts_field or d.experts, probs=probs)
    return (JsonlFields(layer=args.layer_field or d.layer, **common),
            TokenFields(layers=args.layers_field or t.layers, **common))


def _engine_fields(args) -> EngineFields:
    e = EngineFields()
    return EngineFields(seq=args.seq_field or e.seq, iteration=args.iteration_field or e.iteration,
                        layer=args.layer_field or e.layer, experts=args.experts_field or e.experts)


def run_import(args) -> int:
    fmt, path = _source(args)
    if args.chunk_sequences is None:
        check_out(args.out)
    elif args.out.endswith(".npz"):
        raise ConfigError(f"--out: with --chunk-sequences it is a folder, got {args.out!r}")
    vllm_fields, token_fields = _fields(args)
    engine_fields = _engine_fields(args)
    if fmt == "auto":
        fmt = detect_format(path, vllm_fields=vllm_fields, token_fields=token_fields, engine_fields=engine_fields)
    for name, formats in _APPLIES.items():
        if getattr(args, name) is not None and fmt not in formats:
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to {fmt} (only to {', '.join(formats)})")
    options = dict(vllm_fields=vllm_fields, token_fields=token_fields, engine_fields=engine_fields,
                   num_experts=args.num_experts, drop_incomplete=args.drop_incomplete, pad=args.pad, model=args.model,
                   phase=args.phase, sequences=args.sequences or "auto", rank=args.rank, top_k=args.top_k,
                   expect_tokens=args.expect_tokens, num_layers=args.num_layers)
    if args.chunk_sequences is not None:
        out, src = os.path.realpath(args.out), os.path.realpath(path)
        if out == src or src.startswith(out.rstrip(os.sep) + os.sep):
            # the chunked writer replaces its folder's contents: the input would go with them
            raise ConfigError(f"--out {args.out}: is or holds the input {path}; refusing to overwrite an input, "
                              "choose another folder")
        return _run_chunked(args, path, fmt, options)
    trace, fmt = import_trace(path, fmt, **options)
    trace.save(args.out)
    dropped = trace.meta["validation"]["tokens_dropped"]
    engine = _engine_summary(trace) if fmt == "engine-jsonl" else {}
    if args.json:
        emit_json([{"out": args.out, "format": fmt, "tokens": trace.num_tokens, "sequences": trace.num_sequences,
                    "layers": trace.layer_ids, "num_layers": trace.num_layers, "top_k": trace.top_k,
                    "num_experts": trace.num_experts, "tokens_dropped": dropped, **engine}])
        return 0
    print(describe(trace) + f" (read as {fmt})")
    if engine:
        _print_engine(engine, args.expect_tokens)
    if trace.meta.get("num_experts_inferred"):
        print(f"note: E = {trace.num_experts} inferred from the largest id; pass --num-experts if the model has more", file=sys.stderr)
    if fmt == "sglang" and args.sequences in (None, "auto") and trace.meta["source"]["sequences"] == "stream":
        print("note: forward passes serve several requests, so each dump file is one sequence "
              "(--sequences positions splits where positions break)", file=sys.stderr)
    if fmt.endswith("-r3"):
        _print_r3_notes(trace.meta)
    if dropped:
        print(f"dropped {dropped} token(s) lacking a layer", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def _run_chunked(args, path: str, fmt: str, options: dict) -> int:
    """``--chunk-sequences N``: the log written as a chunked trace (trace.importers.detect.import_chunked),
    given the whole import's ``options``."""
    ct, fmt = import_chunked(path, args.out, fmt, chunk_sequences=args.chunk_sequences, **options)
    dropped = ct.meta.get("validation", {}).get("tokens_dropped", 0)
    if args.json:
        emit_json([{"out": args.out, "format": fmt, "tokens": ct.num_tokens, "sequences": ct.num_sequences,
                    "chunks": ct.num_chunks, "layers": ct.layer_ids, "num_layers": ct.num_layers, "top_k": ct.top_k,
                    "num_experts": ct.num_experts, "tokens_dropped": dropped}])
        return 0
    print(describe(ct) + f" (read as {fmt})")
    if ct.meta.get("num_experts_inferred"):
        print(f"note: E = {ct.num_experts} inferred from the largest id; pass --num-experts if the model has more", file=sys.stderr)
    if dropped:
        print(f"dropped {dropped} token(s) lacking a layer", file=sys.stderr)
    print(f"wrote {args.out}/")
    return 0


def _print_r3_notes(meta: dict) -> None:
    """What an r3 import decided or could not place (docs/importers.md), on stderr."""
    src, v, rows = meta["source"], meta["validation"], meta["rows"]
    print(f"rows: {rows['prefill']} prompt (prefill), {rows['decode']} decode, {rows['unknown']} of unknown phase "
          f"in {v['responses']} responses")
    notes = []
    if src["dense_layers"]:
        notes.append(f"layers {id_ranges(src['dense_layers'])} hold only 0 (dense layers): left out")
    if src["top_k_inferred"]:
        notes.append(f"k = {meta['top_k']} inferred from the ids (pass --top-k if the model's differs)")
    if src["shape_from"] != "the options" and meta["source"]["format"] == "sglang-r3":
        notes.append(f"layers x k = {src['layers_in_payload']} x {meta['top_k']} learned from {src['shape_from']}")
    for key, text in (("choices_without_routing", "choice(s) without routed experts (SGLang's sglext holds the first "
                       "choice's only)"), ("error_responses", "error response(s) skipped"),
                      ("start_len_ignored", "response(s) returned every row although the request set a start "
                       "(read from position 0)"), ("rows_replaced", "row(s) replaced by a later response's suffix")):
        if v[key]:
            notes.append(f"{v[key]} {text}")
    for key, text in (("row_count_mismatches", "row count(s) disagree with prompt + completion - 1 - start"),
                      ("unstitched_suffixes", "suffix(es) continue no sequence read before (new sequences)")):
        if v[key]:
            notes.append(f"{len(v[key])}{'+' if len(v[key]) == 20 else ''} {text}, first at {v[key][0]['where']}")
    for text in notes:
        print(f"note: {text}", file=sys.stderr)


def _engine_summary(trace) -> dict:
    """The units of an engine-jsonl import (docs/importers.md): rows are passes."""
    m = trace.meta
    names = [m["sequence_ids"][str(i)] for i in range(trace.num_sequences)]
    return {"passes": m["passes"], "iterations": m["iterations"], "accepted_tokens": m["accepted_tokens"],
            "pass_kinds": m["pass_kinds"], "router_top_k": m["router_top_k"], "top_k_inferred": m["top_k_inferred"],
            "accepted_per_sequence": [{"sequence": s, "accepted_tokens": int(n)}
                                      for s, n in zip(names, units.accepted_by_sequence(trace))]}


def _print_engine(e: dict, expect: int | None, shown: int = 20) -> None:
    kinds = ", ".join(f"{e['pass_kinds'][k]} {k}" for k in PASS_KINDS)
    print(f"{e['passes']} passes (rows: {kinds}) in {e['iterations']} engine iterations; "
          f"{e['accepted_tokens']} accepted tokens; router k = {e['router_top_k']}")
    if e["top_k_inferred"]:
        print(f"note: router k = {e['router_top_k']} inferred as the smallest record width; pass --top-k "
              "if every record carries two positions", file=sys.stderr)
    per = e["accepted_per_sequence"]
    if expect is not None:
        print(f"every sequence accounts for {expect} accepted tokens (--expect-tokens)")
        return
    text = ", ".join(f"{i if r['sequence'] is None else r['sequence']}: {r['accepted_tokens']}"
                     for i, r in enumerate(per[:shown]))
    more = f", ... ({len(per)} sequences)" if len(per) > shown else ""
    print(f"accepted tokens per sequence: {text}{more}")
