"""One measured llama.cpp run: greedy decode of a prompt in one page-cache mode, optionally behind
a memory wall (``expertcache llama run``; numbers defined in docs/llama.md).

The parent (:func:`run_one`) evicts the GGUF from the page cache (cgroup v1 charges a page to
whoever touched it first, so the measured process must be the first), then runs this module as a
child (``python -m expertcache.llama.runner SPEC.json``) through
:func:`expertcache.wall.capacity.run_walled` (``wall="none"`` without a wall: the same path,
marked unproven). The child (:func:`measure`) loads the engine, applies the mode
(:class:`~.advice.PageAdvisor`), prefills the prompt (one forward, last logits), decodes, and
prints one JSON line: timings, its own ``/proc/self/io`` ``read_bytes`` and major faults per
phase, the generated ids and the routing it computed (per forward and MoE layer, the experts).
The parent adds the wall's proof and the demand model (:func:`demand`).
"""

from __future__ import annotations

import functools
import hashlib
import resource
import sys
import time

import numpy as np

from ..errors import ConfigError
from ..wall import capacity as cap
from ..wall.cgroupwall import worker_main
from ..wall.pagecache import evict_file_pages, evict_for_wall
from .advice import MODES, PageAdvisor, managed_budget, managed_item_bytes, readers_for
from .capture import RoutingRecorder
from .evalfilter import compiled
from .managed import compile_step
from ..formats.gguf import Geometry, read_geometry
from ..wall.procfs import SELF_IO, OpenProcFile, read_self_io

def io_counters(io: OpenProcFile | None = None) -> dict:
    """This process's own ``read_bytes`` (/proc/self/io; ``io``: that file kept open since before the
    engine loaded, as a walled process needs) and major faults (getrusage)."""
    counters, _ = read_self_io(io)
    return {"read_bytes": counters["read_bytes"] if counters else None,
            "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}


def _diff(a: dict, b: dict) -> dict:
    return {k: (b[k] - a[k] if a[k] is not None and b[k] is not None else None) for k in a}


def measure(spec: dict) -> dict:
    """The child's run (see the module docstring)."""
    from .engine import Engine, _llama

    g = read_geometry(spec["model"])
    prompt = [int(x) for x in spec["prompt"]]
    n_new = int(spec["max_new_tokens"])
    mode = spec["mode"]
    _llama()  # the bindings loaded: the start-up is over before the tier is touched
    # the files this process reads inside the wall are opened first, while there is room: a wall
    # the load fills can refuse a later open (ENOMEM; wall.procfs.OpenProcFile)
    selfio = OpenProcFile(SELF_IO)
    # the routing, for the demand model (walled runs) and prefill_routed_bytes: read by the advisor
    # where its mode observes it anyway, else by a recorder (whose graph splits an unwalled mmap
    # run, the reference, would otherwise pay: plain llama.cpp has none)
    need_routing = bool(spec.get("routing", True))
    advisor = PageAdvisor(g, mode, capacity=spec.get("managed_capacity"), policy=spec.get("policy", "lru"),
                          readers=int(spec.get("readers", 0)), predict=spec.get("predict"),
                          compiled=bool(spec.get("compiled", True)), record=need_routing)
    # numba's cached machine code loaded here too, not inside the load phase (the engine's eval
    # filter; the managed step): loading it opens the package's files and numba's cache files,
    # and an open at the load's tight limit failed with ENOMEM (1 run in 2 beside the load harness)
    compiled()
    if advisor.steps is not None:
        compile_step()
    cap.begin_following(spec.get("follow_flag"))
    with cap.model_load(spec.get("follow_flag")):
        t0 = time.perf_counter()
        eng = Engine(g.path, n_ctx=len(prompt) + n_new + 1, threads=int(spec.get("threads", 1)),
                     mmap=mode != "nommap", geometry=g)
        load_s = time.perf_counter() - t0
    routes = RoutingRecorder(weights=False) if need_routing and not advisor.observes_routing else None
    advisor.start()
    if mode == "managed":
        # the worker's memory at its steady state before the pool fills: a first forward touches
        # llama.cpp's compute buffers (9-10 MB here), which a following wall's limit catches up with
        # a second late (its window's least), squeezing a pool sized to the wall: the kernel took
        # prefill pages the pool holds, and the decode faulted 1,000-6,900 of them back one by one.
        # So the prompt runs once through the pool (within its account: the page cache the load
        # left is gone), the pool is emptied and its counts forgotten, and the wall restarts its
        # window from there (docs/robustness.md). Not inside the load phase: its limit leaves no
        # room beyond the tier's (a warm-up there was killed by SIGABRT once beside the test suite).
        eng.attach(advisor)
        eng.forward(prompt, logits="last")
        eng.reset()
        eng.detach(advisor)
        advisor.restart()
        cap.settled(spec.get("follow_flag"))
    if routes is not None:
        eng.attach(routes)
    eng.attach(advisor)
    c0 = io_counters(selfio)
    t1 = time.perf_counter()
    logits = eng.forward(prompt, logits="last")
    t2 = time.perf_counter()
    c1 = io_counters(selfio)
    # the first forward has run: the wall's sampler may slow to its settled pace (its tier readings
    # walk the GGUF's page cache; at 20 a second they took 10% of a 2-thread decode on 2 cores)
    cap.steady(spec.get("follow_flag"))
    hinted = advisor.stats()["hint_bytes"]
    h0, a0 = eng.hook.callback_seconds, eng.hook.seconds_in(advisor)
    td = time.perf_counter()  # the decode's clock starts here, after the mark
    out = [int(np.argmax(logits[-1]))]
    for _ in range(n_new - 1):
        out.append(int(np.argmax(eng.forward([out[-1]], logits="last")[-1])))
    t3 = time.perf_counter()
    h1, a1 = eng.hook.callback_seconds, eng.hook.seconds_in(advisor)
    c2 = io_counters(selfio)
    pre, dec = _diff(c0, c1), _diff(c1, c2)
    adv = advisor.stats()
    if routes is not None:
        routing = [[np.unique(fe[lid]).tolist() for lid in g.moe_layers] for fe in (f.experts for f in routes.forwards)]
    else:
        routing = [[f[lid].tolist() for lid in g.moe_layers] for f in advisor.routing] if need_routing else []
    steps = n_new - 1
    ids = np.asarray(out, dtype="<i4")
    rec = {"mode": mode, "load_seconds": load_s, "prefill_tokens": len(prompt), "prefill_seconds": t2 - t1,
           "prefill_tokens_per_s": len(prompt) / (t2 - t1), "decode_tokens": steps, "decode_seconds": t3 - td,
           "decode_tokens_per_s": steps / (t3 - td) if steps else None,
           "prefill_read_bytes": pre["read_bytes"], "decode_read_bytes": dec["read_bytes"],
           "read_bytes_per_token": dec["read_bytes"] / steps if steps and dec["read_bytes"] is not None else None,
           "major_faults": dec["major_faults"], "prefill_major_faults": pre["major_faults"],
           "major_faults_per_token": dec["major_faults"] / steps if steps else None,
           "output_ids": out, "output_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
           "routing": routing, "advice": adv, "decode_hint_bytes": adv["hint_bytes"] - hinted, "threads": int(spec.get("threads", 1)),
           "advice_seconds_per_token": (a1 - a0) / steps if steps else None,
           "callback_seconds_per_token": (h1 - h0) / steps if steps else None}
    advisor.close()
    eng.close()
    selfio.close()
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
    from ..policies.registry import check_kind

    pol = check_kind(policy, ("eviction",), "--policy")
    if pol.needs_future:
        raise ConfigError(f"--policy {policy}: needs the future of the stream; the managed mode decides online")
    warm = ExpertCache(2, pol, 4)
    for i in range(4):
        warm.prepare([i])
    if policy == "lru":  # the managed mode's compiled step (llama/managed.py)
        compile_step()


def check_managed(g: Geometry, wall_bytes: int | None, policy: str) -> int:
    """The ``managed`` mode's pool in bytes (:func:`~.advice.managed_budget`), or a one-line error: a
    pool that cannot hold one layer's routed experts (k of the largest), or a policy that is not an
    online eviction rule."""
    _online_rule(policy)
    budget = managed_budget(g, wall_bytes)
    need = g.top_k * int(managed_item_bytes(g).max())
    if budget < need:
        raise ConfigError(f"--mode managed: {wall_bytes} bytes leave {budget} for experts beside the dense "
                          f"{g.dense_bytes} bytes, fewer than one layer routes ({g.top_k} experts, {need} bytes, "
                          f"each expert the whole pages its slices cover): this mode needs at least "
                          f"{g.dense_bytes + need} bytes")
    return budget


def smallest_wall(g: Geometry) -> int:
    """The smallest wall a run of this model can be proven in: the dense part (read on every
    forward, and locked by ``pin`` and ``managed``) plus one layer's ``k`` routed experts of the
    largest size. Below it no mode holds what one token needs."""
    return g.dense_bytes + g.top_k * max(g.layer_expert_bytes)


def check_wall(g: Geometry, wall_bytes: int | None, where: str = "--memory-wall", mode: str | None = None) -> None:
    """A one-line refusal of a wall the model cannot run in: below the dense part and one layer's
    routed experts, or (``mode`` ``nommap``, which reads the whole file into memory) below the file."""
    if wall_bytes is not None and wall_bytes < smallest_wall(g):
        raise ConfigError(f"{where} {wall_bytes}: too small to prove: the smallest wall this model runs in is "
                          f"{smallest_wall(g)} bytes (the dense part {g.dense_bytes} plus one layer's "
                          f"{g.top_k} routed experts)")
    if mode == "nommap" and wall_bytes is not None and wall_bytes < g.file_bytes:
        raise ConfigError(f"--mode nommap reads the whole model into memory: the wall {wall_bytes} is below the "
                          f"model's {g.file_bytes} bytes")


def request_bytes(g: Geometry) -> int:
    """The device request size of a missed expert: its largest slice of one expert tensor."""
    return max(n for layer in g.moe_layers for _, n in g.expert_ranges(layer, 0))


def run_roofline(g: Geometry, prompt, max_new_tokens: int, threads: int, rec: dict, fresh: bool = False) -> dict:
    """The roofline fields of a run's record (:mod:`.roofline`), its missed bytes per token being
    the LRU demand model's (0 without a wall: every expert fits), its compute rate timed in the page
    state its mode's reads leave (:func:`~expertcache.llama.roofline.pages_of`)."""
    from .roofline import limits, pages_of, roofline

    r = roofline(g.path, request_bytes(g), prompt, max_new_tokens, threads, fresh=fresh, pages=pages_of(rec["mode"]))
    missed = rec.get("demand_bytes_per_token") if rec.get("memory_wall") else 0.0
    r.update(limits(r["compute_tokens_per_s"], missed, r["device_read_bytes_per_s_1"], r["device_read_bytes_per_s_4"],
                    rec.get("decode_tokens_per_s")))
    return r


def run_one(g: Geometry, prompt, max_new_tokens: int, mode: str, *, wall_bytes: int | None = None,
            wall: str = "auto", headroom_bytes: int | None = None, threads: int = 1,
            timeout: float | None = None, keep_routing: bool = False, policy: str = "lru",
            cache_bytes: int | None = None, roofline: bool = True, readers: int | None = None,
            predict: str | None = None, compiled: bool = True) -> dict:
    """One run in a child process, evicted file first; the record of docs/llama.md. ``policy``
    (an online eviction rule) decides the expert residency of the ``managed`` mode, bounded by
    ``cache_bytes`` (``--cache-memory``; default the wall). A walled run's limit follows the worker
    (:func:`~expertcache.wall.capacity.follow_plan`) and its tier is the GGUF's own page cache.
    ``roofline``: add the physical limit's fields (:func:`run_roofline`). ``compiled``: the ``managed``
    mode's one-row steps in compiled code (False: its Python path, for the A/B). The routing is
    recorded only where it is used (a wall, or ``keep_routing``): an unwalled ``mmap`` run has no
    observer, as plain llama.cpp has none."""
    if mode not in MODES:
        raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    check_wall(g, wall_bytes, mode=mode)
    if cache_bytes is not None and mode != "managed":
        raise ConfigError(f"--cache-memory bounds the managed mode's pool; --mode {mode} leaves residency to the "
                          "kernel (bound it with a --memory-wall)")
    if cache_bytes is not None and wall_bytes is not None and cache_bytes > wall_bytes:
        raise ConfigError(f"--cache-memory {cache_bytes} is above the --memory-wall {wall_bytes}: the pool would "
                          "not fit in the wall")
    if predict is not None and (predict != "lookahead" or mode != "managed"):
        raise ConfigError(f"--predict {predict}: the managed mode's option (lookahead), not --mode {mode}'s")
    managed = None
    if mode == "managed":
        managed = check_managed(g, cache_bytes if cache_bytes is not None else wall_bytes, policy)
    spec = {"model": g.path, "prompt": [int(x) for x in prompt], "max_new_tokens": int(max_new_tokens),
            "mode": mode, "threads": int(threads), "managed_capacity": managed, "policy": policy,
            "readers": readers_for(mode, readers), "predict": predict, "compiled": bool(compiled),
            "routing": bool(wall_bytes) or bool(keep_routing)}
    capacity = int(wall_bytes or g.file_bytes)
    headroom, margin, note = cap.follow_plan(capacity, headroom_bytes)
    with cap.worker_spec(spec, "expertcache-llama-", True) as (spec_path, flag):
        evicted = evict_for_wall([g.path]) if wall_bytes else evict_file_pages([g.path])
        argv = [sys.executable, "-m", "expertcache.llama.runner", spec_path]
        walled = cap.run_walled(argv, capacity_bytes=capacity, wall=wall if wall_bytes else "none",
                                headroom_bytes=headroom, timeout=timeout, follow_margin=margin, follow_flag=flag,
                                tier_files=[g.path], tier_locked=False)
    where = f"--mode {mode}" + (f" --memory-wall {wall_bytes}" if wall_bytes else "")
    rec = cap.child_result(walled, where, timeout)
    rec.update(memory_wall=wall_bytes, cache_memory=managed, capacity_enforced_by=walled.enforced_by,
               proof_ok=bool(walled.proof_ok) if wall_bytes else False,
               wall_note=walled.note if wall_bytes else "no wall", cold_start=evicted.get("cold"),
               proof=walled.proof if wall_bytes else {}, headroom_note=note if wall_bytes else None)
    rec.update(demand(rec["routing"], g, wall_bytes))
    rec["prefill_routed_bytes"] = rec["prefill_read_ratio"] = None  # without the routing (unwalled, not kept)
    if rec["routing"]:  # the prefill's routed experts (each once), against what the prefill read
        sizes = g.layer_expert_bytes
        rec["prefill_routed_bytes"] = sum(len(experts) * sizes[j] for j, experts in enumerate(rec["routing"][0]))
        pr = rec.get("prefill_read_bytes")
        rec["prefill_read_ratio"] = pr / rec["prefill_routed_bytes"] if pr is not None and rec["prefill_routed_bytes"] else None
    rb, dm = rec.get("read_bytes_per_token"), rec.get("demand_bytes_per_token")
    rec["amplification"] = rb / dm if rb is not None and dm else None
    if roofline:  # after the run: the compute-rate decode is the parent's, outside the wall
        rec.update(run_roofline(g, prompt, max_new_tokens, threads, rec))
    if not keep_routing:
        rec.pop("routing")
    return rec


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, measure, "expertcache.llama.runner")


if __name__ == "__main__":
    sys.exit(main())
