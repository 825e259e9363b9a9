"""``expertcache serve``: an OpenAI-compatible HTTP server for a GGUF MoE in a page-cache mode."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import sys

from .. import __version__
from .._io import read_text
from ..errors import ConfigError, is_int, is_real
from .common import _int_in, byte_size, emit_json, seconds_in
from .llama_opts import add_generation_options, chat_template, open_session

HELP = """Serve a GGUF MoE over HTTP with the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions,
/v1/responses, streamed or not) and Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens),
/health and /metrics (Prometheus), llama.cpp's /completion, /tokenize, /detokenize, /apply-template and /props, with
llama-cpp-python's Llama (tokenizer, chat template, sampling) and an expertcache page-cache mode deciding
which experts stay in memory:
--cache-memory SIZE bounds the managed mode's page cache (bytes, or P% = the dense part plus P% of the
expert tensors), for a model bigger than the memory it may use. One slot: requests queue and are
answered one at a time. Binds 127.0.0.1 unless --host says otherwise (with --api-key, only requests that
present a key are answered); SIGTERM or Ctrl-C stops it.
Needs the serve and llama extras. See docs/serve.md."""


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server for a GGUF MoE with a bounded "
                       "expert cache",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generation_options(p)
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=port_int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--model-alias", default=None, metavar="NAME",
                   help="the model id clients name (default: the file name without .gguf)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="answer requests asking return_routed_experts with the experts every position routed "
                        "(SGLang's sglext.routed_experts; costs every prompt row's logits; docs/serve.md)")
    p.add_argument("--max-connections", type=connections_int, default=None, metavar="N",
                   help="open connections at most; one more is answered 503 and closed (default 128)")
    p.add_argument("--request-timeout", type=seconds_in(0.1, 3600), default=None, metavar="S",
                   help="seconds a request's headers and body may take to arrive, from its first byte (or from "
                        "the connection, for one that sends nothing); then the connection is closed (default 30)")
    p.add_argument("--memory-wall", default=None, metavar="SIZE",
                   help="serve inside a memory cgroup that proves the page cache of the model stays within SIZE "
                        "(bytes or P%%; /metrics shows the proof live, stderr at exit); with the managed mode "
                        "--cache-memory defaults to it")
    p.add_argument("--headroom", type=byte_size("--headroom"), default=None, metavar="SIZE",
                   help="with --memory-wall: the most the wall's limit follows the server's own memory to, above "
                        "the wall (default 4 GiB, within what the machine can give)")
    p.add_argument("--reasoning-format", choices=("auto", "deepseek", "none"), default=None,
                   help="a chat's thinking, where the model's template teaches it (a <think> block: Qwen3, "
                        "Qwen3.5, DeepSeek-R1, GLM-4.5, MiniMax-M2, Kimi K2-Thinking; Gemma 4's <|channel>thought "
                        "block; Kimi K3's think section; MiniMax-M3's <mm:think> block; gpt-oss's analysis channel): "
                        "auto or deepseek read it out into "
                        "message.reasoning_content, none leaves the text as written (default auto; a request's "
                        "reasoning_format overrides it)")
    p.add_argument("--api-key", default=None, metavar="KEY[,KEY...]",
                   help="answer only requests presenting one of these keys (Authorization: Bearer KEY, or "
                        "x-api-key: KEY), as llama.cpp's --api-key; /health and /v1/models stay open")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="API keys from this file, one a line (beside --api-key's); keeps them out of the process "
                        "list")
    p.add_argument("--allowed-origins", type=origins, default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="web origins whose pages may call the server from a browser (CORS), as vLLM's option: "
                        "https://app.example.com, or * for any (default none: no page of another origin can "
                        "read an answer)")
    p.add_argument("--chat-template-kwargs", type=template_kwargs, default=None, metavar="JSON",
                   help="variables the chat template is rendered with, as a JSON object (e.g. "
                        "'{\"enable_thinking\": false}' for Qwen3); a request's chat_template_kwargs add to them")
    p.set_defaults(func=run)


def port_int(text: str) -> int:
    return _int_in(text, 0, 65535, "a port number", "in 0..65535")


def connections_int(text: str) -> int:
    return _int_in(text, 2, 100_000, "a number of connections", "in 2..100000")


def template_kwargs(text: str) -> dict:
    """``--chat-template-kwargs``: a JSON object (its names are checked once the llama extra is known
    to be there: :func:`~..llama.completion.template_variables`)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of template variables, got {type(obj).__name__}")
    return obj


def origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: ``*``, or origins ``scheme://host[:port]`` separated by commas."""
    found = tuple(o.strip() for o in text.split(","))
    for o in found:
        if o != "*" and not re.fullmatch(r"https?://[^/\s,*]+", o):
            raise argparse.ArgumentTypeError(f"expected * or origins such as https://app.example.com (a scheme and a "
                                             f"host, no path), got {o[:60]!r}")
    return found


def listen_host(text: str) -> str:
    """``--host``: an address or name, not empty (uvicorn took ``''`` as every interface, so a
    blank value opened the server to the network and printed ``http://:8000``)."""
    if not text.strip() or text != text.strip() or len(text) > 253:
        raise argparse.ArgumentTypeError(f"expected an address to listen on (127.0.0.1, or 0.0.0.0 for every "
                                         f"interface), got {text[:60]!r}")
    return text


MAX_KEY_FILE_BYTES = 1 << 16
"""The largest ``--api-key-file`` (a list of keys)."""


def api_keys(args) -> tuple[str, ...]:
    """The keys of ``--api-key`` (comma-separated) and ``--api-key-file`` (one a line, blank lines
    skipped); one line where one is empty or not printable ASCII without white space (a header
    could not carry it), or the file holds none."""
    keys = []
    if args.api_key is not None:
        keys += [("--api-key", k) for k in args.api_key.split(",")]
    if args.api_key_file is not None:
        where = f"--api-key-file {args.api_key_file}"
        lines = [("--api-key-file", k.strip()) for k in read_text(args.api_key_file, where,
                                                                  max_bytes=MAX_KEY_FILE_BYTES).splitlines()]
        lines = [(opt, k) for opt, k in lines if k]
        if not lines:
            raise ConfigError(f"{where}: the file holds no key")
        keys += lines
    for opt, key in keys:
        if not key or not all("!" <= c <= "~" for c in key):
            raise ConfigError(f"{opt}: a key is empty or not printable ASCII without white space (an HTTP header "
                              "carries it)")
    return tuple(dict.fromkeys(k for _, k in keys))


def run(args) -> int:
    keys = api_keys(args)  # one line before anything loads
    try:
        import fastapi  # noqa: F401  (the extra's presence, before the model loads)
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("serve needs FastAPI and uvicorn: pip install 'expertcache[serve]'") from None
    if args.headroom is not None and args.memory_wall is None:
        raise ConfigError("--headroom needs --memory-wall")
    from ..llama.engine import _llama

    _llama()  # the extra's presence, before a wall or the model (the names below are checked against it)
    if args.chat_template_kwargs is not None:
        from ..llama.completion import template_variables

        try:
            template_variables(args.chat_template_kwargs, "--chat-template-kwargs")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if args.memory_wall is not None:
        return run_walled(args)
    from ..llama.server import WallGauge, Workers, serve

    workers = Workers()  # a request starts no thread: these two run them, made before the wall follows us
    inside = wall_inside()  # set by run_walled for its child
    before_load = loading = settled = wall_state = bandwidth = None
    if inside:  # the wall follows this process once all but the model's load is set up
        from ..wall.capacity import begin_following, model_load
        from ..wall.capacity import settled as settled_mark
        from ..wall.cgroupfs import PEAK_SUFFIX

        flag = inside["follow_flag"]
        before_load = functools.partial(begin_following, flag)
        loading = model_load(flag)
        # managed: a warm-up forward, then the wall restarts its window (Session.warm_up)
        settled = functools.partial(settled_mark, flag)
        # the live proof reads the peak the wall's sampler publishes (from before the load)
        wall_state = WallGauge(args.model, inside["capacity"], flag and flag + PEAK_SUFFIX)
        bandwidth = inside["bandwidth"]  # measured by the parent, outside the wall
    model_id = args.model_alias or os.path.basename(args.model).removesuffix(".gguf")
    with open_session(args, before_load, loading, settled) as session:
        def announce(url: str) -> None:
            rec = {"url": url, "model": model_id, "gguf": session.geometry.path, "mode": session.mode,
                   "cache_memory": session.cache_bytes, "policy": session.policy if session.mode == "managed" else None,
                   "n_ctx": session.n_ctx, "pid": os.getpid(), "warm_up_tokens": session.warm_up_tokens,
                   "routed_experts": session.llama.routing is not None, **session.context_settings(),
                   "api_keys": len(keys)}
            if args.json:
                emit_json([rec])
                sys.stdout.flush()
            else:
                cache = f", expert cache {session.cache_bytes} bytes ({session.policy})" if session.cache_bytes else ""
                print(f"expertcache serve: {model_id} ({session.geometry.architecture}, mode {session.mode}{cache}) "
                      f"on {url} (one slot; requests queue)", file=sys.stderr, flush=True)

        serve(session, host=args.host, port=args.port, model_id=model_id, announce=announce, wall_state=wall_state,
              version=__version__, max_connections=args.max_connections, request_seconds=args.request_timeout,
              bandwidth=bandwidth, workers=workers, reasoning_format=args.reasoning_format or "auto",
              template_kwargs=args.chat_template_kwargs, api_keys=keys, allowed_origins=args.allowed_origins or ())
    return 0


WALL_ENV = "EXPERTCACHE_SERVE_WALL"
"""How ``serve --memory-wall`` tells its child (the server inside the wall) the capacity, the follow
flag and the device's bandwidths (JSON: :func:`wall_inside`)."""


def wall_inside() -> dict | None:
    """``{"capacity": bytes, "follow_flag": path or None, "bandwidth": {1: bytes/s or None, 4: ...}}``
    from :data:`WALL_ENV` (removed from the environment), or None where it is not set; a value that
    is not what ``run_walled`` writes is one line (exit 2)."""
    text = os.environ.pop(WALL_ENV, "")
    if not text:
        return None
    try:
        rec = json.loads(text[:4096]) if len(text) <= 4096 else None
    except ValueError:
        rec = None
    bw = rec.get("bandwidth") if isinstance(rec, dict) else None
    if not (isinstance(rec, dict) and is_int(rec.get("capacity"), 1) and isinstance(bw, dict)
            and (rec.get("follow_flag") is None or isinstance(rec["follow_flag"], str))
            and set(bw) <= {"1", "4"} and all(v is None or (is_real(v) and v > 0) for v in bw.values())):
        raise ConfigError(f"${WALL_ENV}: not what serve --memory-wall gives the server inside its wall "
                          f"({text[:80]!r}); unset it")
    return {"capacity": rec["capacity"], "follow_flag": rec.get("follow_flag"),
            "bandwidth": {int(k): v for k, v in bw.items()}}


def run_walled(args) -> int:
    """The server as a child inside a memory cgroup of ``--memory-wall`` bytes whose limit follows
    its own memory (:func:`~expertcache.wall.capacity.follow_plan`), the GGUF's page cache as the
    tier; output and signals pass through; the proof is one line on stderr at exit."""
    from ..formats.gguf import read_geometry
    from ..llama.advice import mode_options
    from ..llama.runner import check_managed, check_wall
    from ..llama.server import device_bandwidths
    from ..llama.sweep import parse_wall
    from ..wall import capacity as cap
    from ..wall.pagecache import evict_for_wall

    g = read_geometry(args.model, "MODEL")
    wall = parse_wall(args.memory_wall, g, "--memory-wall")
    check_wall(g, wall, mode=args.mode)
    mode_options([args.mode or "managed"], args.policy, args.readers)  # as the child will, before the wall starts
    chat_template(args)  # read and compiled as the child will, a bad file one line before the wall starts
    if args.mode in (None, "managed"):  # the child's own check, made before the wall starts
        check_managed(g, parse_wall(args.cache_memory, g, "--cache-memory") or wall, args.policy or "lru")
    cache = parse_wall(args.cache_memory, g, "--cache-memory")
    if cache is not None and cache > wall:
        raise ConfigError(f"--cache-memory {cache} is above the --memory-wall {wall}: the pool would not fit in "
                          "the wall")
    argv = [sys.executable, "-m", "expertcache.cli.main", "serve", g.path]
    for opt in ("mode", "cache_memory", "policy", "threads", "readers", "ctx", "chat_format", "chat_template_file",
                "host", "port", "model_alias", "max_connections", "request_timeout", "reasoning_format",
                "chat_template_kwargs", "flash_attn", "cache_type_k", "cache_type_v", "batch_size", "ubatch_size",
                "api_key", "api_key_file", "allowed_origins"):
        value = getattr(args, opt)
        if opt in ("chat_template_file", "api_key_file") and value is not None:
            value = os.path.abspath(value)  # as the model's path: the child reads the same file
        if isinstance(value, tuple):  # --allowed-origins, as given
            value = ",".join(value)
        if value is not None:
            argv += ["--" + opt.replace("_", "-"), json.dumps(value) if isinstance(value, dict) else str(value)]
    if args.cache_memory is None and (args.mode in (None, "managed")):
        argv += ["--cache-memory", str(wall)]  # the managed pool bounded by the wall itself
    if args.json:
        argv.append("--json")
    if args.enable_return_routed_experts:
        argv.append("--enable-return-routed-experts")
    headroom, margin, note = cap.follow_plan(wall, args.headroom)
    bandwidth = device_bandwidths(g)  # here, outside the wall: its reader threads and buffers are not the server's
    with cap.worker_spec({}, "expertcache-serve-", True) as (_spec, flag):
        os.environ[WALL_ENV] = json.dumps({"capacity": wall, "follow_flag": flag,
                                           "bandwidth": {str(k): v for k, v in bandwidth.items()}})
        try:
            evict_for_wall([g.path])
            run = cap.run_walled(argv, capacity_bytes=wall, wall="cgroup", headroom_bytes=headroom,
                                 follow_margin=margin, follow_flag=flag, tier_files=[g.path], tier_locked=False,
                                 passthrough=True)
        finally:
            os.environ.pop(WALL_ENV, None)
    p = run.proof if isinstance(run.proof, dict) else {}
    print(f"expertcache serve: wall {wall} bytes ({run.enforced_by}): tier peak {p.get('tier_peak_bytes')} bytes, "
          f"own peak {p.get('own_peak_bytes')}; {note}; proof {'ok' if run.proof_ok else 'FAILED: ' + run.note}",
          file=sys.stderr)
    if run.returncode not in (0, None):
        how = (f"signal {signal.Signals(-run.returncode).name}" if run.returncode < 0 and
               -run.returncode in signal.valid_signals() else f"status {run.returncode}")
        print(f"expertcache serve: the server inside the wall exited with {how}", file=sys.stderr)
        return 2
    return 0 if run.proof_ok else 1
