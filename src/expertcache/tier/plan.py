"""The ownership calculus (paper section 8): breakeven reuse between tiers, the placement it implies,
and the smallest capacity that meets a target from a measured T(C) curve.

Definitions (rates in GB/s, 1 GB = 1e9 bytes; an expert of B bytes):

* ``k* = (1/copy) / (1/slow - 1/fast)``: promoting an expert costs one overlapped copy (B/copy) and
  saves B (1/slow - 1/fast) per later use, so promotion pays after k* reuses.
* Tier pairs: HBM <- host DRAM over a coherent link (copy = the overlapped copy rate, slow = the
  accelerator's direct read of host DRAM, fast = HBM); the same pair on a PCIe link (copy = slow =
  the PCIe rate: no coherent read path, so restreaming is a copy); host DRAM <- NVMe (copy = slow =
  the NVMe rate, fast = the host rate). Admission into the page cache on a miss costs nothing
  extra (the miss already pays the read: paper Rule 1), so its marginal k* is 0.
* Adopt (read host pages in place at the host rate) against stream (copy each use at the copy
  rate): ``gap = |1/host - 1/copy| / mean(1/host, 1/copy)``; within the tie band both are equal
  and adoption, the simpler, is chosen (Rule 3).

Invariants: every rate is finite and positive and each faster tier is faster than its slower one,
else a one-line ConfigError; all functions are pure (no I/O except :func:`read_curve`, which
reads a bounded number of bytes per line and names the line of the first bad record).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from .._units import format_bytes
from ..errors import ConfigError, is_real

MAX_LINE = 1 << 20
"""Longest curve line read (bytes)."""
MAX_POINTS = 100_000
"""Most curve records read."""
DEFAULT_TIE_BAND = 0.10
"""Adopt and stream count as tied when their per-byte times differ by at most this fraction."""


@dataclass(frozen=True)
class Rates:
    """Bandwidths in GB/s; None where not given (the rows that need it are left out). ``copy`` is
    the overlapped host-to-HBM copy rate (``copy_given`` False when it defaulted to ``host``)."""

    hbm: float | None
    host: float | None
    pcie: float | None
    nvme: float | None
    copy: float | None
    copy_given: bool = True

    def check(self) -> "Rates":
        for name in ("hbm", "host", "pcie", "nvme", "copy"):
            v = getattr(self, name)
            if v is not None and not (is_real(v) and v > 0):
                raise ConfigError(f"--{name}-gbps: {v!r} is not a positive finite bandwidth")
        for fast, slow in (("hbm", "host"), ("hbm", "pcie"), ("host", "nvme")):
            f, s = getattr(self, fast), getattr(self, slow)
            if f is not None and s is not None and f <= s:
                raise ConfigError(f"--{fast}-gbps {f:g} is not faster than --{slow}-gbps "
                                  f"{s:g}: the faster tier must read faster than the slower one")
        return self


def breakeven(copy: float, slow: float, fast: float) -> float:
    """``k* = (1/copy) / (1/slow - 1/fast)``: reuses after which promotion to the fast tier pays."""
    for what, v in (("copy", copy), ("slow", slow), ("fast", fast)):
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"breakeven: the {what} rate {v!r} is not a positive finite bandwidth")
    if fast <= slow:
        raise ConfigError(f"breakeven: the fast tier ({fast:g} GB/s) is not faster than the slow one ({slow:g} GB/s)")
    return (1.0 / copy) / (1.0 / slow - 1.0 / fast)


PAIR_NEEDS = {("hbm<-host", "coherent"): ("hbm", "host"), ("hbm<-host", "pcie"): ("hbm", "pcie"),
              ("host<-nvme", "storage"): ("host", "nvme")}
"""The rates each tier pair's k* needs (the coherent pair's copy rate defaults to --host-gbps)."""


def tier_pairs(r: Rates) -> list[dict]:
    """One row per adjacent tier pair whose rates were given: ``pair``, ``link``, ``copy_gbps``,
    ``slow_gbps``, ``fast_gbps``, ``k_star``."""
    rows = [("hbm<-host", "coherent", r.copy, r.host, r.hbm),
            ("hbm<-host", "pcie", r.pcie, r.pcie, r.hbm),
            ("host<-nvme", "storage", r.nvme, r.nvme, r.host)]
    out = [{"pair": p, "link": link, "copy_gbps": c, "slow_gbps": s, "fast_gbps": f, "k_star": breakeven(c, s, f)}
           for p, link, c, s, f in rows if all(getattr(r, k) is not None for k in PAIR_NEEDS[(p, link)])]
    for row in out:
        if row["pair"] == "host<-nvme":
            row["k_star_admission_on_miss"] = 0.0  # the page cache admits on the miss read itself (Rule 1)
    return out


def missing_pairs(r: Rates) -> list[str]:
    """One line per tier pair left out, naming the options it needs."""
    return [f"{p} ({link}): needs " + " and ".join(f"--{k}-gbps" for k in need)
            for (p, link), need in PAIR_NEEDS.items() if any(getattr(r, k) is None for k in need)]


def adopt_or_stream(host: float, copy: float, tie_band: float = DEFAULT_TIE_BAND) -> dict:
    """Per-byte time of adopting (reading host pages in place at ``host``) against streaming (a copy
    per use at ``copy``): ``gap`` relative to their mean, ``adopt_slower_by`` relative to streaming,
    ``stream_faster_by`` relative to adopting, and the choice (``adopt`` on a tie)."""
    if not (0 <= tie_band < 1):
        raise ConfigError(f"--tie-band: {tie_band!r} is outside [0, 1)")
    a, s = 1.0 / host, 1.0 / copy
    gap = abs(a - s) / ((a + s) / 2)
    choice = "adopt (tie)" if gap <= tie_band else ("adopt" if a < s else "stream")
    return {"adopt_s_per_gb": a, "stream_s_per_gb": s, "gap": gap, "adopt_slower_by": a / s - 1,
            "stream_faster_by": 1 - s / a, "tie_band": tie_band, "choice": choice}


def request_counts(trace) -> tuple[np.ndarray, int]:
    """``(counts [L, E], iterations)``: requests of each (layer, expert) over the trace, and the engine
    iterations it spans (rows opening an iteration when the trace has the ``iteration`` extra, else
    every row)."""
    from ..sim.layout import row_units

    ex = np.asarray(trace.experts)
    L, E = trace.num_layers, trace.num_experts
    flat = (np.arange(L, dtype=np.int64)[None, :, None] * E + ex.astype(np.int64))[ex >= 0]
    counts = np.bincount(flat, minlength=L * E).reshape(L, E)
    _, starts = row_units(trace)
    iterations = int(np.count_nonzero(starts)) if starts is not None else int(ex.shape[0])
    return counts, iterations


def placement(counts: np.ndarray, iterations: int, k_star: float, expert_bytes: int,
              hbm_bytes: int | None = None) -> dict:
    """Which experts to own in HBM: those whose reuse over the trace (requests - 1) exceeds ``k_star``,
    highest request count first, cut to ``hbm_bytes // expert_bytes`` slots when a budget is given;
    everything else stays in the page cache. Shares are of all requests."""
    counts = np.asarray(counts)
    total = int(counts.sum())
    order = np.argsort(-counts, axis=None, kind="stable")
    ranked = counts.ravel()[order]
    candidates = int(np.count_nonzero(ranked - 1 > k_star))
    slots = None if hbm_bytes is None else int(hbm_bytes // expert_bytes)
    pinned = candidates if slots is None else min(candidates, slots)
    E = counts.shape[1]
    top = [{"layer_index": int(i // E), "expert": int(i % E), "requests": int(counts.ravel()[i]),
            "per_iteration": counts.ravel()[i] / iterations if iterations else None} for i in order[:min(pinned, 10)]]
    pinned_req = int(ranked[:pinned].sum())
    touched = int(np.count_nonzero(ranked))
    return {"experts_touched": touched, "requests": total, "iterations": iterations,
            "requests_per_iteration": total / iterations if iterations else None,
            "candidates_above_k_star": candidates, "candidate_bytes": candidates * expert_bytes,
            "hbm_slots": slots, "pinned": pinned, "pinned_bytes": pinned * expert_bytes,
            "pinned_request_share": pinned_req / total if total else None,
            "left_to_page_cache": touched - pinned, "left_bytes": (touched - pinned) * expert_bytes,
            "left_request_share": (total - pinned_req) / total if total else None,
            "pinned_top": top}


def read_curve(path: str) -> tuple[list[dict], dict]:
    """Points ``{"mode", "capacity_bytes", "seconds_per_iteration_median", "proof_ok", "summary", "line"}`` of a
    ``tier sweep --json`` file, and counts of lines skipped (records without those two fields, or
    with a null median). A line that is not a JSON object, or a field of the wrong kind, is a
    ConfigError naming ``path:line``."""
    points, skipped = [], {"without_fields": 0, "null_median": 0}
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"--curve {path}: cannot read ({exc.strerror or exc})") from None
    with fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(MAX_LINE + 1), b""), 1):
            where = f"--curve {path}:{lineno}"
            if len(raw) > MAX_LINE:
                raise ConfigError(f"{where}: line longer than {MAX_LINE} bytes")
            text = raw.decode("utf-8", "replace").strip()
            if not text:
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            if "capacity_bytes" not in rec or "seconds_per_iteration_median" not in rec:
                skipped["without_fields"] += 1
                continue
            cap, sec = rec["capacity_bytes"], rec["seconds_per_iteration_median"]
            if sec is None:
                skipped["null_median"] += 1
                continue
            if not _positive(cap):
                raise ConfigError(f"{where}: capacity_bytes {cap!r} is not a positive number")
            if not _positive(sec):
                raise ConfigError(f"{where}: seconds_per_iteration_median {sec!r} is not a positive number")
            spread = rec.get("seconds_per_iteration_spread")
            points.append({"mode": str(rec.get("mode", "unknown")), "capacity_bytes": int(cap),
                           "seconds_per_iteration_median": float(sec), "proof_ok": rec.get("proof_ok"),
                           "summary": rec.get("summary") is True, "line": lineno,
                           "expert_bytes": rec.get("expert_bytes"), "trace": rec.get("trace"),
                           "spread": spread if _positive(spread) else None})
            if len(points) > MAX_POINTS:
                raise ConfigError(f"{where}: more than {MAX_POINTS} points")
    if not points:
        raise ConfigError(f"--curve {path}: no record with capacity_bytes and seconds_per_iteration_median")
    return points, skipped


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


NOISY_SPREAD = 0.2
"""A curve point whose runs spread by more than this ((max - min) / median) is flagged noisy."""


def check_curve(points: list[dict], expert_bytes: int, trace_name: str, path: str) -> str | None:
    """Refuse a curve measured on another workload: records carrying ``expert_bytes`` or ``trace``
    (``tier sweep --json`` writes both) must match the plan's. Returns a note when the curve carries
    neither (a hand-made curve: not checkable)."""
    sizes = {p["expert_bytes"] for p in points if p.get("expert_bytes") is not None}
    traces = {p["trace"] for p in points if p.get("trace") is not None}
    if sizes and sizes != {expert_bytes}:
        raise ConfigError(f"--curve {path}: measured with experts of {', '.join(map(str, sorted(sizes)))} bytes, "
                          f"the plan's are {expert_bytes} bytes (another pool: its capacities do not transfer)")
    if traces and traces != {trace_name}:
        raise ConfigError(f"--curve {path}: measured on trace {', '.join(sorted(map(str, traces)))}, the plan's "
                          f"trace is {trace_name} (another workload: its capacities do not transfer)")
    if not sizes and not traces:
        return "the curve names no expert size or trace (not 'tier sweep --json' output): not checked against the plan"
    return None


def _curve_flags(caps: list[int], ips: list[float], spreads: dict[int, float]) -> list[str]:
    """Notes on a curve that should not be read as a clean T(C): non-monotone steps, noisy points."""
    flags = [f"non-monotone: {ips[i]:.4g} it/s at {format_bytes(caps[i])} but {ips[i + 1]:.4g} at "
             f"{format_bytes(caps[i + 1])}" for i in range(len(ips) - 1) if ips[i + 1] < ips[i]]
    noisy = [c for c in caps if spreads.get(c) is not None and spreads[c] > NOISY_SPREAD]
    if noisy:
        flags.append(f"noisy: run spread above {NOISY_SPREAD:.0%} at {', '.join(format_bytes(c) for c in noisy)}")
    return flags


def capacity_for_target(points: list[dict], target_ips: float) -> list[dict]:
    """Per mode: the smallest measured capacity whose iterations/s (1 / median seconds per iteration;
    the median over records at the same capacity; where a mode has ``summary`` records, as ``tier sweep
    --json`` prints after the per-run ones, only those are used) meets ``target_ips``, and the capacity where the
    straight line through it and the next smaller measured capacity crosses the target
    (``interpolated_capacity_bytes``; None when the smallest measured capacity already meets it or
    none does). ``flags`` lists non-monotone steps and noisy points (also appended to ``note``)."""
    if not _positive(target_ips):
        raise ConfigError(f"--target-iters-per-s: {target_ips!r} is not a positive number")
    out = []
    for mode in sorted({p["mode"] for p in points}):
        by_cap: dict[int, list[float]] = {}
        unproven, spreads = set(), {}
        summarised = any(p["summary"] for p in points if p["mode"] == mode)
        for p in points:
            if p["mode"] == mode and p["summary"] == summarised:
                by_cap.setdefault(p["capacity_bytes"], []).append(p["seconds_per_iteration_median"])
                if p["proof_ok"] is False:
                    unproven.add(p["capacity_bytes"])
                if p.get("spread") is not None:
                    spreads[p["capacity_bytes"]] = max(spreads.get(p["capacity_bytes"], 0.0), p["spread"])
        caps = sorted(by_cap)
        ips = [1.0 / float(np.median(by_cap[c])) for c in caps]
        row = {"mode": mode, "target_iters_per_s": target_ips,
               "curve": [{"capacity_bytes": c, "iters_per_s": v, "records": len(by_cap[c]),
                          "proof_ok": c not in unproven} for c, v in zip(caps, ips)],
               "measured_capacity_bytes": None, "interpolated_capacity_bytes": None, "note": "",
               "flags": _curve_flags(caps, ips, spreads)}
        meet = next((i for i, v in enumerate(ips) if v >= target_ips), None)
        if meet is None:
            best = int(np.argmax(ips))
            row["note"] = (f"no measured capacity meets {target_ips:g} it/s; the best is {ips[best]:.4g} it/s "
                           f"at {format_bytes(caps[best])} (not extrapolated)")
        else:
            row["measured_capacity_bytes"] = caps[meet]
            if meet == 0:
                row["note"] = "the smallest measured capacity already meets the target (not extrapolated below it)"
            else:
                c0, c1, v0, v1 = caps[meet - 1], caps[meet], ips[meet - 1], ips[meet]
                row["interpolated_capacity_bytes"] = int(round(c0 + (target_ips - v0) * (c1 - c0) / (v1 - v0)))
                row["note"] = (f"interpolated linearly in iterations/s between {format_bytes(c0)} ({v0:.4g} it/s) "
                               f"and {format_bytes(c1)} ({v1:.4g} it/s)")
            if caps[meet] in unproven:
                row["note"] += "; the meeting point's capacity proof is missing or failed"
        if row["flags"]:
            row["note"] += "; " + "; ".join(row["flags"])
        out.append(row)
    return out
