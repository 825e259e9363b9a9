"""The measured process: ``python -m expertcache.tier.worker SPEC.json`` -> one JSON object on stdout.

It is what runs inside the capacity wall (:func:`expertcache.wall.capacity.run_walled`), following
the tiering paper's Algorithm 1 in one process (warm-up and measurement share one scope):

1. open the pool (manifest and sizes checked) and the trace;
2. cold start: ``posix_fadvise(DONTNEED)`` on every pool file, residency checked with mincore;
3. arena / hybrid: lock the arena (mlock; failure stops the run: exit 3, one line on stderr),
   preload it;
4. the warm pass (same mode, same advice);
5. accounting snapshot at loop entry; the measured pass; snapshot at loop exit -- preload and
   warm-up are outside the measured interval;
6. print the result.

SPEC keys: ``pool``, ``trace`` (paths); ``mode``; ``capacity_bytes``; ``threads``; ``mmap``;
``arena_fraction`` (hybrid); ``profile_fraction`` or ``profile`` (a trace path); ``advice``
(``oracle`` / ``plan:PATH`` / null); ``delivery``; ``verify_reads``; ``cold_start``;
``drop_caches`` (also drop the machine's page cache before the cold start: root, system-wide);
``drop_ipc_lock`` (tests: drop CAP_IPC_LOCK first, so RLIMIT_MEMLOCK binds even for root);
``calibrate`` (open, lock and preload the arena in arena/hybrid modes, allocate, read one access
group per thread, post one hint, then stop and report ``calibration.own_bytes``: what the wall's
cgroup is charged for beyond the tier (anonymous and kernel memory), read by the worker itself;
the harness sizes the wall's headroom from it, per mode).
Exit status: 0 ok, 2 a user error, 3 mlock failed (fail-stop).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from .._text import id_ranges
from ..errors import ConfigError
from ..trace import load_trace
from ..wall.cgroupwall import worker_main
from ..wall.pagecache import evict_file_pages
from ..wall.procfs import vmlck_bytes
from .advice import Advisor, load_plan, parse_advice
from .arena import Arena, MlockError, drop_ipc_lock, top_experts
from .loop import Replayer, iteration_starts
from .pool import open_pool
from .readers import MODES, FileReader


def accounting():
    """The accounting module, or a ConfigError saying it is missing."""
    try:
        from ..wall import accounting as acc
    except ImportError as exc:  # pragma: no cover - only while the module is being written
        raise ConfigError(f"expertcache.wall.accounting is not available ({exc})") from None
    return acc


def check_trace_fits(trace, pool) -> None:
    """The trace's layers and expert ids must exist in the pool (one line otherwise)."""
    if trace.num_layers != pool.num_layers:
        raise ConfigError(f"trace {trace.source} has {trace.num_layers} layers, pool {pool.root} has {pool.num_layers}")
    ids = [int(x) for x in pool.manifest.get("layers") or []]
    if ids and ids != list(trace.layer_ids):  # matched by position, layer 3 had read layer 1's bytes
        raise ConfigError(f"trace {trace.source} has layer ids {id_ranges(trace.layer_ids)}, pool {pool.root} "
                          f"holds layers {id_ranges(ids)}: write the pool from this trace's layers")
    if trace.num_experts > pool.num_experts:
        raise ConfigError(f"trace {trace.source} has {trace.num_experts} experts per layer, pool {pool.root} has {pool.num_experts}")


def check_profile(path: str, trace, pool):
    """The ``--profile`` trace, checked against the replayed trace (layers) and the pool (expert ids)."""
    prof = load_trace(path)
    if prof.num_layers != trace.num_layers:
        raise ConfigError(f"--profile {path}: {prof.num_layers} layers, the trace has {trace.num_layers}")
    top = int(prof.experts.max()) if prof.experts.size else -1
    if top >= pool.num_experts:
        raise ConfigError(f"--profile {path}: expert id {top} is outside the pool {pool.root}'s "
                          f"{pool.num_experts} experts per layer")
    return prof


def arena_choice(spec: dict, trace, budget: int, pool) -> tuple[list, str]:
    """The experts the arena preloads and a label of the profile window they come from."""
    count = int(budget // pool.expert_bytes)
    if spec.get("profile"):
        prof = check_profile(spec["profile"], trace, pool)
        return top_experts(prof.experts, pool.num_experts, count), f"profile {spec['profile']}"
    frac = float(spec.get("profile_fraction", 0.6))
    rows = max(1, int(np.floor(frac * trace.num_tokens)))
    return top_experts(trace.experts[:rows], trace.num_experts, count), f"first {rows} of {trace.num_tokens} rows"


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches() -> str:
    """``sync`` then drop the whole machine's clean page cache, dentries and inodes (root only;
    asked for with ``--drop-caches``). A refusal is a ConfigError: the cold start was requested."""
    os.sync()
    try:
        with open(DROP_CACHES, "w", encoding="ascii") as fh:
            fh.write("3\n")
    except OSError as exc:
        raise ConfigError(f"--drop-caches: {DROP_CACHES}: {exc.strerror or exc} (it needs root)") from None
    return "sync; echo 3 > " + DROP_CACHES


def run(spec: dict) -> dict:
    mode = spec.get("mode", "pagecache")
    if mode not in MODES:
        raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    if spec.get("drop_ipc_lock"):
        drop_ipc_lock()
    acc = accounting()
    pool = open_pool(spec["pool"])
    trace = load_trace(spec["trace"])
    check_trace_fits(trace, pool)
    experts = trace.experts.astype(np.int64)
    starts = iteration_starts(trace.seq, trace.extras.get("iteration"))
    capacity = int(spec["capacity_bytes"])
    paths = pool.paths
    out = {"mode": mode, "capacity_bytes": capacity, "threads": int(spec.get("threads", 1)),
           "expert_bytes": pool.expert_bytes, "pool_bytes": pool.total_bytes, "layout": pool.layout}

    dropped = drop_caches() if spec.get("drop_caches") and spec.get("cold_start", True) else None
    out["cold_start"] = evict_file_pages(paths) if spec.get("cold_start", True) else None
    if out["cold_start"] is not None:
        out["cold_start"]["drop_caches"] = dropped
    # arena: user space owns the cache, the rest is streamed with direct I/O, nothing cached (the
    # incumbent design); hybrid: the arena's share pinned, the rest of the capacity the page cache's
    kind = {"nocache": "nocache", "direct": "direct", "arena": "direct"}.get(mode, "pagecache")
    reader = FileReader(pool, kind, use_mmap=bool(spec.get("mmap")))
    out["mode_used"] = reader.kind if mode in ("pagecache", "nocache", "direct") else mode
    out["mode_note"] = reader.fallback
    t0 = time.perf_counter()
    arena, out["arena"] = _preload_arena(spec, mode, trace, capacity, pool, acc)
    out["preload_seconds"] = time.perf_counter() - t0

    kind_src, plan_path = parse_advice(spec.get("advice"))
    hints = None
    if kind_src == "oracle":
        hints = experts
    elif kind_src == "plan":
        hints = load_plan(plan_path, experts.shape, pool.num_experts)
    skip = (lambda key: key in arena.slots) if arena is not None else None

    rep = Replayer(pool, reader, threads=int(spec.get("threads", 1)), arena=arena, verify=bool(spec.get("verify_reads")),
                   widest=experts.shape[2])
    if spec.get("calibrate"):
        return out | _calibrate(spec, pool, experts, rep, reader, arena, hints, skip)
    if spec.get("follow_flag"):  # set up: the wall may follow this process's own memory now
        from ..wall.capacity import begin_following

        begin_following(spec["follow_flag"])
    try:
        advisor = Advisor(pool, spec.get("delivery", "fadvise"), skip) if hints is not None else None
        warm = rep.run_pass(experts, starts, advisor=advisor, hints=hints)
        if advisor is not None:
            advisor.close()
            advisor = Advisor(pool, spec.get("delivery", "fadvise"), skip)
        pre = acc.snapshot(paths)
        measured = rep.run_pass(experts, starts, advisor=advisor, hints=hints)
        post = acc.snapshot(paths)
        out["advice"] = advisor.close() if advisor is not None else None
    finally:
        rep.close()
        reader.close()
    out["own_bytes_end"] = _own_bytes()[0]
    if arena is not None:
        out["arena"]["vmlck_bytes_after"] = vmlck_bytes()
        arena.close()
    out["accounting"] = acc.delta(pre, post)
    return out | _summary(out["accounting"], measured, warm, trace)


def _preload_arena(spec: dict, mode: str, trace, capacity: int, pool, acc):
    """``(arena, its record)`` for the arena and hybrid modes (the arena's share of ``capacity``,
    chosen from the trace's profile and preloaded); ``(None, None)`` for the others."""
    if mode not in ("arena", "hybrid"):
        return None, None
    share = 1.0 if mode == "arena" else float(spec.get("arena_fraction", 0.5))
    budget = int(capacity * share)
    chosen, window = arena_choice(spec, trace, budget, pool)
    arena = Arena(pool, budget, chosen)
    arena.preload()
    return arena, {"budget_bytes": budget, "entries": len(arena.slots), "bytes": arena.bytes,
                   "locked_bytes": arena.locked_bytes, "profile_window": window,
                   "preload_note": arena.preload_note, "vmlck_bytes": vmlck_bytes()}


def _summary(a: dict, measured, warm, trace) -> dict:
    """The record's counts and timings of the measured pass (``warm``: the pass before it) and the
    accounting ``a`` it read."""
    out = {}
    secs = measured.seconds
    out.update({
        "iterations": len(secs), "accesses": measured.accesses, "bytes_read": measured.bytes_read,
        "bytes_from_arena": measured.bytes_from_arena, "bytes_from_files": measured.bytes_from_files,
        "seconds_measured": measured.wall_seconds, "seconds_warm": warm.wall_seconds,
        "seconds_per_iteration_run_median": statistics.median(secs) if secs else None,
        "seconds_per_iteration_min": min(secs) if secs else None,
        "seconds_per_iteration_max": max(secs) if secs else None,
        "verified_reads": measured.verified_reads + warm.verified_reads,
        "verify_mismatches": measured.verify_mismatches + warm.verify_mismatches,
        "first_mismatch": measured.first_mismatch or warm.first_mismatch,
        "device_read_bytes": a.get("device_read_bytes"),
        "device_read_note": a.get("device_read_note"),
    })
    out.update({k: a.get(k) for k in ("read_bytes_self", "read_bytes_self_note", "device_other_readers",
                                      "device_other_bytes", "reclaim_scan_per_steal", "pgscan_total", "pgsteal_total")})
    memcg = a.get("memcg") or {}
    out["memcg_reclaim_scan_per_steal"] = memcg.get("reclaim_scan_per_steal")
    out["memcg_pressure"] = memcg.get("pressure")
    accepted = trace.extras.get("accepted")
    if accepted is not None:
        out["accepted_tokens"] = int(np.sum(accepted))
    return out


def _calibrate(spec, pool, experts, rep, reader, arena, hints, skip) -> dict:
    """Headroom calibration: everything a pass holds (the arena locked and preloaded, the buffers,
    the advisor), one access group per thread and one hint, no pass; then what the cgroup is charged
    for beyond the tier, read here (kernel memory included)."""
    advisor = Advisor(pool, spec.get("delivery", "fadvise"), skip) if hints is not None else None
    try:
        rows = experts[: max(1, rep.threads)]
        rep.run_pass(rows, np.arange(rows.shape[0] + 1), advisor=advisor, hints=hints)
    finally:
        if advisor is not None:
            advisor.close()
        rep.close()
        reader.close()
    own, note = _own_bytes()
    if arena is not None:
        arena.close()
    return {"calibrate": True, "calibration": {"own_bytes": own, "note": note}}


def _own_bytes() -> tuple[int | None, str | None]:
    """What this process's memory cgroup is charged for beyond the tier, now (None where unreadable)."""
    from ..wall import cgroupfs
    loc, why = cgroupfs.locate_memory_cgroup()
    return cgroupfs.own_bytes(loc["dir"], loc["version"]) if loc else (None, why)


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, run, "expertcache.tier.worker", exit_codes=((MlockError, 3),), default=_jsonable)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON-able: {type(x).__name__}")


if __name__ == "__main__":
    sys.exit(main())
