"""The capacity response T(C) of a file-backed tier (``tier sweep``, docs/tier.md "Sweep").

Each run visits every capacity in its own order, a seeded shuffle (``random.Random(seed + run)``),
so slow drift of the machine does not line up with capacity. For each (mode, capacity) the summary
holds the medians over runs of seconds per iteration and device bytes per iteration, the spread,
and the inverse-capacity reference rail anchored at the largest capacity:
``ref(C) = dev(C_max) * C_max / C`` (device bytes per iteration a miss stream inversely proportional
to capacity would read; a curve that tracks it behaves like the paper's Fig. 2). When the working
set fits at the largest capacity (the demand model has no misses there, so the rail would be a
reading of noise), the anchor is the largest capacity where the demand model has misses
(``reference_anchor_bytes``).
"""

from __future__ import annotations

import random
import statistics

from ..errors import ConfigError


def shuffled_order(seed: int):
    """``order(run, capacities)``: the capacities in a seeded random order for that run."""
    def order(run: int, capacities: list[int]) -> list[int]:
        caps = list(capacities)
        random.Random(seed + run).shuffle(caps)
        return caps
    return order


def summarize(records: list[dict]) -> list[dict]:
    """One summary record per (mode, capacity), with the reference rail per mode (anchored on the
    process's own read bytes, ``read_bytes_self``; on the device's where those are unknown). Failed
    runs are counted (``runs_failed``) and left out of every median."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        cells.setdefault((r["mode"], r["capacity_bytes"]), []).append(r)
    out = []
    for (mode, cap), every in cells.items():
        recs = [r for r in every if not r.get("failed")] or every

        def med(key):
            xs = [r[key] for r in recs if r.get(key) is not None]
            return statistics.median(xs) if xs else None

        spi = [r["seconds_per_iteration_median"] for r in recs if r.get("seconds_per_iteration_median") is not None]
        its = recs[0].get("iterations") or 0
        dem = recs[0].get("demand_miss_bytes")
        own = med("read_bytes_self_per_iteration")
        out.append({
            "summary": True, "mode": mode, "capacity_bytes": cap, "runs": len(every),
            "expert_bytes": recs[0].get("expert_bytes"), "trace": recs[0].get("trace"),
            "runs_failed": sum(1 for r in every if r.get("failed")),
            "seconds_per_iteration_median": statistics.median(spi) if spi else None,
            "seconds_per_iteration_range": [min(spi), max(spi)] if spi else None,
            "seconds_per_iteration_spread": (max(spi) - min(spi)) / statistics.median(spi) if spi else None,
            "read_bytes_self_per_iteration_median": own,
            "device_read_bytes_per_iteration_median": med("device_read_bytes_per_iteration"),
            "device_other_readers": any(r.get("device_other_readers") for r in recs),
            "demand_miss_bytes_per_iteration": dem / its if dem is not None and its else None,
            "amplification_median": med("amplification"),
            "bytes_from_arena": recs[0].get("bytes_from_arena"),
            "capacity_enforced_by": sorted({str(r.get("capacity_enforced_by")) for r in recs if not r.get("failed")}),
            "proof_ok": all(r.get("proof_ok") for r in every),
        })
    by_mode: dict[str, list[dict]] = {}
    for s in out:
        by_mode.setdefault(s["mode"], []).append(s)
    for rows in by_mode.values():
        rows.sort(key=lambda s: s["capacity_bytes"])
        key = ("read_bytes_self_per_iteration_median" if all(s["read_bytes_self_per_iteration_median"] is not None
                                                             for s in rows) else "device_read_bytes_per_iteration_median")
        measured = [s for s in rows if s[key] is not None and (s["demand_miss_bytes_per_iteration"] or 0) > 0]
        top = measured[-1] if measured else None
        for s in rows:
            s["reference_anchor_bytes"] = top["capacity_bytes"] if top else None
            s["reference_basis"] = key.removesuffix("_per_iteration_median") if top else None
            s["reference_bytes_per_iteration"] = (top[key] * top["capacity_bytes"] / s["capacity_bytes"] if top else None)
    return sorted(out, key=lambda s: (s["mode"], s["capacity_bytes"]))


def compare(a: dict, b: dict) -> dict:
    """Which of two cells (summaries, or records carrying ``seconds_per_iteration_range``) is faster
    per iteration, by how much (``lead`` = slower median / faster median - 1), and whether that is
    noise: ``verdict`` is ``"tie (within noise)"`` when the two cells' ranges over their runs overlap,
    ``"single run: no spread measured"`` when either has one run, else ``"<mode> faster"``."""
    ma, mb = a.get("seconds_per_iteration_median"), b.get("seconds_per_iteration_median")
    out = {"modes": [a["mode"], b["mode"]], "capacity_bytes": a["capacity_bytes"], "lead": None, "faster": None,
           "verdict": "not comparable (a cell has no timing)"}
    if not ma or not mb:
        return out
    fast, slow = (a, b) if ma <= mb else (b, a)
    out.update(faster=fast["mode"], lead=max(ma, mb) / min(ma, mb) - 1)
    ra, rb = fast.get("seconds_per_iteration_range"), slow.get("seconds_per_iteration_range")
    if not ra or not rb or (ra[0] == ra[1] and rb[0] == rb[1] and min(a.get("runs", 1), b.get("runs", 1)) < 2):
        out["verdict"] = "single run: no spread measured (use --repeats 3)"
    elif ra[1] >= rb[0]:
        out["verdict"] = "tie (within noise)"
    else:
        out["verdict"] = f"{fast['mode']} faster"
    return out


def comparisons(summary: list[dict]) -> list[dict]:
    """:func:`compare` for every pair of modes measured at the same capacity."""
    by_cap: dict[int, list[dict]] = {}
    for s in summary:
        by_cap.setdefault(s["capacity_bytes"], []).append(s)
    out = []
    for cap in sorted(by_cap):
        rows = by_cap[cap]
        out += [compare(rows[i], rows[j]) for i in range(len(rows)) for j in range(i + 1, len(rows))]
    return out


def plot(summary: list[dict], path: str, title: str = "") -> None:
    """Two panels against capacity (GB): seconds per iteration, device MB per iteration with the rail."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install 'expertcache[plot]')") from None
    from .._io import atomic_open
    from ..report.plots import plot_format
    fmt = plot_format(path)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = sorted({s["mode"] for s in summary})
    for mode in modes:
        rows = [s for s in summary if s["mode"] == mode]
        xs = [s["capacity_bytes"] / 1e9 for s in rows]
        a.plot(xs, [s["seconds_per_iteration_median"] or float("nan") for s in rows], "o-", label=mode)
        dev = [(s["read_bytes_self_per_iteration_median"] or float("nan")) / 1e6 for s in rows]
        line, = b.plot(xs, dev, "o-", label=f"{mode} read (own)")
        ref = [(s["reference_bytes_per_iteration"] or float("nan")) / 1e6 for s in rows]
        b.plot(xs, ref, ":", color=line.get_color(), label=f"{mode} ref ~ 1/C")
    demand = sorted({(s["capacity_bytes"], s["demand_miss_bytes_per_iteration"]) for s in summary
                     if s["demand_miss_bytes_per_iteration"] is not None})
    if demand:
        b.plot([c / 1e9 for c, _ in demand], [d / 1e6 for _, d in demand], "k--", label="demand model (LRU)")
    a.set(xlabel="capacity C (GB)", ylabel="seconds / iteration (median of runs)", title=title or "T(C)")
    b.set(xlabel="capacity C (GB)", ylabel="MB read / iteration (the process's own)", title="reads vs 1/C rail")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path, "wb", option="--plot") as fh:
        fig.savefig(fh, format=fmt, dpi=110)
    plt.close(fig)
