"""Pivot tables and plots from stored grid results, without replaying (docs/grid.md).

A *panel* is the rows sharing (trace, its content, pool, reset, warm, layers, expert size, the
version that computed them); within it a table has one row per policy and one column per size:
the capacity in experts per pool, or the budget as written for a budget grid. Values are the
stored ``hit_rate`` and ``copies_per_token`` fields. A trace edited between two runs into one
folder gives two panels (their titles name the content), never one table mixing the two (the
last row read had won each cell: a belady figure of the old file beside an lru one of the new).

``gap_recovered`` is computed here from the stored copies of each size's ``lru`` and ``belady``
rows (:func:`fill_gaps`), so a cell stored before belady joined the grid gets it too.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

METRICS = (("hit_rate", "hit rate"), ("copies_per_token", "copies/token"))


def _panel_key(r: dict) -> tuple:
    return (r["trace"], r.get("trace_id"), r["pool"], r["reset"], r["warm"], tuple(r["layers"] or ()),
            r.get("expert_mb"), r.get("version"))


def fill_gaps(rows: list[dict]) -> list[dict]:
    """The rows with ``gap_recovered`` (docs/semantics.md) from the stored ``copies_steady`` of the
    ``lru`` and ``belady`` rows of the same panel and size; ``None`` where either is missing or
    they tie. A grid that added belady later had left its earlier cells without it."""
    from ..sim.gap import as_record, gap_recovered

    steady = {(_panel_key(r), _size(r), r["policy"]): r["copies_steady"] for r in rows}
    out = []
    for r in rows:
        k = (_panel_key(r), _size(r))
        lru, belady = steady.get((*k, "lru")), steady.get((*k, "belady"))
        gap = None if lru is None or belady is None else as_record(gap_recovered(r["copies_steady"], lru, belady))
        out.append({**r, "gap_recovered": gap})
    return out


def panels(rows: list[dict]) -> list[dict]:
    """Group rows into panels: ``{"trace", "trace_id", "version", "expert_mb", "pool", "reset", "warm",
    "layers", "sizes", "policies", "values": {metric: {policy: {size: value}}}, "x": {size: number},
    "unit"}``, in a stable order."""
    groups: dict[tuple, list[dict]] = {}
    for r in fill_gaps(rows):
        groups.setdefault(_panel_key(r), []).append(r)
    out = []
    for (trace, ident, pool, reset, warm, layers, expert_mb, version), rs in sorted(
            groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        x = {_size(r): (r["budget_bytes"] if r["budget"] is not None else r["capacity"]) for r in rs}
        sizes = sorted(x, key=lambda s: x[s])
        policies = list(dict.fromkeys(r["policy"] for r in sorted(rs, key=lambda r: r["policy"])))
        values = {m: {p: {} for p in policies} for m, _ in METRICS}
        for r in rs:
            for m, _ in METRICS:
                values[m][r["policy"]][_size(r)] = r[m]
        out.append({"trace": trace, "trace_id": ident, "version": version, "expert_mb": expert_mb,
                    "pool": pool, "reset": reset, "warm": warm, "layers": list(layers),
                    "sizes": sizes, "policies": policies, "values": values, "x": x,
                    "unit": "budget" if any(r["budget"] is not None for r in rs) else "capacity (experts per pool)"})
    return out


def _size(r: dict) -> str:
    return r["budget"] if r["budget"] is not None else str(r["capacity"])


def title(panel: dict) -> str:
    L = panel["layers"]
    layers = f"{len(L)} layer(s) {L[0]}-{L[-1]}" if L else "no layers"
    ident = f" (content {panel['trace_id'][:12]})" if panel.get("trace_id") else ""
    mb = f", expert_mb {panel['expert_mb']:g}" if panel.get("expert_mb") is not None else ""
    return (f"trace {panel['trace']}{ident}, pool {panel['pool']}, reset {panel['reset']}, warm {panel['warm']:g}, "
            f"{layers}{mb}")


def json_records(ps: list[dict]) -> list[dict]:
    """One record per panel, metric and policy: ``{..., "metric", "policy", "by_size": {size: value}}``."""
    return [{"trace": p["trace"], "trace_id": p["trace_id"], "version": p["version"], "expert_mb": p["expert_mb"],
             "pool": p["pool"], "reset": p["reset"], "warm": p["warm"], "layers": p["layers"],
             "metric": m, "policy": pol,
             "by_size": {s: p["values"][m][pol][s] for s in p["sizes"] if s in p["values"][m][pol]}}
            for p in ps for m, _ in METRICS for pol in p["policies"]]


def plot_panels(ps: list[dict], folder: str | Path) -> list[Path]:
    """One PNG per panel (hit rate and copies/token against size, a line per policy) into ``folder``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot: needs matplotlib: pip install 'expertcache[plot]'") from None
    folder = Path(folder)
    if not folder.is_dir():
        parent = folder.parent if str(folder.parent) else Path(".")
        if folder.exists() or not parent.is_dir():
            raise ConfigError(f"--plot {folder}: not a folder, and its parent {parent} is not one either")
        folder.mkdir()
    from .._io import atomic_open

    written = []
    for i, p in enumerate(ps):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (m, label) in zip(axes, METRICS):
            for pol in p["policies"]:
                pts = sorted((p["x"][s], v) for s, v in p["values"][m][pol].items() if v is not None)
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=pol)
            ax.set_xlabel("budget (bytes)" if p["unit"] == "budget" else "capacity (experts per pool)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(title(p), fontsize=9)
        fig.tight_layout()
        path = folder / f"grid-{i:03d}.png"
        with atomic_open(path, "wb", option="--plot") as fh:
            fig.savefig(fh, format="png", dpi=100)
        plt.close(fig)
        written.append(path)
    return written
