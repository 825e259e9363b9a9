"""Options and the session that ``llama generate`` and ``serve`` share: the model, its page-cache
mode, its sampling, the expert readers, and :func:`open_session` (the
:class:`~expertcache.llama.textgen.Session` those options describe). The llama extra is imported
inside the functions: every command's module is imported to build the parser, and ``expertcache
--help`` must not load llama.cpp."""

from __future__ import annotations

from .._io import read_text
from ..errors import ConfigError
from ..formats.gguf import chat_template_problem
from ..llama import KV_CACHE_TYPES, MAX_SEED
from .common import _int_in, add_json, float_in, nonnegative_float, positive_int, threads_int


def add_generation_options(p) -> None:
    """The options ``llama generate`` and ``serve`` share: the model, its mode and its sampling."""
    from ..llama.advice import MODES

    p.add_argument("model", metavar="MODEL.gguf")
    if p.prog.endswith("generate"):
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--prompt", metavar="TEXT", help="complete this text")
        src.add_argument("--prompt-file", metavar="PATH", help="complete the text of this UTF-8 file")
        src.add_argument("--chat", metavar="TEXT", help="answer this user message with the model's chat template")
        p.add_argument("--system", metavar="TEXT", default=None, help="a system message before --chat")
        p.add_argument("--temperature", type=nonnegative_float, default=0.0, metavar="TEMP",
                       help="0 is greedy (default 0)")
        p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0, metavar="P",
                       help="nucleus sampling (default 1)")
        p.add_argument("--seed", type=sampling_seed, default=0,
                       help=f"sampling seed, 0 to {MAX_SEED} (llama.cpp's is 32-bit; default 0)")
        p.add_argument("--top-k", type=_top_k, default=0, metavar="K",
                       help="sample among the K likeliest tokens; 0 is off (default 0)")
        p.add_argument("--min-p", type=float_in(0, 1), default=0.05, metavar="P",
                       help="drop tokens less likely than P times the likeliest (default 0.05, llama.cpp's)")
        p.add_argument("--repeat-penalty", type=float_in(0, 10, lo_open=True), default=1.0, metavar="X",
                       help="llama.cpp's repetition penalty over the last 64 tokens, applied before a greedy pick "
                            "too (default 1: off)")
        shape = p.add_mutually_exclusive_group()
        shape.add_argument("--json-schema", metavar="SCHEMA", default=None,
                           help="hold the text to this JSON schema (JSON text; {} is any JSON object), as llama.cpp's "
                                "-j does; a keyword the grammar would not hold is refused (docs/serve.md, "
                                "Structured output)")
        shape.add_argument("--json-schema-file", metavar="PATH", default=None,
                           help="--json-schema read from this UTF-8 file")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="page-cache mode (default: managed with --cache-memory, else mmap; docs/llama.md)")
    p.add_argument("--cache-memory", default=None, metavar="SIZE",
                   help="bound the managed mode's page cache: bytes (800MB) or P%% of the experts beside the "
                        "dense part")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help="online eviction rule of the managed mode (default lru; refused with another mode)")
    p.add_argument("--threads", type=threads_int, default=1, metavar="T", help="llama.cpp threads (default 1)")
    add_readers(p)
    p.add_argument("--ctx", type=positive_int, default=None, metavar="N",
                   help="context tokens, at most the model's trained context (default 2048, or that context where "
                        "it is smaller)")
    add_context_options(p)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat-format", default=None, metavar="NAME",
                      help="a llama-cpp-python chat format (chatml, ...) for a GGUF without its own chat template")
    chat.add_argument("--chat-template-file", default=None, metavar="PATH",
                      help="a Jinja chat template (UTF-8, at most 1 MiB) in place of the GGUF's own, as llama.cpp's "
                           "--chat-template-file: the tool-call and thinking formats are then read from it")
    add_json(p)


def add_context_options(p) -> None:
    """llama.cpp's context settings (its options of the same names): the KV cache's types, flash
    attention, the logical and physical batch sizes."""
    p.add_argument("--flash-attn", "-fa", choices=("on", "off"), default="off",
                   help="llama.cpp's flash attention (default off, as llama-cpp-python's; llama-server's is auto); "
                        "a quantized V cache needs it")
    for which in ("k", "v"):
        p.add_argument(f"--cache-type-{which}", f"-ct{which}", choices=tuple(KV_CACHE_TYPES), default="f16",
                       metavar="TYPE", help=f"the KV cache's {which.upper()} type: {', '.join(KV_CACHE_TYPES)} "
                                            "(default f16; q8_0 halves its memory)")
    p.add_argument("--batch-size", "-b", type=positive_int, default=None, metavar="N",
                   help="logical batch: prompt tokens per forward, at most --ctx (default 512, or --ctx where smaller)")
    p.add_argument("--ubatch-size", "-ub", type=positive_int, default=None, metavar="N",
                   help="physical batch: tokens per graph, at most --batch-size (default --batch-size); it sizes "
                        "llama.cpp's compute buffer")


def context_settings(args) -> dict:
    """:func:`add_context_options`' values as :meth:`~expertcache.llama.textgen.Session.open` takes them."""
    return {"flash_attn": args.flash_attn == "on", "type_k": args.cache_type_k, "type_v": args.cache_type_v,
            "n_batch": args.batch_size, "n_ubatch": args.ubatch_size}


def add_readers(p) -> None:
    p.add_argument("--readers", type=_nonnegative_int, default=None, metavar="N",
                   help="threads that read the experts being loaded (managed, prefetch; default for prefetch the "
                        "machine's threads, at most 8, as ik_llama.cpp's; 0 otherwise). prefetch with 0 hints the "
                        "routed experts instead (ik_llama.cpp's fallback)")


def sampling_seed(text: str) -> int:
    """A sampling seed: an integer in [0, :data:`~expertcache.llama.MAX_SEED`]."""
    return _int_in(text, 0, MAX_SEED, "a sampling seed", f"in 0..{MAX_SEED} (llama.cpp's seed is 32-bit)")


def _top_k(text: str) -> int:
    return _int_in(text, 0, 1 << 30, "a number of tokens", "0 or more")


def _nonnegative_int(text: str) -> int:
    return _int_in(text, 0, 64, "a number of threads", "in 0..64")


MAX_TEMPLATE_BYTES = 1 << 20
"""Largest ``--chat-template-file``: real templates are a few to some tens of kilobytes."""


def chat_template(args) -> str | None:
    """The template of ``--chat-template-file`` (None without it), one line where it cannot be
    read or does not compile as llama-cpp-python compiles a GGUF's."""
    path = getattr(args, "chat_template_file", None)
    if path is None:
        return None
    where = f"--chat-template-file {path}"
    text = read_text(path, where, max_bytes=MAX_TEMPLATE_BYTES)
    if not text.strip():
        raise ConfigError(f"{where}: the file is empty")
    problem = chat_template_problem(text)
    if problem:
        raise ConfigError(f"{where}: not a template Jinja compiles ({problem})")
    return text


def open_session(args, before_load=None, loading=None, settled=None):
    """The :class:`~expertcache.llama.textgen.Session` of ``generate`` / ``serve``'s options
    (``before_load``, ``loading``, ``settled``: :meth:`~expertcache.llama.textgen.Session.open`'s)."""
    from ..llama.advice import mode_options
    from ..llama.engine import _llama
    from ..formats.gguf import read_geometry
    from ..policies import make_policy

    _llama()  # one line where the llama extra is missing
    from ..llama.sweep import parse_wall
    from ..llama.textgen import Session

    make_policy(args.policy or "lru")
    mode = args.mode or ("managed" if args.cache_memory is not None else "mmap")
    policy = mode_options([mode], args.policy, args.readers)
    g = read_geometry(args.model, "MODEL")
    cache = parse_wall(args.cache_memory, g, "--cache-memory")
    return Session.open(g.path, mode=mode, cache_bytes=cache, policy=policy, n_ctx=args.ctx,
                        threads=args.threads, seed=getattr(args, "seed", 0), chat_format=args.chat_format,
                        chat_template=chat_template(args),
                        readers=args.readers, routed_experts=getattr(args, "enable_return_routed_experts", False),
                        before_load=before_load, loading=loading, settled=settled, **context_settings(args))
