"""One tier measurement cell and its runs: the parent side of ``tier replay`` (docs/tier.md).

A cell is (mode, capacity). Each run of a cell starts the measured process
(:mod:`expertcache.tier.worker`) inside the capacity wall (:func:`expertcache.wall.capacity.run_walled`),
reads its result and adds what the parent knows: the demand model at that capacity, the
amplification, the capacity proof, and -- once every run of the cell is in -- the spread.

Record fields (the output contract; every one is defined in docs/tier.md): ``mode``,
``capacity_bytes``, ``run``, ``iterations``, ``accesses``, ``bytes_read``, ``bytes_from_arena``,
``bytes_from_files``, ``device_read_bytes`` / ``device_read_note``, ``demand_miss_bytes``,
``amplification`` = device_read_bytes / demand_miss_bytes (null when either is unknown or 0),
``seconds_per_iteration_median`` (this run), ``seconds_per_iteration_spread`` ((max - min) /
median of the runs' medians), ``capacity_enforced_by``, ``proof``, ``proof_ok``, ``advice``.
Invariant: a run whose proof is missing keeps ``proof_ok: false``; it is never reported as clean.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

from ..errors import ConfigError
from .demand import demand_model, doubled_layout


@dataclass
class CellOptions:
    """What every run of a replay or sweep shares (see the worker's SPEC keys)."""

    trace_path: str
    pool_path: str
    threads: int = 4
    mmap: bool = False
    arena_fraction: float = 0.5
    profile_fraction: float = 0.6
    profile: str | None = None
    advice: str | None = None
    delivery: str = "fadvise"
    verify_reads: bool = False
    wall: str = "auto"
    cgroup: str | None = None
    headroom_bytes: int | None = None
    timeout: float | None = None
    drop_ipc_lock: bool = False
    drop_caches: bool = False


def capacity_module():
    """expertcache.wall.capacity, or a ConfigError saying it is missing."""
    try:
        from ..wall import capacity
    except ImportError as exc:  # pragma: no cover - only while the module is being written
        raise ConfigError(f"expertcache.wall.capacity is not available ({exc})") from None
    return capacity


class DemandCache:
    """Demand-model figures per capacity, computed once per (capacity, hint source)."""

    def __init__(self, trace, expert_bytes: int, hints=None):
        self.trace, self.expert_bytes, self.hints = trace, expert_bytes, hints
        self.layout = doubled_layout(trace.experts, trace.num_experts)
        self._memo: dict[int, dict] = {}

    def at(self, capacity_bytes: int) -> dict:
        if capacity_bytes not in self._memo:
            self._memo[capacity_bytes] = demand_model(
                self.trace.experts, self.trace.num_experts, capacity_bytes, self.expert_bytes,
                hints=self.hints, layout=self.layout)
        return self._memo[capacity_bytes]


CALIBRATION_HEADROOM = 512 * 10**6
"""Headroom of the calibration run (generous: it only measures the worker's own memory)."""
CALIBRATION_MARGIN = 4 * 10**6
"""Added to the measured own memory: allocator slack between the calibration and a pass. Headroom
the worker does not use goes to the page cache, so it must stay within the proof's slack."""
ARENA_MARGIN = 16 * 10**6
"""The margin in ``arena`` mode, where the page cache keeps nothing (the arena is locked, misses are
O_DIRECT), so unused headroom cannot inflate the tier, while a pass's transient allocations above
the calibration's reading (about 4-5 MB here) would hit the wall and OOM-kill the worker."""


FOLLOW_MODES = ("pagecache", "hybrid")
"""Modes whose wall follows the worker's own memory once it is set up (the Replayer made, before
the warm pass): there, headroom the worker leaves unused would be page cache above the capacity.
A calibration reads the worker's own memory at one moment; a pass may need a few MB less (a
16 MB pagecache cell beside another CPU-heavy job used 46.1 of a 51.0 MB headroom and its page
cache grew to 21.3 MB, past the proof's slack). Not in the other modes: ``direct``/``arena`` keep
no page cache, ``nocache`` drops it at once, so the wall has nothing to reclaim from a spike."""
FOLLOW_MARGIN = 2 * 2**20
"""The following wall's slack above the worker's own memory: below the proof's smallest slack
(4 MiB), above the worker's own variation once set up (its buffers exist by then)."""


def calibrate_headroom(opts: CellOptions, capacity_bytes: int, mode: str = "pagecache") -> tuple[int | None, str]:
    """The wall's headroom for ``mode`` when ``--headroom`` is not given: what the worker's cgroup is
    charged for beyond the tier (anonymous and kernel memory), measured by a calibration run of that
    mode (same trace, pool, threads and advice; arena/hybrid lock and preload their arena, no pass)
    inside a wall with :data:`CALIBRATION_HEADROOM`, plus :data:`CALIBRATION_MARGIN` (:data:`ARENA_MARGIN` in arena mode). The worker's
    own reading at the end counts; in the page-cache modes the sampled anonymous and non-tier
    peaks count too (in arena modes they include mlocked pages not yet on the unevictable list).
    ``(None, why)`` when the wall cannot measure it (no cgroup: the capacity module's default applies)."""
    cap = capacity_module()
    spec = _spec(opts, mode, capacity_bytes) | {"calibrate": True, "cold_start": False, "verify_reads": False}
    wall = _walled(cap, opts, spec, capacity_bytes, CALIBRATION_HEADROOM)
    proof = wall.proof if isinstance(wall.proof, dict) else {}
    try:
        own = json.loads(wall.stdout.strip().splitlines()[-1])["calibration"]["own_bytes"]
    except (ValueError, IndexError, KeyError, TypeError):
        own = None
    seen = [own] + ([proof.get("anon_peak_bytes"), proof.get("own_peak_bytes")] if mode not in ("arena", "hybrid") else [])
    seen = [x for x in seen if isinstance(x, int) and x > 0]
    if wall.returncode != 0 or not seen or not str(wall.enforced_by).startswith("cgroup"):
        return None, f"headroom not calibrated for {mode} ({wall.enforced_by}: nothing measured); default used"
    margin = ARENA_MARGIN if mode == "arena" else CALIBRATION_MARGIN
    return max(seen) + margin, f"headroom calibrated for {mode}: worker's own memory {max(seen)} bytes + {margin}"


def _spec(opts: CellOptions, mode: str, capacity_bytes: int) -> dict:
    return {"pool": opts.pool_path, "trace": opts.trace_path, "mode": mode, "capacity_bytes": int(capacity_bytes),
            "threads": opts.threads, "mmap": opts.mmap, "arena_fraction": opts.arena_fraction,
            "profile_fraction": opts.profile_fraction, "profile": opts.profile, "advice": opts.advice,
            "delivery": opts.delivery, "verify_reads": opts.verify_reads, "cold_start": True,
            "drop_ipc_lock": opts.drop_ipc_lock, "drop_caches": opts.drop_caches}


def _walled(cap, opts: CellOptions, spec: dict, capacity_bytes: int, headroom, follow: bool = False):
    with cap.worker_spec(spec, "expertcache-tier-", follow) as (spec_path, flag):
        argv = [sys.executable, "-m", "expertcache.tier.worker", spec_path]
        return cap.run_walled(argv, capacity_bytes=int(capacity_bytes), wall=opts.wall, cgroup=opts.cgroup,
                              headroom_bytes=headroom, timeout=opts.timeout,
                              follow_margin=FOLLOW_MARGIN if follow else None, follow_flag=flag)


def run_once(opts: CellOptions, mode: str, capacity_bytes: int, run: int, demand: dict,
             headroom_bytes: int | None = None) -> dict:
    """One run of one cell: the worker inside the wall, plus the parent's fields. ``headroom_bytes``
    overrides ``opts.headroom_bytes`` (the calibrated headroom of this mode)."""
    cap = capacity_module()
    spec = _spec(opts, mode, capacity_bytes)
    wall = _walled(cap, opts, spec, capacity_bytes, opts.headroom_bytes if headroom_bytes is None else headroom_bytes,
                   follow=mode in FOLLOW_MODES)
    where = f"--mode {mode} --capacity {capacity_bytes} (run {run})"
    rec = cap.child_result(wall, where, opts.timeout)
    rec["run"] = run
    rec["failed"] = False
    rec["capacity_enforced_by"] = wall.enforced_by
    rec["proof"] = wall.proof if isinstance(wall.proof, dict) else {}
    rec["proof_ok"] = bool(wall.proof_ok) and bool(rec["proof"])
    rec["wall_note"] = wall.note
    rec.update({k: demand.get(k) for k in ("capacity_experts", "demand_misses", "demand_miss_bytes", "demand_note",
                                           "advice_addressable_misses", "advice_addressable_share")})
    own, dev, dem = rec.get("read_bytes_self"), rec.get("device_read_bytes"), rec.get("demand_miss_bytes")
    rec["amplification"] = own / dem if isinstance(own, int) and own > 0 and dem else None
    rec["amplification_device"] = dev / dem if isinstance(dev, int) and dev > 0 and dem else None
    if rec.get("device_other_readers"):
        rec["device_read_note"] = (f"other readers on the device: it read {dev} bytes, this process {own} "
                                   "(amplification uses the process's own bytes)")
    its = rec.get("iterations") or 0
    rec["seconds_per_iteration_median"] = rec.get("seconds_per_iteration_run_median")
    rec["device_read_bytes_per_iteration"] = dev / its if isinstance(dev, int) and its else None
    rec["read_bytes_self_per_iteration"] = own / its if isinstance(own, int) and its else None
    if "accepted_tokens" in rec:
        acc = rec["accepted_tokens"]
        rec["seconds_per_accepted_token"] = rec["seconds_measured"] / acc if acc else None
    return rec


def failed_record(mode: str, capacity_bytes: int, run: int, error: str) -> dict:
    """The record of a run that did not finish: marked ``failed`` with its one-line error."""
    return {"mode": mode, "capacity_bytes": int(capacity_bytes), "run": run, "failed": True, "error": error,
            "proof_ok": False, "seconds_per_iteration_median": None, "device_read_bytes_per_iteration": None,
            "read_bytes_self_per_iteration": None, "amplification": None}


def finish_cell(records: list[dict]) -> None:
    """Set ``seconds_per_iteration_spread`` and the cell medians on every run record of one cell
    (failed runs count in ``runs`` and ``runs_failed`` but not in the medians)."""
    ok = [r for r in records if not r.get("failed")]
    meds = [r["seconds_per_iteration_median"] for r in ok if r.get("seconds_per_iteration_median") is not None]
    devs = [r["device_read_bytes_per_iteration"] for r in ok if r.get("device_read_bytes_per_iteration") is not None]
    mid = statistics.median(meds) if meds else None
    spread = (max(meds) - min(meds)) / mid if meds and mid else None
    for r in records:
        r["runs"] = len(records)
        r["runs_failed"] = len(records) - len(ok)
        r["seconds_per_iteration_spread"] = spread
        r["seconds_per_iteration_cell_median"] = mid
        r["seconds_per_iteration_cell_range"] = [min(meds), max(meds)] if meds else None
        r["device_read_bytes_per_iteration_cell_median"] = statistics.median(devs) if devs else None


def headrooms(opts: CellOptions, modes: list[str], capacities: list[int]) -> dict[str, tuple[int | None, str]]:
    """The headroom of each mode: ``--headroom`` when given; else calibrated per mode (arena and
    hybrid at the largest capacity, whose arena needs the most page tables; the others at the smallest)."""
    if opts.headroom_bytes is not None or opts.wall == "none":
        note = "headroom given (--headroom)" if opts.headroom_bytes is not None else None
        return {m: (opts.headroom_bytes, note) for m in modes}
    return {m: calibrate_headroom(opts, max(capacities) if m in ("arena", "hybrid") else min(capacities), m)
            for m in dict.fromkeys(modes)}


def replay_cells(opts: CellOptions, modes: list[str], capacities: list[int], runs: int, demand: DemandCache,
                 *, order=None, progress=None, keep=None) -> list[dict]:
    """Every (mode, capacity) cell ``runs`` times, interleaved (each run visits every cell once);
    ``order(run, capacities)`` gives each run's capacity order (default: as given). A run that fails
    becomes a :func:`failed_record` and the others go on; when every run failed, the first error is
    raised. ``keep(records)`` is called after each run with every record so far (to write them as
    they finish). Returns the run records, cells finished."""
    cells: dict[tuple[str, int], list[dict]] = {}
    total, done, done_records, errors = runs * len(capacities) * len(modes), 0, [], []
    rooms = headrooms(opts, modes, capacities)
    for r in range(runs):
        for c in (order(r, capacities) if order else capacities):
            for m in modes:
                room, note = rooms[m]
                try:
                    rec = run_once(opts, m, c, r, demand.at(c), headroom_bytes=room)
                except ConfigError as err:
                    errors.append(err)
                    rec = failed_record(m, c, r, str(err))
                rec["headroom_note"] = note
                cells.setdefault((m, c), []).append(rec)
                done_records.append(rec)
                done += 1
                if progress:
                    progress(done, total, rec)
                if keep:
                    keep(done_records)
    if errors and len(errors) == len(done_records):
        raise errors[0]
    for recs in cells.values():
        finish_cell(recs)
    return [rec for m in dict.fromkeys(modes) for c in capacities for rec in cells.get((m, c), [])]
