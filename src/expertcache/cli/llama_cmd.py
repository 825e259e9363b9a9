"""``expertcache llama``: a GGUF MoE in llama.cpp -- its expert geometry (``info``), one measured
decode under a memory wall (``run``) and the capacity response (``sweep``). docs/llama.md."""

from __future__ import annotations

import sys

import numpy as np

from ..errors import ConfigError
from .common import add_json, add_subcommands, byte_size, check_out, emit_json, positive_int, seed_int, table
from .eval_cmd import _read_tokens

HELP = """llama.cpp as the engine: the GGUF is mmapped, so the kernel page cache is the expert tier.
'info' prints the expert geometry; 'run' greedy-decodes a prompt in one page-cache mode (mmap,
random, advise, pin, managed, lookahead, nocache, nommap) behind an enforced memory wall and reports tokens/s,
the process's own read bytes per token, the wall's proof and the LRU demand model; 'sweep' runs
every (wall, mode) cell several times in a shuffled order. Needs the llama extra. See docs/llama.md."""
WALLS = ("auto", "cgroup", "balloon")


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
    run.add_argument("--memory-wall", type=byte_size("--memory-wall"), default=None, metavar="SIZE",
                     help="enforced memory for the run, e.g. 800MB (default: none)")
    run.set_defaults(func=run_run)
    sw = lsub.add_parser("sweep", help="decode tokens/s and read bytes per token against the wall",
                         description="Every (wall, mode, run) once in a seeded shuffled order; per cell the median "
                                     "and min-max of decode tokens/s and read bytes per token. A wall P%% is the "
                                     "dense part of the file plus P%% of the expert tensors.")
    _common(sw)
    sw.add_argument("--walls", required=True, metavar="LIST", help="walls, e.g. 25%%,50%%,75%%,100%% or 400MB,800MB")
    sw.add_argument("--mode", action="append", choices=MODES, dest="modes", help="a mode (repeat; default mmap, advise)")
    sw.add_argument("--runs", type=positive_int, default=3, help="runs per cell (default 3)")
    sw.add_argument("--seed", type=seed_int, default=0, help="seed of the shuffled order (default 0)")
    sw.add_argument("--target-tokens-per-s", type=float, default=None, metavar="R",
                    help="report the smallest wall whose median decode rate reaches R")
    sw.add_argument("--plot", default=None, metavar="PATH", help="figure of both curves (.png, .pdf, .svg)")
    sw.set_defaults(func=run_sweep)


def _common(p) -> None:
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("--tokens", required=True, metavar="IDS.npy", help="prompt token ids (1-d, or the first row of 2-d)")
    p.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="prompt tokens used (default 64)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="tokens generated (default 32)")
    p.add_argument("--threads", type=positive_int, default=1, metavar="T", help="llama.cpp threads (default 1)")
    p.add_argument("--wall", choices=WALLS, default="auto", help="how the wall is enforced (default auto)")
    p.add_argument("--headroom", type=byte_size("--headroom"), default=None, metavar="SIZE",
                   help="wall memory above the capacity for the process itself (default: calibrated)")
    p.add_argument("--policy", default="lru", metavar="NAME",
                   help="online eviction rule deciding the managed mode's expert residency (default lru)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill a run after S seconds")
    add_json(p)


def _setup(args):
    from ..llama.geometry import read_geometry
    from ..policies import make_policy

    make_policy(args.policy)  # a bad --policy is one line before anything runs

    g = read_geometry(args.model, "MODEL")
    ids = _read_tokens(args.tokens)
    if ids.ndim not in (1, 2) or ids.size == 0:
        raise ConfigError(f"--tokens {args.tokens}: expected a non-empty 1-d or 2-d array of ids")
    prompt = (ids[0] if ids.ndim == 2 else ids)[: args.prompt_len]
    if prompt.size < 1:
        raise ConfigError(f"--tokens {args.tokens}: the first row is empty")
    if int(prompt.min()) < 0:
        raise ConfigError(f"--tokens {args.tokens}: token id {int(prompt.min())} is negative")
    return g, np.asarray(prompt, dtype=np.int64)


def run_info(args) -> int:
    from ..llama.geometry import read_geometry

    g = read_geometry(args.model, "MODEL")
    rec = g.summary()
    if args.experts:
        rec["experts"] = [{"layer": lid, "expert": e, "ranges": g.expert_ranges(lid, e)}
                          for lid in g.moe_layers for e in range(g.num_experts)]
    if args.json:
        emit_json([rec])
        return 0
    print(f"{g.path}: {g.architecture}, {len(g.moe_layers)} MoE layers of E={g.num_experts}, k={g.top_k}; "
          f"expert {g.expert_bytes} bytes ({', '.join(rec['expert_types'])}), expert tensors "
          f"{g.expert_tensor_bytes} of {g.file_bytes} bytes")
    if args.experts:
        table([(x["layer"], x["expert"], *(f"{o}+{n}" for o, n in x["ranges"])) for x in rec["experts"]],
              ["layer", "expert", "gate", "up", "down"])
    return 0


def run_run(args) -> int:
    from ..llama.runner import calibrate, check_managed, run_one

    g, prompt = _setup(args)
    if args.mode == "managed":
        check_managed(g, args.memory_wall, args.policy)
    cal = {"headroom_bytes": None, "ballast_bytes": 0, "note": None}
    if args.memory_wall is not None:
        cal = calibrate(g, prompt, threads=args.threads, wall=args.wall, max_new_tokens=args.max_new_tokens,
                        mode=args.mode, policy=args.policy)
        if args.headroom is not None:
            cal.update(headroom_bytes=args.headroom, note="headroom given; " + cal["note"])
    rec = run_one(g, prompt, args.max_new_tokens, args.mode, wall_bytes=args.memory_wall, wall=args.wall,
                  headroom_bytes=cal["headroom_bytes"], threads=args.threads, timeout=args.timeout,
                  ballast_bytes=cal["ballast_bytes"], policy=args.policy)
    rec["headroom_note"] = cal["note"]
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
    from ..llama.sweep import parse_walls, plot_sweep, sweep

    check_out(args.plot, "--plot")
    if args.plot:
        from ..report.plots import plot_format
        plot_format(args.plot)
    g, prompt = _setup(args)
    walls = parse_walls(args.walls, g)
    modes = list(dict.fromkeys(args.modes or ["mmap", "advise"]))

    def progress(i, n, rec):
        if not args.json:
            what = f"failed: {rec['error']}" if rec.get("error") else f"{rec['decode_tokens_per_s']:.3g} tok/s"
            print(f"[{i}/{n}] {rec['mode']} wall {rec['memory_wall']}: {what}", file=sys.stderr)

    res = sweep(g, prompt, args.max_new_tokens, modes, walls, runs=args.runs, seed=args.seed, wall=args.wall,
                headroom_bytes=args.headroom, threads=args.threads, target=args.target_tokens_per_s,
                timeout=args.timeout, progress=progress, policy=args.policy)
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


def run_capture(args) -> int:
    """``expertcache capture --model MODEL.gguf``: the router trace from llama.cpp (teacher-forced, or
    the decode steps with ``--generate N``)."""
    from ..llama.capture import capture_gguf

    unsupported = [opt for opt, on in (("--text", args.text), ("--router-probs", args.router_probs),
                                       ("--record", args.record), ("--layers", args.layers),
                                       ("--device", args.device)) if on]
    if unsupported:
        raise ConfigError(f"{unsupported[0]}: not supported with a .gguf model (llama.cpp capture records the "
                          "experts and gate weights of every MoE layer from --tokens)")
    trace = capture_gguf(args.model, _read_tokens(args.tokens), max_len=args.max_len,
                         max_sequences=args.max_sequences, generate=args.generate or 0)
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
