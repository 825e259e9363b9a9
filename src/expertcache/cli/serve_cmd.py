"""``expertcache serve``: an OpenAI-compatible HTTP server for a GGUF MoE in a page-cache mode."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ConfigError
from .common import emit_json, positive_int
from .llama_cmd import add_generation_options, open_session

HELP = """Serve a GGUF MoE over HTTP with the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions,
streamed or not), /health and /metrics (Prometheus), with llama-cpp-python's Llama (tokenizer, chat
template, sampling) and an expertcache page-cache mode deciding which experts stay in memory:
--cache-memory SIZE bounds the managed mode's page cache (bytes, or P% = the dense part plus P% of the
expert tensors), for a model bigger than the memory it may use. One slot: requests queue and are
answered one at a time. Binds 127.0.0.1 unless --host says otherwise; SIGTERM or Ctrl-C stops it.
Needs the serve and llama extras. See docs/serve.md."""


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for a GGUF MoE with a bounded expert cache",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generation_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--model-alias", default=None, metavar="NAME",
                   help="the model id clients name (default: the file name without .gguf)")
    p.set_defaults(func=run)


def port_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not in 0..65535")
    return v


def run(args) -> int:
    try:
        import fastapi  # noqa: F401  (the extra's presence, before the model loads)
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("serve needs FastAPI and uvicorn: pip install 'expertcache[serve]'") from None
    from ..llama.server import serve

    model_id = args.model_alias or os.path.basename(args.model).removesuffix(".gguf")
    with open_session(args) as session:
        def announce(url: str) -> None:
            rec = {"url": url, "model": model_id, "gguf": session.geometry.path, "mode": session.mode,
                   "cache_memory": session.cache_bytes, "policy": session.policy if session.mode == "managed" else None,
                   "n_ctx": session.n_ctx, "pid": os.getpid()}
            if args.json:
                emit_json([rec])
                sys.stdout.flush()
            else:
                cache = f", expert cache {session.cache_bytes} bytes ({session.policy})" if session.cache_bytes else ""
                print(f"expertcache serve: {model_id} ({session.geometry.architecture}, mode {session.mode}{cache}) "
                      f"on {url} (one slot; requests queue)", file=sys.stderr, flush=True)

        serve(session, host=args.host, port=args.port, model_id=model_id, announce=announce)
    return 0
