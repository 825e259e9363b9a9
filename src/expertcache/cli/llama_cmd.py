"""``expertcache llama``: a GGUF MoE in llama.cpp -- its expert geometry (``info``), one measured
decode under a memory wall (``run``) and the capacity response (``sweep``). docs/llama.md."""

from __future__ import annotations

import json
import sys

import numpy as np

from ..errors import ConfigError
from .common import (TIMEOUT_SECONDS, add_json, add_subcommands, byte_size, check_out, emit_json, positive_int,
                     positive_number, seed_int, table, threads_int)
from .inputs import read_tokens
from .llama_opts import add_generation_options, add_readers, open_session

HELP = """llama.cpp as the engine: the GGUF is mmapped, so the kernel page cache is the expert tier.
'info' prints the expert geometry; 'run' greedy-decodes a prompt in one page-cache mode (mmap,
random, advise, pin, managed, lookahead, nocache, prefetch, nommap) behind an enforced memory wall and reports tokens/s,
the process's own read bytes per token, the wall's proof and the LRU demand model; 'sweep' runs
every (wall, mode) cell several times in a shuffled order. Needs the llama extra. See docs/llama.md."""
WALLS = ("auto", "cgroup", "balloon")
MAX_PROMPT_BYTES = 4 << 20
"""A prompt (``--prompt``, ``--prompt-file``, ``--chat``) longer than this is refused before tokenizing."""


def _checked_text(text: str, args) -> str:
    if len(text.encode("utf-8", errors="replace")) > MAX_PROMPT_BYTES:
        raise ConfigError(f"the prompt is longer than {MAX_PROMPT_BYTES} bytes")
    if not text.strip():
        raise ConfigError("the prompt is empty")
    return text


def add_parser(sub) -> None:
    p = sub.add_parser("llama", help="llama.cpp engine: GGUF geometry, walled decode runs, capacity sweep",
                       description=HELP)
    lsub = add_subcommands(p, "llama_command")
    info = lsub.add_parser("info", help="the expert geometry of a GGUF MoE",
                           description="E, k, layers, expert bytes and tensor types of a GGUF MoE; with --experts, "
                                       "the file byte ranges of every expert (gate, up, down).")
    info.add_argument("model", metavar="MODEL.gguf")
    info.add_argument("--experts", action="store_true", help="list every expert's byte ranges")
    add_json(info)
    info.set_defaults(func=run_info)
    from ..llama.advice import MODES

    run = lsub.add_parser("run", help="one measured greedy decode in a page-cache mode, optionally walled",
                          description=HELP)
    _common(run)
    run.add_argument("--mode", choices=MODES, default="mmap", help="page-cache mode (default mmap; docs/llama.md)")
    run.add_argument("--memory-wall", default=None, metavar="SIZE",
                     help="enforced memory for the run: bytes (800MB) or P%% (the dense part plus P%% of the expert "
                          "tensors); default none")
    run.add_argument("--cache-memory", default=None, metavar="SIZE",
                     help="bound the managed mode's page cache: bytes or P%% (default: the wall)")
    run.set_defaults(func=run_run)
    sw = lsub.add_parser("sweep", help="decode tokens/s and read bytes per token against the wall",
                         description="Every (wall, mode, run) once in a seeded shuffled order; per cell the median "
                                     "and min-max of decode tokens/s and read bytes per token. A wall P% is the "
                                     "dense part of the file plus P% of the expert tensors.")
    _common(sw)
    sw.add_argument("--walls", required=True, metavar="LIST", help="walls, e.g. 25%%,50%%,75%%,100%% or 400MB,800MB")
    sw.add_argument("--mode", action="append", choices=MODES, dest="modes", help="a mode (repeat; default mmap, advise)")
    sw.add_argument("--runs", type=positive_int, default=3, help="runs per cell (default 3)")
    sw.add_argument("--seed", type=seed_int, default=0, help="seed of the shuffled order (default 0)")
    sw.add_argument("--target-tokens-per-s", type=positive_number, default=None, metavar="R",
                    help="report the smallest wall whose median decode rate reaches R")
    sw.add_argument("--plot", default=None, metavar="PATH", help="figure of both curves (.png, .pdf, .svg)")
    sw.set_defaults(func=run_sweep)
    gen = lsub.add_parser("generate", help="text in, text out, in a page-cache mode",
                          description="Complete a prompt (--prompt, --prompt-file) or answer a chat message with the "
                                      "model's own chat template (--chat), streaming the text to stdout, with "
                                      "llama-cpp-python's Llama (tokenizer, templates, sampling) and the page-cache "
                                      "mode attached. --cache-memory bounds the managed mode's page cache (the dense "
                                      "part plus the experts it may hold; P% = the dense part plus P% of the expert "
                                      "tensors). Greedy unless --temperature > 0. Figures go to stderr (--json: one "
                                      "object on stdout instead).")
    add_generation_options(gen)
    gen.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N",
                     help="tokens generated at most (default 128)")
    gen.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from ..llama.completion import PromptError, rendered_roles
    from ..llama.constraints import ConstraintError, response_grammar
    from ..llama.textgen import stream_text

    text = _prompt_text(args)
    messages = None
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": _checked_text(args.chat, args)}]
    elif args.system is not None:
        raise ConfigError("--system goes with --chat")
    else:
        text = _checked_text(text, args)
    schema = _json_schema(args)
    with open_session(args) as session:
        grammar = None
        if schema is not None:
            try:
                grammar = response_grammar({"type": "json_schema", "json_schema": {"schema": schema}},
                                           session.llama._model.vocab)
            except ConstraintError as exc:
                where = f"--json-schema-file {args.json_schema_file}" if args.json_schema_file else "--json-schema"
                raise ConfigError(f"{where}: {exc}") from None
        if messages is not None:
            session.check_chat()
            if args.system is not None and rendered_roles(session.llama).get("system") is False:
                raise ConfigError("--system: this model's chat format leaves system messages out of the prompt "
                                  "(put the instruction in --chat)")  # it had been dropped without a word
        n_prompt = len(session.tokenize(text)) if messages is None else None
        if n_prompt is not None and n_prompt + args.max_new_tokens > session.n_ctx:
            raise ConfigError(f"the prompt ({n_prompt} tokens) and --max-new-tokens {args.max_new_tokens} exceed the "
                              f"context of {session.n_ctx} tokens (--ctx)")
        pieces = []
        try:
            for piece in stream_text(session, prompt=text, messages=messages, max_tokens=args.max_new_tokens,
                                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                     grammar=grammar, top_k=args.top_k, min_p=args.min_p,
                                     repeat_penalty=args.repeat_penalty):
                if isinstance(piece, dict):
                    figures = piece
                    break
                pieces.append(piece)
                if not args.json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except PromptError as exc:  # a chat's templated prompt: too long for --ctx, or refused by the template
            raise ConfigError(f"--chat: {exc}") from None
        rec = {"model": session.geometry.path, "mode": session.mode, "policy": session.policy if session.mode ==
               "managed" else None, "cache_memory": session.cache_bytes, "text": "".join(pieces), **figures,
               **session.context_settings()}
    if args.json:
        emit_json([rec])
        return 0
    print()
    rate = rec["decode_tokens_per_s"]
    print(f"[{rec['mode']}: {rec['decode_steps'] + 1 if rec['decode_steps'] is not None else 0} tokens, "
          f"decode {rate:.3g} tok/s" if rate else f"[{rec['mode']}: decode -", end="", file=sys.stderr)
    print(f", first token {rec['ttft_seconds']:.3g} s" if rec["ttft_seconds"] is not None else "", end="",
          file=sys.stderr)
    print(f", read {rec['read_bytes']} bytes]" if rec["read_bytes"] is not None else "]", file=sys.stderr)
    return 0


def _prompt_options(p, tokens: bool) -> None:
    """The prompt: text (tokenized by the model's own vocabulary) or, for measured runs, token ids."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt as text")
    src.add_argument("--prompt-file", metavar="PATH", help="the prompt as a UTF-8 text file")
    if tokens:
        src.add_argument("--tokens", metavar="IDS.npy", help="prompt token ids (1-d, or the first row of 2-d)")


def _common(p) -> None:
    p.add_argument("model", metavar="MODEL.gguf")
    _prompt_options(p, tokens=True)
    p.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="prompt tokens used (default 64)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="tokens generated (default 32)")
    p.add_argument("--threads", type=threads_int, default=1, metavar="T", help="llama.cpp threads (default 1)")
    add_readers(p)
    p.add_argument("--predict", choices=("lookahead",), default=None,
                   help="managed: load the next MoE layer's experts the router lookahead predicts as soon as this "
                        "layer's residual is known, evicted first if unused (off by default: it read 7-15x more "
                        "than without on the benchmark; docs/llama.md)")
    p.add_argument("--wall", choices=WALLS, default="auto", help="how the wall is enforced (default auto)")
    p.add_argument("--headroom", type=byte_size("--headroom"), default=None, metavar="SIZE",
                   help="most the wall's limit follows the process's own memory to, above the capacity "
                        "(default 4 GiB, within what the machine can give)")
    p.add_argument("--policy", default=None, metavar="NAME", help="managed mode's online eviction rule (default lru)")
    p.add_argument("--timeout", type=TIMEOUT_SECONDS, default=None, metavar="S",
                   help="kill a run after S seconds (0.001 to 1e6)")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip the physical limit (the device's bandwidth and the compute rate, measured once "
                        "and cached: docs/llama.md, Roofline)")
    add_json(p)


def _prompt_text(args) -> str | None:
    """The text of ``--prompt`` / ``--prompt-file`` (None when the prompt is token ids)."""
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is None:
        return None
    try:
        with open(args.prompt_file, encoding="utf-8") as fh:
            return fh.read(MAX_PROMPT_BYTES + 1)[:MAX_PROMPT_BYTES + 1]
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"--prompt-file {args.prompt_file}: {exc.strerror or exc}") from None


MAX_SCHEMA_BYTES = 1 << 20
"""Largest ``--json-schema`` (or its file): a request body's bound in ``serve``."""


def _json_schema(args) -> dict | None:
    """The JSON schema of ``--json-schema`` / ``--json-schema-file`` (None when neither is given): a
    JSON object, at most :data:`MAX_SCHEMA_BYTES`; anything else is one line."""
    where, text = "--json-schema", args.json_schema
    if args.json_schema_file is not None:
        where = f"--json-schema-file {args.json_schema_file}"
        try:
            with open(args.json_schema_file, "rb") as fh:
                raw = fh.read(MAX_SCHEMA_BYTES + 1)
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    if text is None:
        return None
    if len(text.encode("utf-8", errors="replace")) > MAX_SCHEMA_BYTES:
        raise ConfigError(f"{where}: more than {MAX_SCHEMA_BYTES:,} bytes")
    try:
        schema = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({str(exc)[:120]})") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"{where}: a JSON schema is a JSON object, not {type(schema).__name__}")
    return schema


def _setup(args):
    from ..formats.gguf import read_geometry
    from ..llama.engine import MAX_CONTEXT
    from ..policies import make_policy

    make_policy(args.policy or "lru")  # a bad --policy is one line before anything runs

    g = read_geometry(args.model, "MODEL")
    text = _prompt_text(args)
    if text is not None:
        from ..llama.textgen import tokenize

        ids = np.asarray(tokenize(g.path, _checked_text(text, args)), dtype=np.int64)
    else:
        ids = read_tokens(args.tokens)
    if ids.ndim not in (1, 2) or ids.size == 0:
        raise ConfigError(f"--tokens {args.tokens}: expected a non-empty 1-d or 2-d array of ids")
    prompt = (ids[0] if ids.ndim == 2 else ids)[: args.prompt_len]
    if prompt.size < 1:
        raise ConfigError(f"--tokens {args.tokens}: the first row is empty")
    if int(prompt.min()) < 0:
        raise ConfigError(f"--tokens {args.tokens}: token id {int(prompt.min())} is negative")
    need, trained = prompt.size + args.max_new_tokens, g.context_length
    limit = MAX_CONTEXT if trained is None else min(MAX_CONTEXT, trained)
    if need > limit:  # as generate, serve and capture refuse: beyond the trained positions nothing was learned
        raise ConfigError(f"the prompt ({prompt.size} tokens) and --max-new-tokens {args.max_new_tokens} need "
                          f"{need:,} positions, more than {limit:,}" + (
                              f" (the model's {g.architecture}.context_length)" if limit == trained else ""))
    return g, np.asarray(prompt, dtype=np.int64)


def run_info(args) -> int:
    from ..formats.gguf import read_geometry

    g = read_geometry(args.model, "MODEL")
    rec = g.summary()
    if args.experts:
        rec["experts"] = [{"layer": lid, "expert": e, "ranges": g.expert_ranges(lid, e)}
                          for lid in g.moe_layers for e in range(g.num_experts)]
    if args.json:
        emit_json([rec])
        return 0
    size = (f"{rec['expert_bytes']} bytes" if rec["expert_bytes"] is not None else
            f"{rec['expert_bytes_min']}-{rec['expert_bytes_max']} bytes by layer")
    print(f"{g.path}: {g.architecture} ({'tested' if g.tested else 'read, not tested here'}), "
          f"{len(g.moe_layers)} of {g.num_layers} layers MoE, E={g.num_experts}, k={g.top_k}; expert {size} "
          f"({', '.join(rec['expert_tensors'])}: {', '.join(rec['expert_types'])}); expert tensors "
          f"{g.expert_tensor_bytes}, dense {g.dense_bytes}" + (f", skipped {g.skipped_bytes}" if g.skipped_bytes else "")
          + f" of {g.file_bytes} bytes")
    if args.experts:
        table([(x["layer"], x["expert"], " ".join(f"{o}+{n}" for o, n in x["ranges"])) for x in rec["experts"]],
              ["layer", "expert", "ranges (offset+bytes, one per expert tensor)"])
    return 0


def run_run(args) -> int:
    from ..llama.advice import mode_options
    from ..llama.runner import run_one
    from ..llama.sweep import parse_wall

    policy = mode_options([args.mode], args.policy, args.readers)
    g, prompt = _setup(args)
    cache = parse_wall(args.cache_memory, g, "--cache-memory")
    wall = parse_wall(args.memory_wall, g, "--memory-wall")
    rec = run_one(g, prompt, args.max_new_tokens, args.mode, wall_bytes=wall, wall=args.wall,
                  headroom_bytes=args.headroom, threads=args.threads, timeout=args.timeout, policy=policy,
                  cache_bytes=cache, roofline=not args.no_roofline, readers=args.readers, predict=args.predict)
    if _prompt_text(args) is not None:  # a text prompt: the text generated too
        from ..llama.textgen import detokenize_file

        rec["output_text"] = detokenize_file(g.path, rec["output_ids"])
    if args.json:
        emit_json([rec])
        return 0
    _print_runs([rec])
    return 0


def _print_runs(recs) -> None:
    table([(r["mode"], r["memory_wall"] or "none", r["prefill_tokens_per_s"], r["decode_tokens_per_s"],
            r["read_bytes_per_token"], r["major_faults"], r.get("demand_bytes_per_token"), r.get("amplification"),
            r["proof_ok"], r["output_sha256"][:12]) for r in recs],
          ["mode", "wall", "prefill tok/s", "decode tok/s", "read B/token", "major faults", "demand B/token",
           "amplification", "proof", "output sha256"])
    for r in recs:
        if r.get("wall_note"):
            print(f"{r['mode']}: {r['wall_note']}", file=sys.stderr)


def run_sweep(args) -> int:
    from ..llama.advice import mode_options
    from ..llama.sweep import parse_walls, plot_sweep, sweep

    check_out(args.plot, "--plot")
    if args.plot:
        from ..report.plots import plot_format
        plot_format(args.plot)
    modes = list(dict.fromkeys(args.modes or ["mmap", "advise"]))
    policy = mode_options(modes, args.policy, args.readers)
    g, prompt = _setup(args)
    walls = parse_walls(args.walls, g)

    def progress(i, n, rec):
        if not args.json:
            what = f"failed: {rec['error']}" if rec.get("error") else f"{rec['decode_tokens_per_s']:.3g} tok/s"
            print(f"[{i}/{n}] {rec['mode']} wall {rec['memory_wall']}: {what}", file=sys.stderr)

    res = sweep(g, prompt, args.max_new_tokens, modes, walls, runs=args.runs, seed=args.seed, wall=args.wall,
                headroom_bytes=args.headroom, threads=args.threads, target=args.target_tokens_per_s,
                timeout=args.timeout, progress=progress, policy=policy, readers=args.readers,
                roofline=not args.no_roofline, predict=args.predict)
    failed = [r for r in res["records"] if r.get("error")]
    if res["records"] and len(failed) == len(res["records"]):
        raise ConfigError(f"every run of the sweep failed ({len(failed)}); the first: {str(failed[0]['error'])[:300]}")
    if args.plot:
        plot_sweep(res, args.plot, f"{g.path}: decode against the memory wall")
    if args.json:
        emit_json([{k: v for k, v in res.items() if k != "records"}] + res["records"])
        return 0
    table([(c["mode"], c["memory_wall"], c["runs"], c["decode_tokens_per_s"]["median"],
            c["decode_tokens_per_s"]["min"], c["decode_tokens_per_s"]["max"], c["read_bytes_per_token"]["median"],
            c["demand_bytes_per_token"], c["proof_ok"]) for c in res["cells"]],
          ["mode", "wall", "runs", "tok/s median", "min", "max", "read B/token", "demand B/token", "proof"])
    print(f"tokens identical across all runs: {res['tokens_identical']}; {res['headroom_note']}")
    if args.target_tokens_per_s is not None:
        for mode, wall in res["smallest_wall"].items():
            print(f"{mode}: smallest wall reaching {args.target_tokens_per_s:g} tok/s: {wall if wall else 'none'}")
    return 0

