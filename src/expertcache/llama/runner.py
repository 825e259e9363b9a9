"""One measured llama.cpp run: greedy decode of a prompt in one page-cache mode, optionally behind
a memory wall (``expertcache llama run``; numbers defined in docs/llama.md).

The parent (:func:`run_one`) evicts the GGUF from the page cache (cgroup v1 charges a page to
whoever touched it first, so the measured process must be the first), then runs this module as a
child (``python -m expertcache.llama.runner SPEC.json``) through
:func:`expertcache.tier.capacity.run_walled` (``wall="none"`` without a wall: the same path,
marked unproven). The child (:func:`measure`) loads the engine, applies the mode
(:class:`~.advice.PageAdvisor`), prefills the prompt (one forward, last logits), decodes, and
prints one JSON line: timings, its own ``/proc/self/io`` ``read_bytes`` and major faults per
phase, the generated ids and the routing it computed (per forward and MoE layer, the experts).
The parent adds the wall's proof and the demand model (:func:`demand`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import resource
import sys
import time

import numpy as np

from ..errors import ConfigError, ExpertcacheError
from ..tier import accounting as acc, capacity as cap
from .advice import MODES, PageAdvisor, managed_budget, managed_item_bytes
from .capture import RoutingRecorder
from .geometry import Geometry, read_geometry

HEADROOM_MARGIN_FLOOR = 8 * 2**20
"""The least slack added to the calibrated own-memory peak of the llama worker; the margin is a
sixteenth of that peak where larger (:func:`headroom_margin`). The calibration decodes as many
tokens as the run it serves, so the margin covers allocator variation between runs only. It must
stay below the wall proof's slack (2% of the capacity + 4 MiB): page cache may grow into headroom
the worker does not use, and a larger margin fails the proof (a quarter of the peak, 17 MB, failed
it at a 480 MB wall)."""


FOLLOW_MARGIN = 8 * 2**20
"""The wall follows the llama worker's own memory once it has loaded and prefilled
(``tier.capacity.run_walled``'s ``follow_margin`` and ``follow_flag``): its own memory varies by
10-20 MB between runs of one model (kernel memory for the mapping's page tables and the page
cache's own nodes among it), more than the proof's slack, so a fixed headroom either lets page
cache grow into what the worker leaves unused or OOM-kills it. Before the flag (loading, when
llama.cpp allocates its buffers) the calibrated headroom holds."""
FOLLOW_MIN_CAPACITY = 64 * 2**20
"""Walls below this keep the fixed headroom: a page cache of a few MB cannot absorb a spike of the
worker's own memory, so a following limit would OOM-kill it (one did at 5 MB on models/small-moe)."""


def headroom_margin(own: int) -> int:
    """Slack above the calibrated own-memory peak ``own``: relative, with a floor."""
    return max(HEADROOM_MARGIN_FLOOR, own // 16)


def io_counters() -> dict:
    """This process's own ``read_bytes`` (/proc/self/io) and major faults (getrusage)."""
    out = {"read_bytes": None, "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k == "read_bytes":
                    out["read_bytes"] = int(v)
    except (OSError, ValueError):
        pass
    return out


def rss_anon() -> int | None:
    """This process's anonymous resident bytes (RssAnon of /proc/self/status)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ballast(n: int):
    """``n`` bytes of touched anonymous memory (an ``mmap``; ``close()`` returns it), or None."""
    if n <= 0:
        return None
    import mmap

    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: anonymous, not shmem (page cache)
    for off in range(0, n, mmap.PAGESIZE):
        m[off] = 1
    return m


def _diff(a: dict, b: dict) -> dict:
    return {k: (b[k] - a[k] if a[k] is not None and b[k] is not None else None) for k in a}


def measure(spec: dict) -> dict:
    """The child's run (see the module docstring)."""
    from .engine import Engine

    g = read_geometry(spec["model"])
    prompt = [int(x) for x in spec["prompt"]]
    n_new = int(spec["max_new_tokens"])
    mode = spec["mode"]
    # llama.cpp populates the mapping while loading, before its context's own memory exists: the
    # ballast stands in for that memory during the load, so the page cache never holds more than
    # it may while decoding (the wall's proof covers the whole run)
    anon0, held = rss_anon(), ballast(int(spec.get("ballast_bytes", 0)))
    t0 = time.perf_counter()
    eng = Engine(g.path, n_ctx=len(prompt) + n_new + 1, threads=int(spec.get("threads", 1)), mmap=mode != "nommap",
                 geometry=g)
    load_s = time.perf_counter() - t0
    if held is not None:  # loaded: the context's memory exists now (and the mode's own, next)
        held.close()
    advisor = PageAdvisor(g, mode, capacity=spec.get("managed_capacity"), policy=spec.get("policy", "lru"))
    routes = RoutingRecorder(weights=False)
    advisor.start()
    anon1 = rss_anon()
    eng.attach(routes)
    eng.attach(advisor)
    c0 = io_counters()
    t1 = time.perf_counter()
    logits = eng.forward(prompt, logits="last")
    t2 = time.perf_counter()
    c1 = io_counters()
    hinted = advisor.hint_bytes
    if spec.get("follow_flag"):  # loaded and prefilled: the wall may follow this process's own memory now
        with open(spec["follow_flag"], "w"):
            pass
    out = [int(np.argmax(logits[-1]))]
    for _ in range(n_new - 1):
        out.append(int(np.argmax(eng.forward([out[-1]], logits="last")[-1])))
    t3 = time.perf_counter()
    c2 = io_counters()
    pre, dec = _diff(c0, c1), _diff(c1, c2)
    steps = n_new - 1
    ids = np.asarray(out, dtype="<i4")
    rec = {"mode": mode, "load_seconds": load_s, "prefill_tokens": len(prompt), "prefill_seconds": t2 - t1,
           "prefill_tokens_per_s": len(prompt) / (t2 - t1), "decode_tokens": steps, "decode_seconds": t3 - t2,
           "decode_tokens_per_s": steps / (t3 - t2) if steps else None,
           "prefill_read_bytes": pre["read_bytes"], "decode_read_bytes": dec["read_bytes"],
           "read_bytes_per_token": dec["read_bytes"] / steps if steps and dec["read_bytes"] is not None else None,
           "major_faults": dec["major_faults"], "prefill_major_faults": pre["major_faults"],
           "major_faults_per_token": dec["major_faults"] / steps if steps else None,
           "output_ids": out, "output_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
           "routing": [[np.unique(fe[lid]).tolist() for lid in g.moe_layers] for fe in (f.experts for f in routes.forwards)],
           "advice": advisor.stats(), "decode_hint_bytes": advisor.hint_bytes - hinted, "threads": int(spec.get("threads", 1)),
           "anon_before_load": anon0, "anon_after_load": anon1, "ballast_bytes": int(spec.get("ballast_bytes", 0))}
    advisor.close()
    eng.close()
    return rec


def demand(routing: list, g: Geometry, wall_bytes: int | None) -> dict:
    """The LRU demand model of a run: its own routing replayed through one global LRU pool of
    ``wall - dense bytes`` (dense bytes: everything in the file that is not an expert tensor, read
    every step) holding experts of their own sizes (a layer's experts may differ in size from
    another's: :class:`~expertcache.cache.SizedCache`), warmed by the prefill forward, scored on the
    decode steps. ``demand_bytes_per_token`` = the bytes of the decode steps' misses / decode steps;
    ``capacity_experts`` = the pool's bytes / the mean expert size."""
    from ..cache import SizedCache

    out = {"capacity_experts": None, "demand_bytes_per_token": None, "demand_note": None}
    if wall_bytes is None or len(routing) < 2:
        out["demand_note"] = "no wall" if wall_bytes is None else "no decode step"
        return out
    sizes = np.repeat(np.asarray(g.layer_expert_bytes, dtype=np.int64), g.num_experts)
    room = wall_bytes - g.dense_bytes
    out["capacity_experts"] = int(max(room, 0) // sizes.mean())
    E = g.num_experts
    widest = max(int(sizes[np.asarray(experts, dtype=np.int64) + j * E].sum()) if len(experts) else 0
                 for f in routing for j, experts in enumerate(f))
    if room < widest:
        out["demand_note"] = (f"the wall holds {max(room, 0)} expert bytes beside the dense {g.dense_bytes} bytes, "
                              f"fewer than one layer routes ({widest})")
        return out
    cache = SizedCache(int(room), "lru", sizes, steps_per_token=len(g.moe_layers))
    misses = missed = 0
    for i, forward in enumerate(routing):
        for j, experts in enumerate(forward):
            step = cache.prepare(np.asarray(experts, dtype=np.int64) + j * E)
            if i > 0:
                misses += len(step.loads)
                missed += int(sizes[[item for item, _ in step.loads]].sum()) if step.loads else 0
    out["demand_misses"] = misses
    out["demand_bytes_per_token"] = missed / (len(routing) - 1)
    return out


@functools.lru_cache(maxsize=None)
def _online_rule(policy: str) -> None:
    """Check once per process that ``policy`` is an online eviction rule (one line otherwise), and
    compile (and cache on disk) a compiled rule here, not in each walled worker."""
    from ..cache import ExpertCache
    from ..policies.kinds import check_kind

    pol = check_kind(policy, ("eviction",), "--policy")
    if pol.needs_future:
        raise ConfigError(f"--policy {policy}: needs the future of the stream; the managed mode decides online")
    warm = ExpertCache(2, pol, 4)
    for i in range(4):
        warm.prepare([i])


def check_managed(g: Geometry, wall_bytes: int | None, policy: str) -> int:
    """The ``managed`` mode's pool in bytes (:func:`~.advice.managed_budget`), or a one-line error: a
    pool that cannot hold one layer's routed experts (k of the largest), or a policy that is not an
    online eviction rule."""
    _online_rule(policy)
    budget = managed_budget(g, wall_bytes)
    need = g.top_k * int(managed_item_bytes(g).max())
    if budget < need:
        raise ConfigError(f"--mode managed: {wall_bytes} bytes leave {budget} for experts beside the dense "
                          f"{g.dense_bytes} bytes, fewer than one layer routes ({g.top_k} experts, {need} bytes)")
    return budget


def run_one(g: Geometry, prompt, max_new_tokens: int, mode: str, *, wall_bytes: int | None = None,
            wall: str = "auto", headroom_bytes: int | None = None, threads: int = 1,
            timeout: float | None = None, keep_routing: bool = False, ballast_bytes: int = 0,
            policy: str = "lru") -> dict:
    """One run in a child process, evicted file first; the record of docs/llama.md. ``policy``
    (an online eviction rule) decides the expert residency of the ``managed`` mode."""
    if mode not in MODES:
        raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    managed = None
    if mode == "managed":
        managed = check_managed(g, wall_bytes, policy)
    if mode == "nommap" and wall_bytes is not None and wall_bytes < g.file_bytes:
        raise ConfigError(f"--mode nommap reads the whole model into memory: the wall {wall_bytes} is below the "
                          f"model's {g.file_bytes} bytes")
    spec = {"model": g.path, "prompt": [int(x) for x in prompt], "max_new_tokens": int(max_new_tokens),
            "mode": mode, "threads": int(threads), "ballast_bytes": int(ballast_bytes),
            "managed_capacity": managed, "policy": policy}
    follow = bool(wall_bytes) and wall_bytes >= FOLLOW_MIN_CAPACITY
    with cap.worker_spec(spec, "expertcache-llama-", follow) as (spec_path, flag):
        evicted = acc.evict_file_pages([g.path])
        argv = [sys.executable, "-m", "expertcache.llama.runner", spec_path]
        walled = cap.run_walled(argv, capacity_bytes=int(wall_bytes or g.file_bytes),
                                wall=wall if wall_bytes else "none", headroom_bytes=headroom_bytes, timeout=timeout,
                                follow_margin=FOLLOW_MARGIN if follow else None, follow_flag=flag)
    where = f"--mode {mode}" + (f" --memory-wall {wall_bytes}" if wall_bytes else "")
    rec = cap.child_result(walled, where, timeout)
    rec.update(memory_wall=wall_bytes, capacity_enforced_by=walled.enforced_by,
               proof_ok=bool(walled.proof_ok) if wall_bytes else False,
               wall_note=walled.note if wall_bytes else "no wall", cold_start=evicted.get("cold"),
               proof=walled.proof if wall_bytes else {})
    rec.update(demand(rec["routing"], g, wall_bytes))
    rb, dm = rec.get("read_bytes_per_token"), rec.get("demand_bytes_per_token")
    rec["amplification"] = rb / dm if rb is not None and dm else None
    if not keep_routing:
        rec.pop("routing")
    return rec


def calibrate(g: Geometry, prompt, threads: int = 1, wall: str = "auto", max_new_tokens: int = 2,
              mode: str = "mmap", policy: str = "lru") -> dict:
    """The wall settings of this model in ``mode``: ``headroom_bytes``, the llama worker's own memory
    (what the wall charged besides the page cache, or the anonymous peak where that is not measured)
    in a run of ``mode`` and ``max_new_tokens`` (those of the runs it serves) behind a wall as large
    as the file plus 1 GB, plus :func:`headroom_margin`. Per mode, because the modes' workers differ in
    their own memory (the ``managed`` one imports the cache and numba: 71.8-75.2 MB against ``mmap``'s
    70.2 MB on the benchmark's 1.69 GB model), and near the wall a few MB decide whether the kernel
    reclaims
    (None where no cgroup measures it: the tier's default headroom then applies); and
    ``ballast_bytes``, the anonymous memory the engine adds after loading (held during the load,
    :func:`ballast`). ``note`` says which."""
    try:
        rec = run_one(g, prompt, max(2, int(max_new_tokens)), mode, wall_bytes=g.file_bytes, wall=wall,
                      headroom_bytes=10**9, threads=threads, policy=policy)
    except ExpertcacheError as exc:
        return {"headroom_bytes": None, "ballast_bytes": 0, "note": f"headroom not calibrated ({exc})"}
    a0, a1 = rec.get("anon_before_load"), rec.get("anon_after_load")
    grow = max(0, a1 - a0) if isinstance(a0, int) and isinstance(a1, int) else 0
    proof = rec.get("proof") or {}
    own = proof.get("own_peak_bytes", proof.get("anon_peak_bytes"))  # anonymous (+ kernel, where measured)
    if not isinstance(own, int) or own <= 0:
        return {"headroom_bytes": None, "ballast_bytes": grow,
                "note": f"headroom not calibrated ({rec['capacity_enforced_by']}: no own-memory peak measured)"}
    margin = headroom_margin(own)
    return {"headroom_bytes": own + margin, "ballast_bytes": grow,
            "note": f"headroom calibrated ({mode}): worker's own memory {own} bytes + {margin}; "
                    f"ballast {grow} bytes during the load"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        with open(argv[0], encoding="utf-8") as fh:
            spec = json.load(fh)
        rec = measure(spec)
    except ExpertcacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, IndexError) as exc:  # a bad spec or a vanished file: one line
        print(f"error: measured process: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
