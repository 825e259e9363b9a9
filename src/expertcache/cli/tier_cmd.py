"""``expertcache tier``: file-backed expert pools -- write, replay, sweep (and ``plan``), docs/tier.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._units import parse_byte_range
from ..errors import ConfigError
from .common import (TIMEOUT_SECONDS, add_json, add_subcommands, byte_size, emit_json, float_in, open_trace,
                     positive_int, seed_int, table)

HELP = """File-backed expert tier (the tiering paper's harness): write an expert pool to files, replay a
trace against it through the page cache, without it, with O_DIRECT, from a locked arena or a hybrid,
under an enforced memory capacity, and measure the capacity response T(C). See docs/tier.md."""

MODES = ("pagecache", "nocache", "direct", "arena", "hybrid")
WALLS = ("auto", "cgroup", "balloon", "none")


_unit_fraction = float_in(0, 1, lo_open=True)


def add_parser(sub) -> None:
    p = sub.add_parser("tier", help="file-backed expert pools: write, replay, sweep, plan", description=HELP)
    tsub = add_subcommands(p, "tier_command")
    _add_write(tsub)
    _add_replay(tsub)
    _add_sweep(tsub)
    try:
        from .tier_plan import add_plan_parser
    except ImportError:  # pragma: no cover - only while tier_plan is being written
        add_plan_parser = None
    if add_plan_parser is not None:
        add_plan_parser(tsub)


# ------------------------------------------------------------------------------------ write
def _add_write(tsub) -> None:
    p = tsub.add_parser("write", help="write an expert pool (files or packed) with a checksummed manifest",
                        description="Write an expert pool: one file per (layer, expert) or one packed file, and "
                                    "manifest.json with sizes and blake2b checksums. --from-trace writes deterministic "
                                    "pseudo-random bytes sized --expert-mb for the trace's layers and experts; "
                                    "--from-safetensors copies a checkpoint's real expert tensors.")
    p.add_argument("--pool", required=True, metavar="DIR", help="pool folder (created if missing)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-trace", metavar="TRACE", help="trace whose layers and experts the pool holds")
    src.add_argument("--from-safetensors", metavar="MODEL_DIR", help="checkpoint folder with *.safetensors")
    p.add_argument("--expert-mb", type=float, metavar="MB", help="bytes per expert in MB (1 MB = 1e6 bytes); --from-trace only")
    p.add_argument("--layout", choices=("files", "packed"), default="files", help="one file per expert (default) or one packed file")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the pseudo-random bytes (default 0)")
    p.add_argument("--force", action="store_true", help="rewrite a folder that already holds a pool (or other files)")
    add_json(p)
    p.set_defaults(func=run_write)


def run_write(args) -> int:
    from ..tier.checkpoint import expert_reader, expert_tensors
    from ..tier.pool import check_pool_target, pool_from_trace, write_pool
    progress = _progress("writing") if not args.json else None
    if args.from_trace:
        if args.expert_mb is None or not (args.expert_mb > 0) or args.expert_mb > 1e5:
            raise ConfigError("--expert-mb: give the expert size in MB (a number in (0, 100000]) with --from-trace")
        check_pool_target(Path(args.pool), args.force, [args.from_trace])
        trace = open_trace(args.from_trace)
        pool = pool_from_trace(args.pool, trace, expert_bytes=int(round(args.expert_mb * 1e6)), layout=args.layout,
                               seed=args.seed, progress=progress, force=args.force, inputs=[args.from_trace])
    else:
        if args.expert_mb is not None:
            raise ConfigError("--expert-mb: not used with --from-safetensors (the checkpoint's tensors set the size)")
        check_pool_target(Path(args.pool), args.force, [args.from_safetensors])
        layers, E, index, dtype = expert_tensors(args.from_safetensors)
        inputs = [args.from_safetensors, *sorted({f for parts in index.values() for f, _, _ in parts})]
        source = expert_reader(index, layers)
        try:
            pool = write_pool(args.pool, layers=layers, num_experts=E, source=source, layout=args.layout,
                              dtype=dtype, description=f"safetensors: {args.from_safetensors}", progress=progress,
                              force=args.force, inputs=inputs)
        finally:
            source.close()
    rec = {"pool": str(pool.root), "layout": pool.layout, "layers": pool.manifest["layers"],
           "num_experts": pool.num_experts, "expert_bytes": pool.expert_bytes, "dtype": pool.manifest["dtype"],
           "files": len(pool.manifest["files"]), "pool_bytes": pool.total_bytes, "source": pool.manifest["source"]}
    if args.json:
        emit_json([rec])
    else:
        print(f"pool {rec['pool']}: {len(rec['layers'])} layers x {rec['num_experts']} experts of {rec['expert_bytes']:,} bytes "
              f"({rec['dtype']}), {rec['files']} file(s), {rec['pool_bytes'] / 1e6:,.1f} MB, layout {rec['layout']}")
    return 0


def _progress(what: str):
    """A ``show(done, total)`` callback advancing one tqdm bar (:mod:`expertcache._progress`)."""
    from .._progress import progress
    state = {"bar": None, "done": 0}

    def show(done: int, total: int) -> None:
        if state["bar"] is None:
            state["bar"] = progress(total=total, desc=f"{what} experts")
        state["bar"].update(done - state["done"])
        state["done"] = done
        if done >= total:
            state["bar"].close()
    return show


# ------------------------------------------------------------------------------------ replay / sweep
MAX_THREADS = 1024
"""Most reader threads per access group (more never helps: a group splits into at most k chunks)."""


def _threads(text: str) -> int:
    n = positive_int(text)
    if n > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{n} is more than {MAX_THREADS} reader threads")
    return n


def _add_common(p, *, runs: int) -> None:
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    p.add_argument("--pool", required=True, metavar="DIR", help="pool written by 'expertcache tier write'")
    p.add_argument("--mode", action="append", dest="modes", choices=MODES, metavar="MODE",
                   help=f"repeatable; one of {', '.join(MODES)} (default pagecache)")
    p.add_argument("--threads", type=_threads, default=4, help=f"reader threads per layer (default 4, at most {MAX_THREADS})")
    p.add_argument("--repeats", "--runs", type=positive_int, default=runs, dest="runs", metavar="N",
                   help=f"runs per (mode, capacity), interleaved: each run visits every cell once; the median and "
                        f"spread over them are reported, and a lead inside the spread is a tie (default {runs}; "
                        "--runs is the same option)")
    p.add_argument("--mmap", action="store_true", help="pagecache/hybrid: read through mmap instead of pread")
    p.add_argument("--arena-fraction", type=_unit_fraction, default=None, metavar="F",
                   help="hybrid: share of the capacity given to the locked arena (default 0.5)")
    p.add_argument("--profile-fraction", type=_unit_fraction, default=None, metavar="F",
                   help="arena/hybrid: the arena holds the top experts of this first share of the trace (default 0.6)")
    p.add_argument("--profile", metavar="TRACE", help="arena/hybrid: rank experts on this trace instead")
    p.add_argument("--advice", metavar="SRC", help="hint the next layer's experts: 'oracle' or 'plan:PLAN.npz'")
    p.add_argument("--delivery", choices=("fadvise", "pread"), default=None,
                   help="with --advice: how hints are delivered, posix_fadvise(WILLNEED) (default) or a blocking pread")
    p.add_argument("--wall", choices=WALLS, default="auto",
                   help="what enforces the capacity: a memory cgroup, a locked balloon (only when asked), none "
                        "(default auto: a cgroup wall, else none, said in the notes)")
    p.add_argument("--cgroup", metavar="PATH", help="use this existing memory cgroup as it is (its limit is recorded)")
    p.add_argument("--headroom", type=byte_size("--headroom"), default=None, metavar="SIZE",
                   help="memory above the capacity for the measured process itself (default: measured per mode by a "
                        "calibration run behind a cgroup wall, the worker's own memory + 4 MB; 64 MB without a cgroup)")
    p.add_argument("--timeout", type=TIMEOUT_SECONDS, default=None, metavar="S",
                   help="kill a run after S seconds (0.001 to 1e6)")
    p.add_argument("--verify", action="store_true", help="hash every pool entry against the manifest before replaying")
    p.add_argument("--verify-reads", action="store_true",
                   help="hash every byte read and count mismatches (exit status 1 when any read differs)")
    p.add_argument("--drop-caches", action="store_true",
                   help="also drop the whole machine's clean page cache before each run (sync; echo 3 > "
                        "/proc/sys/vm/drop_caches; root only, system-wide: only when asked)")
    p.add_argument("--out", metavar="FILE.jsonl", help="also write every run record here as each run finishes "
                   "(atomically rewritten: finished runs are never lost, failed ones are marked)")
    p.add_argument("--force", action="store_true", help="with --out: replace an existing file")
    add_json(p)


def check_options(args) -> None:
    """Refuse (one line) options that conflict or have no effect with the modes asked."""
    modes = args.modes or ["pagecache"]
    dup = sorted({m for m in modes if modes.count(m) > 1})
    if dup:
        raise ConfigError(f"--mode {dup[0]}: given twice")
    if args.delivery is not None and args.advice is None:
        raise ConfigError(f"--delivery {args.delivery}: has no effect without --advice")
    if args.mmap and set(modes) - {"pagecache", "hybrid"}:
        other = sorted(set(modes) - {"pagecache", "hybrid"})[0]
        raise ConfigError(f"--mmap: --mode {other} does not read through the page cache; --mmap applies to pagecache "
                          "and hybrid only")
    if args.profile is not None and args.profile_fraction is not None:
        raise ConfigError("--profile-fraction: has no effect with --profile (the arena ranks the --profile trace)")
    arena = {"arena", "hybrid"} & set(modes)
    for opt, given in (("--profile", args.profile), ("--profile-fraction", args.profile_fraction)):
        if given is not None and not arena:
            raise ConfigError(f"{opt}: has no effect without --mode arena or --mode hybrid")
    if args.arena_fraction is not None and "hybrid" not in modes:
        raise ConfigError("--arena-fraction: has no effect without --mode hybrid")
    if args.headroom is not None and args.wall == "none":
        raise ConfigError("--headroom: has no effect with --wall none (nothing is enforced)")
    if args.out is not None:
        from .._io import check_writable
        check_writable(args.out, "--out")
        if Path(args.out).exists() and not args.force:
            raise ConfigError(f"--out {args.out}: exists; pass --force to replace it")


def _add_replay(tsub) -> None:
    p = tsub.add_parser("replay", help="replay a trace against a pool at one capacity (real reads)",
                        description="Replay a trace against an expert pool, every access a real read, under an "
                                    "enforced capacity; one record per (mode, capacity, run). Fields: docs/tier.md.")
    _add_common(p, runs=1)
    p.add_argument("--capacity", "-c", type=byte_size("--capacity"), required=True, metavar="SIZE",
                   help="memory the tier may use, e.g. 2GB (1 GB = 1e9 bytes)")
    p.set_defaults(func=run_replay)


def _add_sweep(tsub) -> None:
    p = tsub.add_parser("sweep", help="capacity response T(C): seconds and device bytes per iteration against capacity",
                        description="Replay at several capacities, each run in its own seeded random capacity order; "
                                    "prints the median over runs per (mode, capacity) with the inverse-capacity "
                                    "reference rail ref(C) = dev(Cmax) * Cmax / C. Progress on stderr.")
    _add_common(p, runs=3)
    p.add_argument("--capacities", required=True, metavar="SIZES",
                   help="comma list or range of sizes, e.g. 0.5GB,1GB,2GB,4GB or 0.5GB:4GB:x2")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the capacity orders (default 0)")
    p.add_argument("--plot", metavar="PNG", help="write the T(C) plot here: .png, .pdf or .svg (needs matplotlib)")
    p.set_defaults(func=run_sweep)


def _prepare(args):
    from ..tier.advice import load_plan, parse_advice
    from ..tier.harness import CellOptions, DemandCache
    from ..tier.pool import open_pool
    from ..tier.worker import check_profile, check_trace_fits
    check_options(args)
    trace = open_trace(args.trace)
    pool = open_pool(args.pool, verify=args.verify)
    check_trace_fits(trace, pool)
    if args.profile is not None:
        check_profile(args.profile, trace, pool)
    kind, plan = parse_advice(args.advice)
    hints = trace.experts if kind == "oracle" else load_plan(plan, trace.experts.shape, pool.num_experts) if kind else None
    opts = CellOptions(trace_path=args.trace, pool_path=args.pool, threads=args.threads, mmap=args.mmap,
                       arena_fraction=0.5 if args.arena_fraction is None else args.arena_fraction,
                       profile_fraction=0.6 if args.profile_fraction is None else args.profile_fraction,
                       profile=args.profile, advice=args.advice, delivery=args.delivery or "fadvise",
                       verify_reads=args.verify_reads, wall=args.wall, cgroup=args.cgroup,
                       headroom_bytes=args.headroom, timeout=args.timeout, drop_caches=args.drop_caches)
    return trace, pool, opts, DemandCache(trace, pool.expert_bytes, hints)


def _reclaim():
    try:
        from ..wall.accounting import reclaim_setup
    except ImportError as exc:  # pragma: no cover
        return {"note": f"accounting unavailable ({exc})"}
    return reclaim_setup()


def _keeper(args):
    """``keep(records)`` rewriting ``--out`` atomically with every record so far (None without --out)."""
    if args.out is None:
        return None
    from .._io import atomic_open

    def keep(records: list[dict]) -> None:
        with atomic_open(args.out, "w", option="--out", encoding="utf-8") as fh:
            emit_json(records, fh)
    return keep


def _run_cells(args, capacities: list[int], order=None):
    from ..tier.harness import replay_cells
    trace, pool, opts, demand = _prepare(args)
    keep = _keeper(args)
    quiet = args.json and order is None
    records = replay_cells(opts, args.modes or ["pagecache"], capacities, args.runs, demand, order=order,
                           progress=None if quiet else _cell_progress, keep=keep)
    reclaim = _reclaim()
    for r in records:
        r.update(trace=trace.name, pool=str(pool.root), reclaim_setup=reclaim)
    return trace, pool, records, keep


def _status(records: list[dict]) -> int:
    """Exit status after the results are out: 1 (with one line on stderr) when a run failed or a
    verified read did not match the manifest, else 0."""
    failed = [r for r in records if r.get("failed")]
    bad = sum(r.get("verify_mismatches") or 0 for r in records)
    if failed:
        print(f"error: {len(failed)} of {len(records)} runs failed (marked 'failed'); first: {failed[0]['error']}",
              file=sys.stderr)
    if bad:
        first = next(r["first_mismatch"] for r in records if r.get("verify_mismatches"))
        print(f"error: {bad} read(s) did not match the pool's manifest (first at {first})", file=sys.stderr)
    return 1 if failed or bad else 0


def run_replay(args) -> int:
    from ..tier.sweep import comparisons, summarize
    trace, pool, records, keep = _run_cells(args, [args.capacity])
    if keep:
        keep(records)
    if args.json:
        emit_json(records)
    else:
        _print_runs(records, trace, pool)
        _print_comparisons(comparisons(summarize(records)))
    return _status(records)


def run_sweep(args) -> int:
    from ..tier.sweep import comparisons, plot, shuffled_order, summarize
    from .common import check_plot
    caps = parse_byte_range(args.capacities, "--capacities")
    check_plot(args.plot)
    trace, pool, records, keep = _run_cells(args, caps, order=shuffled_order(args.seed))
    summary = summarize(records)
    if keep:
        keep(records + summary)
    if args.json:
        emit_json(records + summary)
    else:
        print(f"trace {trace.name}: {next((r['iterations'] for r in records if r.get('iterations')), 0)} iterations; "
              f"pool {pool.root}: {pool.total_bytes / 1e9:.3f} GB, experts of {pool.expert_bytes / 1e6:g} MB")
        rows = [(s["mode"], s["capacity_bytes"] / 1e9, s["runs"] - s["runs_failed"], s["seconds_per_iteration_median"],
                 s["seconds_per_iteration_spread"], _mb(s["read_bytes_self_per_iteration_median"]),
                 _mb(s["device_read_bytes_per_iteration_median"]), _mb(s["reference_bytes_per_iteration"]),
                 _mb(s["demand_miss_bytes_per_iteration"]), s["amplification_median"],
                 ",".join(s["capacity_enforced_by"]).split(":")[0], s["proof_ok"]) for s in summary]
        table(rows, ["mode", "C GB", "runs ok", "s/iter", "spread", "own MB/iter", "dev MB/iter", "ref MB/iter",
                     "demand MB/iter", "amplif.", "enforced by", "proof ok"])
        _print_comparisons(comparisons(summary))
    if args.plot:
        plot(summary, args.plot, title=f"T(C): {trace.name}")
        if not args.json:
            print(f"plot: {args.plot}")
    return _status(records)


def _mb(x):
    return None if x is None else x / 1e6


def _cell_progress(done: int, total: int, rec: dict) -> None:
    if rec.get("failed"):
        if total == 1:
            return  # the error itself is the one line
        print(f"[{done}/{total}] {rec['mode']} C={rec['capacity_bytes'] / 1e9:g}GB run {rec['run']}: FAILED: "
              f"{rec['error']}", file=sys.stderr)
        return
    own = rec.get("read_bytes_self")
    print(f"[{done}/{total}] {rec['mode']} C={rec['capacity_bytes'] / 1e9:g}GB run {rec['run']}: "
          f"{(rec.get('seconds_per_iteration_median') or 0) * 1e3:.2f} ms/iter, read "
          f"{'-' if own is None else f'{own / 1e6:,.1f} MB'}, {rec.get('capacity_enforced_by')}", file=sys.stderr)


def _print_comparisons(rows: list[dict]) -> None:
    for c in rows:
        lead = "" if c["lead"] is None else f" (lead {c['lead']:.1%})"
        print(f"at C={c['capacity_bytes'] / 1e9:g} GB, {c['modes'][0]} vs {c['modes'][1]}: {c['verdict']}{lead}")


def _print_runs(records: list[dict], trace, pool) -> None:
    ok = [r for r in records if not r.get("failed")]
    first = ok[0] if ok else {}
    print(f"trace {trace.name}: {first.get('iterations')} iterations, {first.get('accesses')} accesses per pass; "
          f"pool {pool.root}: {pool.total_bytes / 1e9:.3f} GB")
    rows = [(r["mode"] + ("" if r.get("mode_used") in (None, r["mode"]) else f"->{r['mode_used']}"),
             r["capacity_bytes"] / 1e9, r["run"], r["seconds_per_iteration_median"], r["seconds_per_iteration_spread"],
             _mb(r["bytes_read"]), _mb(r["bytes_from_arena"]), _mb(r["read_bytes_self"]), _mb(r["device_read_bytes"]),
             _mb(r["demand_miss_bytes"]), r["amplification"], str(r["capacity_enforced_by"]).split(":")[0],
             r["proof_ok"], r.get("verify_mismatches") if r.get("verified_reads") else None) for r in ok]
    table(rows, ["mode", "C GB", "run", "s/iter", "spread", "read MB", "arena MB", "own MB", "device MB", "demand MB",
                 "amplif.", "enforced by", "proof ok", "verify mismatches"])
    for r in records:
        if r.get("failed"):
            print(f"FAILED: --mode {r['mode']} run {r['run']}: {r['error']}")
    notes = {r["mode_note"] for r in ok if r.get("mode_note")} | {r["device_read_note"] for r in ok if r.get("device_read_note")}
    notes |= {r["wall_note"] for r in ok if r.get("wall_note")}
    for n in sorted(notes):
        print(f"note: {n}")
    for r in ok:
        if r.get("advice"):
            a = r["advice"]
            print(f"advice ({r['mode']} run {r['run']}): submitted {a['submitted']} = overwritten {a['overwritten']} + "
                  f"completed {a['completed']} + pending {a['pending']}; addressable misses "
                  f"{r.get('advice_addressable_misses')} of {r.get('demand_misses')}")
