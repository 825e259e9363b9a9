"""``expertcache capture``: teacher-force token sequences through a Hugging Face MoE checkpoint and
save its router trace, optionally with the router softmax and model-side signals (``--record``).

torch and transformers are imported only when the command runs.
"""

from __future__ import annotations

import argparse

import numpy as np

from .._progress import progress
from .._text import first_line
from ..errors import ConfigError
from .common import add_json, add_layers, add_out, check_out, emit_json, positive_int
from .inputs import check_checkpoint, read_text, read_tokens

HELP = """Run one teacher-forced forward per sequence (batch 1, every expert resident) through a Hugging
Face MoE checkpoint and save the router decisions as a canonical trace (phase teacher-forced): per
token position and MoE layer, the top-k experts and gate weights.

--router-probs adds the router softmax over all E experts ('router_probs' [T, L, E]). --record adds
model-side signals, one row per position (docs/learn.md, "Model-side signals"):
  token-ids     'token_ids' [T]: the input token id
  next-top:M    'next_top_ids', 'next_top_probs' [T, M]: the M most likely next tokens and their
                probabilities under the model's output softmax
  hidden:D[:S]  'hidden_summary' [T, D] float16: the final hidden state times a fixed random
                projection N(0,1)[H, D]/sqrt(H) drawn with seed S (default 0)
e.g. --record token-ids,next-top:8,hidden:16.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("capture", help="record a Hugging Face MoE model's router trace (and model-side signals)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint folder (save_pretrained layout), or a .gguf file: captured from llama.cpp (docs/llama.md)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="IDS.npy",
                     help="token ids: a 1-d stream cut into --max-len sequences, or a 2-d [sequences, tokens] array")
    src.add_argument("--text", metavar="FILE", help="UTF-8 text, tokenized with the checkpoint's tokenizer")
    add_out(p, "trace to write (.npz)")
    p.add_argument("--max-len", type=positive_int, default=384, metavar="N", help="tokens per sequence (default 384)")
    p.add_argument("--max-sequences", type=positive_int, default=None, metavar="N", help="capture at most N sequences")
    p.add_argument("--router-probs", action="store_true", help="include the full router softmax")
    p.add_argument("--record", default=None, metavar="SIGNALS",
                   help="model-side signals: token-ids, next-top:M, hidden:D[:SEED] (comma-separated)")
    add_layers(p, "MoE layer ids to record (default all)")
    p.add_argument("--generate", type=positive_int, default=None, metavar="N",
                   help="with a .gguf model: greedy-decode N tokens after each sequence, keep the decode steps only")
    p.add_argument("--keep-prompt", action="store_true",
                   help="with --generate: keep each prompt's forward too, as llama.cpp routed it, its rows flagged "
                        "in the trace's 'prefill' array (size --trace warms the managed pool with them)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="float32",
                   help="weights dtype (default float32)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    check_out(args.out)
    if str(args.model).lower().endswith(".gguf"):
        return run_gguf(args)
    if args.keep_prompt:
        raise ConfigError("--keep-prompt: supported with a .gguf model and --generate")
    if args.generate is not None:
        raise ConfigError("--generate: supported with a .gguf model (llama.cpp); for a checkpoint use "
                          "expertcache.capture around model.generate")
    check_checkpoint(args.model, "--model")  # before torch and transformers are imported
    try:
        import torch

        from .. import hf
        from ..hf.loading import resident
        from ..hf.model import find_sites, model_device
        from ..hf.passes import positions, split_tokens, vocab_size
        from ..hf.signals import parse_record
    except ImportError as exc:
        raise ConfigError(first_line(exc)) from None
    spec = parse_record(args.record)
    ids = read_tokens(args.tokens) if args.tokens else read_text(args.model, args.text)
    model = hf.load_model(args.model, device=args.device, dtype=args.dtype).eval()
    sequences = split_tokens(ids, args.max_len, args.max_sequences, positions(model))
    if not sequences:
        raise ConfigError("no sequence of at least 2 tokens to capture")
    vocab = vocab_size(model)
    lo, hi = min(int(np.min(s)) for s in sequences), max(int(np.max(s)) for s in sequences)
    if lo < 0 or (vocab and hi >= vocab):
        raise ConfigError(f"token id {lo if lo < 0 else hi} is outside the model's vocabulary [0, {vocab})")
    dev = model_device(model)
    with torch.no_grad(), resident(find_sites(model), dev), \
            hf.capture(model, phase="all", router_probs=args.router_probs, layers=args.layers, record=spec) as cap:
        for s in progress(sequences, desc="capture", disable=args.json):
            model(torch.as_tensor(np.asarray(s, dtype=np.int64)[None, :], device=dev))
    trace = cap.trace
    trace.save(args.out)
    rec = {"out": args.out, "model": args.model, "sequences": trace.num_sequences, "tokens": trace.num_tokens,
           "layers": trace.layer_ids, "num_experts": trace.num_experts, "top_k": trace.top_k,
           "router_probs": trace.router_probs is not None, "extras": sorted(trace.extras)}
    if args.json:
        emit_json([rec])
    else:
        extra = f"; extras {', '.join(rec['extras'])}" if rec["extras"] else ""
        print(f"{args.out}: {trace.num_tokens} tokens in {trace.num_sequences} sequence(s), L={trace.num_layers}, "
              f"k={trace.top_k} of E={trace.num_experts}{' with router_probs' if rec['router_probs'] else ''}{extra}")
    return 0


def run_gguf(args) -> int:
    """``expertcache capture --model MODEL.gguf``: the router trace from llama.cpp (teacher-forced, or
    the decode steps with ``--generate N``)."""
    from ..llama.capture import capture_gguf

    unsupported = [opt for opt, on in (("--text", args.text), ("--router-probs", args.router_probs),
                                       ("--record", args.record), ("--layers", args.layers),
                                       ("--device", args.device), ("--dtype", args.dtype != "float32")) if on]
    if unsupported:
        raise ConfigError(f"{unsupported[0]}: not supported with a .gguf model (llama.cpp capture records the "
                          "experts and gate weights of every MoE layer from --tokens)")
    if args.keep_prompt and not args.generate:
        raise ConfigError("--keep-prompt: with --generate N (a teacher-forced capture keeps every row already)")
    trace = capture_gguf(args.model, read_tokens(args.tokens), max_len=args.max_len,
                         max_sequences=args.max_sequences, generate=args.generate or 0, keep_prompt=args.keep_prompt)
    trace.save(args.out)
    rec = {"out": args.out, "model": args.model, "engine": "llama.cpp", "phase": trace.meta.get("phase"),
           "sequences": trace.num_sequences, "tokens": trace.num_tokens, "layers": trace.layer_ids,
           "num_experts": trace.num_experts, "top_k": trace.top_k, "expert_bytes": trace.meta.get("expert_bytes")}
    if args.json:
        emit_json([rec])
    else:
        print(f"{args.out}: {trace.num_tokens} {rec['phase']} tokens in {trace.num_sequences} sequence(s) from llama.cpp, "
              f"L={trace.num_layers}, k={trace.top_k} of E={trace.num_experts}")
    return 0
