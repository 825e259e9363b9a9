"""``expertcache tier``: file-backed expert pools -- write, replay, sweep (and ``plan``), docs/tier.md."""

from __future__ import annotations

import argparse
import sys

from .._units import parse_byte_range, parse_bytes
from ..errors import ConfigError
from .common import add_json, add_subcommands, emit_json, open_trace, positive_int, seed_int, table

HELP = """File-backed expert tier (the tiering paper's harness): write an expert pool to files, replay a
trace against it through the page cache, without it, with O_DIRECT, from a locked arena or a hybrid,
under an enforced memory capacity, and measure the capacity response T(C). See docs/tier.md."""

MODES = ("pagecache", "nocache", "direct", "arena", "hybrid")
WALLS = ("auto", "cgroup", "balloon", "none")


def _size(what: str):
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, what)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{what}: ")) from None
    return parse


def _unit_fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text[:40]!r}") from None
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]")
    return x


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
    add_json(p)
    p.set_defaults(func=run_write)


def run_write(args) -> int:
    from ..tier.checkpoint import expert_reader, expert_tensors
    from ..tier.pool import pool_from_trace, write_pool
    progress = _progress("writing") if not args.json else None
    if args.from_trace:
        if args.expert_mb is None or not (args.expert_mb > 0) or args.expert_mb > 1e5:
            raise ConfigError("--expert-mb: give the expert size in MB (a number in (0, 100000]) with --from-trace")
        trace = open_trace(args.from_trace)
        pool = pool_from_trace(args.pool, trace, expert_bytes=int(round(args.expert_mb * 1e6)), layout=args.layout,
                               seed=args.seed, progress=progress)
    else:
        if args.expert_mb is not None:
            raise ConfigError("--expert-mb: not used with --from-safetensors (the checkpoint's tensors set the size)")
        layers, E, index, dtype = expert_tensors(args.from_safetensors)
        source = expert_reader(index, layers)
        try:
            pool = write_pool(args.pool, layers=layers, num_experts=E, source=source, layout=args.layout,
                              dtype=dtype, description=f"safetensors: {args.from_safetensors}", progress=progress)
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
    state = {"last": -1}

    def show(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct != state["last"] and (pct % 10 == 0 or done == total):
            state["last"] = pct
            print(f"{what}: {done}/{total} experts ({pct}%)", file=sys.stderr)
    return show


# ------------------------------------------------------------------------------------ replay / sweep
def _add_common(p, *, runs: int) -> None:
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    p.add_argument("--pool", required=True, metavar="DIR", help="pool written by 'expertcache tier write'")
    p.add_argument("--mode", action="append", dest="modes", choices=MODES, metavar="MODE",
                   help=f"repeatable; one of {', '.join(MODES)} (default pagecache)")
    p.add_argument("--threads", type=positive_int, default=4, help="reader threads per layer (default 4)")
    p.add_argument("--runs", type=positive_int, default=runs, help=f"runs per (mode, capacity) (default {runs})")
    p.add_argument("--mmap", action="store_true", help="pagecache mode reads through mmap instead of pread")
    p.add_argument("--arena-fraction", type=_unit_fraction, default=0.5, metavar="F",
                   help="hybrid: share of the capacity given to the locked arena (default 0.5)")
    p.add_argument("--profile-fraction", type=_unit_fraction, default=0.6, metavar="F",
                   help="arena/hybrid: the arena holds the top experts of this first share of the trace (default 0.6)")
    p.add_argument("--profile", metavar="TRACE", help="arena/hybrid: rank experts on this trace instead")
    p.add_argument("--advice", metavar="SRC", help="hint the next layer's experts: 'oracle' or 'plan:PLAN.npz'")
    p.add_argument("--delivery", choices=("fadvise", "pread"), default="fadvise",
                   help="how hints are delivered: posix_fadvise(WILLNEED) (default) or a blocking pread")
    p.add_argument("--wall", choices=WALLS, default="auto",
                   help="what enforces the capacity: a child memory cgroup, a locked balloon, none (default auto)")
    p.add_argument("--cgroup", metavar="PATH", help="use this existing memory cgroup as it is (its limit is recorded)")
    p.add_argument("--headroom", type=_size("--headroom"), default=None, metavar="SIZE",
                   help="memory above the capacity for the measured process itself (default 256MB)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill a run after S seconds")
    p.add_argument("--verify", action="store_true", help="hash every pool entry against the manifest before replaying")
    p.add_argument("--verify-reads", action="store_true", help="hash every byte read and count mismatches")
    p.add_argument("--drop-caches", action="store_true",
                   help="also drop the whole machine's clean page cache before each run (sync; echo 3 > "
                        "/proc/sys/vm/drop_caches; root only, system-wide: only when asked)")
    add_json(p)


def _add_replay(tsub) -> None:
    p = tsub.add_parser("replay", help="replay a trace against a pool at one capacity (real reads)",
                        description="Replay a trace against an expert pool, every access a real read, under an "
                                    "enforced capacity; one record per (mode, capacity, run). Fields: docs/tier.md.")
    _add_common(p, runs=1)
    p.add_argument("--capacity", "-c", type=_size("--capacity"), required=True, metavar="SIZE",
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
    p.add_argument("--plot", metavar="PNG", help="write the T(C) plot here (needs matplotlib)")
    p.set_defaults(func=run_sweep)


def _prepare(args):
    from ..tier.advice import load_plan, parse_advice
    from ..tier.harness import CellOptions, DemandCache
    from ..tier.pool import open_pool
    from ..tier.worker import check_trace_fits
    trace = open_trace(args.trace)
    pool = open_pool(args.pool, verify=args.verify)
    check_trace_fits(trace, pool)
    kind, plan = parse_advice(args.advice)
    hints = trace.experts if kind == "oracle" else load_plan(plan, trace.experts.shape, pool.num_experts) if kind else None
    opts = CellOptions(trace_path=args.trace, pool_path=args.pool, threads=args.threads, mmap=args.mmap,
                       arena_fraction=args.arena_fraction, profile_fraction=args.profile_fraction,
                       profile=args.profile, advice=args.advice, delivery=args.delivery,
                       verify_reads=args.verify_reads, wall=args.wall, cgroup=args.cgroup,
                       headroom_bytes=args.headroom, timeout=args.timeout, drop_caches=args.drop_caches)
    return trace, pool, opts, DemandCache(trace, pool.expert_bytes, hints)


def _reclaim():
    try:
        from ..tier.accounting import reclaim_setup
    except ImportError as exc:  # pragma: no cover
        return {"note": f"accounting unavailable ({exc})"}
    return reclaim_setup()


def run_replay(args) -> int:
    from ..tier.harness import replay_cells
    trace, pool, opts, demand = _prepare(args)
    records = replay_cells(opts, args.modes or ["pagecache"], [args.capacity], args.runs, demand,
                           progress=None if args.json else _cell_progress)
    reclaim = _reclaim()
    for r in records:
        r.update(trace=trace.name, pool=str(pool.root), reclaim_setup=reclaim)
    if args.json:
        emit_json(records)
        return 0
    _print_runs(records, trace, pool)
    return 0


def run_sweep(args) -> int:
    from ..tier.harness import replay_cells
    from ..tier.sweep import plot, shuffled_order, summarize
    caps = parse_byte_range(args.capacities, "--capacities")
    trace, pool, opts, demand = _prepare(args)
    records = replay_cells(opts, args.modes or ["pagecache"], caps, args.runs, demand,
                           order=shuffled_order(args.seed), progress=_cell_progress)
    summary = summarize(records)
    if args.plot:
        plot(summary, args.plot, title=f"T(C): {trace.name}")
    reclaim = _reclaim()
    for r in records:
        r.update(trace=trace.name, pool=str(pool.root), reclaim_setup=reclaim)
    if args.json:
        emit_json(records + summary)
        return 0
    print(f"trace {trace.name}: {records[0]['iterations'] if records else 0} iterations; pool {pool.root}: "
          f"{pool.total_bytes / 1e9:.3f} GB, experts of {pool.expert_bytes / 1e6:g} MB")
    rows = [(s["mode"], s["capacity_bytes"] / 1e9, s["runs"], s["seconds_per_iteration_median"],
             s["seconds_per_iteration_spread"], _mb(s["device_read_bytes_per_iteration_median"]),
             _mb(s["reference_bytes_per_iteration"]), _mb(s["demand_miss_bytes_per_iteration"]),
             s["amplification_median"], ",".join(s["capacity_enforced_by"]).split(":")[0], s["proof_ok"])
            for s in summary]
    table(rows, ["mode", "C GB", "runs", "s/iter", "spread", "dev MB/iter", "ref MB/iter", "demand MB/iter",
                 "amplif.", "enforced by", "proof ok"])
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _mb(x):
    return None if x is None else x / 1e6


def _cell_progress(done: int, total: int, rec: dict) -> None:
    dev = rec.get("device_read_bytes")
    print(f"[{done}/{total}] {rec['mode']} C={rec['capacity_bytes'] / 1e9:g}GB run {rec['run']}: "
          f"{(rec.get('seconds_per_iteration_median') or 0) * 1e3:.2f} ms/iter, device "
          f"{'-' if dev is None else f'{dev / 1e6:,.1f} MB'}, {rec.get('capacity_enforced_by')}", file=sys.stderr)


def _print_runs(records: list[dict], trace, pool) -> None:
    print(f"trace {trace.name}: {records[0]['iterations']} iterations, {records[0]['accesses']} accesses per pass; "
          f"pool {pool.root}: {pool.total_bytes / 1e9:.3f} GB")
    rows = [(r["mode"] + ("" if r.get("mode_used") in (None, r["mode"]) else f"->{r['mode_used']}"),
             r["capacity_bytes"] / 1e9, r["run"], r["seconds_per_iteration_median"], r["seconds_per_iteration_spread"],
             _mb(r["bytes_read"]), _mb(r["bytes_from_arena"]), _mb(r["device_read_bytes"]), _mb(r["demand_miss_bytes"]),
             r["amplification"], str(r["capacity_enforced_by"]).split(":")[0], r["proof_ok"]) for r in records]
    table(rows, ["mode", "C GB", "run", "s/iter", "spread", "read MB", "arena MB", "device MB", "demand MB",
                 "amplif.", "enforced by", "proof ok"])
    notes = {r["mode_note"] for r in records if r.get("mode_note")} | {r["device_read_note"] for r in records if r.get("device_read_note")}
    notes |= {r["wall_note"] for r in records if r.get("wall_note")}
    for n in sorted(notes):
        print(f"note: {n}")
    for r in records:
        if r.get("advice"):
            a = r["advice"]
            print(f"advice ({r['mode']} run {r['run']}): submitted {a['submitted']} = overwritten {a['overwritten']} + "
                  f"completed {a['completed']} + pending {a['pending']}; addressable misses "
                  f"{r.get('advice_addressable_misses')} of {r.get('demand_misses')}")
