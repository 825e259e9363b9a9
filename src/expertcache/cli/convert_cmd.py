"""``expertcache convert``: a Hugging Face MoE checkpoint to a GGUF for llama.cpp (docs/llama.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .._io import clean_stale_temporaries, pending, temporary_name
from ..errors import ConfigError
from .common import add_json, add_out, check_out, emit_json

HELP = """Convert a Hugging Face MoE checkpoint to GGUF with the gguf package's writer. Classes:
OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3 (deepseek2: MLA with attn_k_b/attn_v_b, sigmoid
routing with selection bias and expert groups, leading dense layers), gpt-oss (sliding window,
attention sinks, expert and router biases) and GLM-4-MoE (glm4moe: partial rotary, q/k/v biases,
MTP blocks when the checkpoint holds them); the per-expert safetensors layout transformers saves or
the packed one, in f32, f16 or bf16. --dtype f32 keeps every tensor float32 (llama.cpp then routes
as transformers does); f16 and q8_0 store the matrices so, routers, biases and vectors stay float32.
A GPT-2-style byte-level BPE tokenizer is written as gpt2 / gpt-2; a checkpoint without one gets a
tokenizer-free GGUF that runs on token ids. A chat template (chat_template.jinja or
tokenizer_config.json) is written as tokenizer.chat_template. Settings llama.cpp's graph would
compute differently are refused. --quantize TYPE then quantizes the file with llama.cpp's own
llama_model_quantize (its recipes: Q4_K_M keeps some layers' ffn_down as Q6_K). Needs the llama extra."""


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="Hugging Face MoE checkpoint -> GGUF (for llama.cpp)", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="HF_DIR", help="checkpoint folder (config.json + *.safetensors)")
    add_out(p, "GGUF file to write")
    p.add_argument("--dtype", choices=("f32", "f16", "q8_0"), default="f32", help="matrix type (default f32)")
    p.add_argument("--quantize", default=None, metavar="TYPE",
                   help="then quantize with llama.cpp's llama_model_quantize: q4_k_m, q6_k, iq4_nl, mxfp4_moe, ... "
                        "(from --dtype f32 or f16)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..llama.convert import convert
    from ..formats.gguf import read_geometry

    check_out(args.out)
    if args.quantize is not None:
        from ..llama.quantize import check_type, quantize

        if args.dtype == "q8_0":
            raise ConfigError("--quantize starts from --dtype f32 or f16, not q8_0")
        check_type(args.quantize)  # a refusal is one line before anything is converted
    out = Path(os.path.realpath(args.out) if os.path.islink(args.out) else args.out)  # a link is written through
    clean_stale_temporaries(out)
    staged = temporary_name(out)  # checked before it replaces --out: a file that fails leaves --out as it was
    first = temporary_name(out) if args.quantize is not None else None
    try:
        with pending(staged):
            if first is None:
                rec = convert(args.model, staged, args.dtype)
            else:
                with pending(first):
                    rec = convert(args.model, first, args.dtype)
                    rec.update(quantize(first, staged, args.quantize))
                rec.update(dtype=rec.pop("qtype"))
            try:
                rec.update(read_geometry(staged, "--out").summary())
            except ConfigError as exc:  # a file llama.cpp would refuse is not written
                said = str(exc).replace(os.fspath(staged), args.out)
                raise ConfigError(f"{args.model}: the GGUF written from it is not valid, so it was not written to "
                                  f"{args.out} ({said})") from None
            os.replace(staged, out)
    finally:
        for tmp in (staged, first):
            if tmp is not None:
                tmp.unlink(missing_ok=True)
    rec.update({k: args.out for k, v in rec.items() if v == os.fspath(staged)})  # the summary's own path
    rec.update(out=args.out, bytes=out.stat().st_size)
    if args.json:
        emit_json([rec])
    else:
        print(f"{rec['out']}: {rec['architecture']} {rec['dtype']}, {rec['bytes']} bytes, {rec['moe_layers']} MoE "
              f"layers of E={rec['num_experts']} k={rec['top_k']}, expert "
              + (f"{rec['expert_bytes']} bytes, " if rec["expert_bytes"] is not None else
                 f"{rec['expert_bytes_min']}-{rec['expert_bytes_max']} bytes by layer, ")
              + f"tokenizer {rec['tokenizer']}" + (", chat template" if rec.get("chat_template") else "")
              + (f", {rec['nextn_layers']} MTP block(s) (not run)" if rec.get("nextn_layers") else ""))
        for note in rec.get("notes") or []:
            print(f"  note: {note}")
    return 0
