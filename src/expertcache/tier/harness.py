"""One tier measurement cell and its runs: the parent side of ``tier replay`` (docs/tier.md).

A cell is (mode, capacity). Each run of a cell starts the measured process
(:mod:`expertcache.tier.worker`) inside the capacity wall (:func:`expertcache.tier.capacity.run_walled`),
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
import os
import statistics
import sys
import tempfile
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
    """expertcache.tier.capacity, or a ConfigError saying it is missing."""
    try:
        from . import capacity
    except ImportError as exc:  # pragma: no cover - only while the module is being written
        raise ConfigError(f"expertcache.tier.capacity is not available ({exc})") from None
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
"""Added to the measured anonymous peak: allocator slack between the calibration and a pass."""


def calibrate_headroom(opts: CellOptions, capacity_bytes: int) -> tuple[int | None, str]:
    """The wall's headroom when ``--headroom`` is not given: the worker's own anonymous memory,
    measured by a calibration run (pagecache mode, same trace, pool and threads, no pass) inside a
    wall, plus :data:`CALIBRATION_MARGIN`. ``(None, why)`` when the wall cannot measure it (no
    cgroup: the capacity module's default then applies)."""
    cap = capacity_module()
    spec = _spec(opts, "pagecache", capacity_bytes) | {"calibrate": True, "cold_start": False}
    wall = _walled(cap, opts, spec, capacity_bytes, CALIBRATION_HEADROOM)
    anon = (wall.proof or {}).get("anon_peak_bytes") if isinstance(wall.proof, dict) else None
    if wall.returncode != 0 or not isinstance(anon, int) or anon <= 0:
        return None, f"headroom not calibrated ({wall.enforced_by}: no anonymous peak measured); default used"
    return anon + CALIBRATION_MARGIN, f"headroom calibrated: worker's own memory {anon} bytes + {CALIBRATION_MARGIN}"


def _spec(opts: CellOptions, mode: str, capacity_bytes: int) -> dict:
    return {"pool": opts.pool_path, "trace": opts.trace_path, "mode": mode, "capacity_bytes": int(capacity_bytes),
            "threads": opts.threads, "mmap": opts.mmap, "arena_fraction": opts.arena_fraction,
            "profile_fraction": opts.profile_fraction, "profile": opts.profile, "advice": opts.advice,
            "delivery": opts.delivery, "verify_reads": opts.verify_reads, "cold_start": True,
            "drop_ipc_lock": opts.drop_ipc_lock, "drop_caches": opts.drop_caches}


def _walled(cap, opts: CellOptions, spec: dict, capacity_bytes: int, headroom):
    fd, spec_path = tempfile.mkstemp(prefix="expertcache-tier-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        argv = [sys.executable, "-m", "expertcache.tier.worker", spec_path]
        return cap.run_walled(argv, capacity_bytes=int(capacity_bytes), wall=opts.wall, cgroup=opts.cgroup,
                              headroom_bytes=headroom, timeout=opts.timeout)
    finally:
        os.unlink(spec_path)


def run_once(opts: CellOptions, mode: str, capacity_bytes: int, run: int, demand: dict) -> dict:
    """One run of one cell: the worker inside the wall, plus the parent's fields."""
    cap = capacity_module()
    spec = _spec(opts, mode, capacity_bytes)
    wall = _walled(cap, opts, spec, capacity_bytes, opts.headroom_bytes)
    where = f"--mode {mode} --capacity {capacity_bytes} (run {run})"
    if wall.returncode != 0:
        lines = [ln for ln in (wall.stderr or "").splitlines() if ln.strip()]
        why = lines[-1].removeprefix("error: ") if lines else f"exit status {wall.returncode}"
        if wall.returncode < 0:
            why = f"the measured process was killed by signal {-wall.returncode} inside the {wall.enforced_by} wall ({wall.note or 'no note'})"
        raise ConfigError(f"{where}: {why}")
    try:
        rec = json.loads(wall.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"{where}: the measured process printed no JSON result") from None
    rec["run"] = run
    rec["capacity_enforced_by"] = wall.enforced_by
    rec["proof"] = wall.proof if isinstance(wall.proof, dict) else {}
    rec["proof_ok"] = bool(wall.proof_ok) and bool(rec["proof"])
    rec["wall_note"] = wall.note
    rec.update({k: demand.get(k) for k in ("capacity_experts", "demand_misses", "demand_miss_bytes", "demand_note",
                                           "advice_addressable_misses", "advice_addressable_share")})
    dev, dem = rec.get("device_read_bytes"), rec.get("demand_miss_bytes")
    rec["amplification"] = dev / dem if isinstance(dev, int) and dev > 0 and dem else None
    its = rec.get("iterations") or 0
    rec["seconds_per_iteration_median"] = rec.get("seconds_per_iteration_run_median")
    rec["device_read_bytes_per_iteration"] = dev / its if isinstance(dev, int) and its else None
    if "accepted_tokens" in rec:
        acc = rec["accepted_tokens"]
        rec["seconds_per_accepted_token"] = rec["seconds_measured"] / acc if acc else None
    return rec


def finish_cell(records: list[dict]) -> None:
    """Set ``seconds_per_iteration_spread`` and the cell medians on every run record of one cell."""
    meds = [r["seconds_per_iteration_median"] for r in records if r.get("seconds_per_iteration_median") is not None]
    devs = [r["device_read_bytes_per_iteration"] for r in records if r.get("device_read_bytes_per_iteration") is not None]
    mid = statistics.median(meds) if meds else None
    spread = (max(meds) - min(meds)) / mid if meds and mid else None
    for r in records:
        r["runs"] = len(records)
        r["seconds_per_iteration_spread"] = spread
        r["seconds_per_iteration_cell_median"] = mid
        r["device_read_bytes_per_iteration_cell_median"] = statistics.median(devs) if devs else None


def replay_cells(opts: CellOptions, modes: list[str], capacities: list[int], runs: int, demand: DemandCache,
                 *, order=None, progress=None) -> list[dict]:
    """Every (mode, capacity) cell ``runs`` times; ``order(run, capacities)`` gives each run's capacity
    order (default: as given). Returns the run records, cells finished."""
    cells: dict[tuple[str, int], list[dict]] = {}
    total, done = runs * len(capacities) * len(modes), 0
    headroom_note = "headroom given (--headroom)" if opts.headroom_bytes is not None else None
    if opts.headroom_bytes is None and opts.wall != "none":
        opts.headroom_bytes, headroom_note = calibrate_headroom(opts, min(capacities))
    for r in range(runs):
        for c in (order(r, capacities) if order else capacities):
            for m in modes:
                rec = run_once(opts, m, c, r, demand.at(c))
                rec["headroom_note"] = headroom_note
                cells.setdefault((m, c), []).append(rec)
                done += 1
                if progress:
                    progress(done, total, rec)
    for recs in cells.values():
        finish_cell(recs)
    return [rec for m in modes for c in capacities for rec in cells.get((m, c), [])]
