"""Pictures of the curves in :mod:`expertcache.sim.curves`, readable without the code.

Every figure names the trace, the pool, the capacity and the window in its title, labels its axes
with units and has a legend; a policy that reads the recorded future (``needs_future``) is labelled
"(needs future)". The file format follows the extension of the path: ``.png``, ``.pdf`` or ``.svg``
(any case); anything else is a :class:`~expertcache.errors.ConfigError` (:func:`plot_format`),
raised before anything is drawn. Figures are drawn with matplotlib's object API on the Agg canvas
(no pyplot state, no display needed) and written atomically: a temporary file beside the target,
then a rename, so a killed run never leaves a torn file. matplotlib comes with the ``plot`` extra.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from typing import Sequence

from .._io import atomic_open
from .._text import id_ranges
from ..errors import ConfigError

DPI = 120
FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}
"""Extensions (lower case) of the files a plot can be written to, and matplotlib's format name."""


def plot_format(path: str | os.PathLike, option: str = "--plot") -> str:
    """The format of ``path`` from its extension (``png``, ``pdf`` or ``svg``, any case), else a
    one-line ConfigError naming ``option``."""
    suffix = Path(path).suffix
    fmt = FORMATS.get(suffix.lower())
    if fmt is None:
        what = f"extension {suffix!r}" if suffix else "no extension"
        raise ConfigError(f"{option} {path}: {what}; the format follows the extension: .png, .pdf or .svg")
    return fmt


def policy_label(name: str, needs_future: bool) -> str:
    """A policy's legend label: ``"belady (needs future)"`` for a clairvoyant policy."""
    return f"{name} (needs future)" if needs_future else name


def plot_mrc(curves: Sequence, path: str | os.PathLike, *, trace: str, budgets: Sequence[tuple[int, int]] | None = None,
             target_hit_rate: float | None = None, target_copies: float | None = None) -> Path:
    """Miss-ratio curves (:class:`~expertcache.sim.curves.MissRatioCurve`) drawn by :func:`mrc_figure`
    into ``path``."""
    fmt = plot_format(path)
    fig = mrc_figure(curves, trace=trace, budgets=budgets, target_hit_rate=target_hit_rate,
                     target_copies=target_copies)
    return _save(fig, path, fmt)


def mrc_figure(curves: Sequence, *, trace: str, budgets: Sequence[tuple[int, int]] | None = None,
               target_hit_rate: float | None = None, target_copies: float | None = None):
    """Steady copies per token (left) and hit rate (right) against capacity, one line per policy;
    the title names the trace, the capacities, the layers replayed and the window. With
    ``budgets`` (``[(budget bytes, capacity per pool)]`` of a ``--budgets`` sweep) each point sits
    at its budget: the x axis is the budget in GB on a log2 scale, its ticks the budgets in GB. A target (``target_hit_rate`` in (0, 1], ``target_copies``) is a
    dashed horizontal line on its panel."""
    fig = _figure(2)
    ax_c, ax_h = fig.axes
    first = curves[0].results[0]
    scale = None if budgets is None else [b / 1e9 for b, _ in budgets]
    for i, curve in enumerate(curves):
        style = dict(color=_color(i), marker="o" if len(curve.results) <= 40 else None, markersize=3, linewidth=1.6)
        label = policy_label(curve.policy, curve.needs_future)
        if scale is None:
            x, copies, hit = curve.capacities, curve.copies_per_token, curve.hit_rate
        else:
            rows = [curve.at(cap) for _, cap in budgets]
            x, copies, hit = scale, [r.copies_per_token for r in rows], np.array([r.hit_rate for r in rows])
        ax_c.plot(x, copies, label=label, **style)
        ax_h.plot(x, 100 * hit, label=label, **style)
    if target_copies is not None:
        ax_c.axhline(target_copies, color="0.2", linestyle="--", linewidth=1, label=f"target: copies/token <= {target_copies:g}")
    if target_hit_rate is not None:
        ax_h.axhline(100 * target_hit_rate, color="0.2", linestyle="--", linewidth=1,
                     label=f"target: hit rate >= {100 * target_hit_rate:g}%")
    xlabel = _capacity_label(first.pool) if scale is None else "budget (GB over all layers, decimal; log2 scale)"
    ax_c.set(xlabel=xlabel, ylabel="steady copies per accepted token (all layers)", title="Copies per token")
    ax_h.set(xlabel=xlabel, ylabel="hit rate (% of scored requests)", title="Hit rate")
    ax_c.set_ylim(bottom=0)
    for ax in fig.axes:
        if scale is not None:
            ax.set_xscale("log", base=2)
            ticks = sorted(set(scale))
            if len(ticks) > 12:
                ticks = ticks[:: -(-len(ticks) // 12)]
            ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(title="policy", fontsize=8)
    caps = curves[0].capacities
    fig.suptitle(f"{trace}: miss-ratio curves, capacity {caps.min()}..{caps.max()} ({_setup(first)}; "
                 f"{_layers(first.layers)})")
    return fig


def plot_foresight(curve, path: str | os.PathLike, *, trace: str) -> Path:
    """Gap recovered by ``foresight:h`` against the horizon h on a log2 axis (a
    :class:`~expertcache.sim.curves.ForesightCurve`), the other policies (by default the causal
    rules) as dotted horizontal lines, as in the eviction paper's Fig. 2. Horizon 0 (= LRU) has no
    place on a log axis and is left out."""
    fmt = plot_format(path)
    fig = _figure(1, width=8.5, height=5.6)
    ax = fig.axes[0]
    pts = [(h, g) for h, g in zip(curve.horizons, curve.gap) if h > 0 and g is not None]
    if not pts:
        raise ConfigError("plot: LRU and Belady tie at this capacity, so no share of the gap is defined")
    hs, gs = zip(*pts)
    ahead = any(r.needs_future for r in curve.foresight)
    ax.plot(hs, [100 * g for g in gs], color=_color(0), marker="o", linewidth=2,
            label=policy_label("foresight:h, belady seeing h tokens ahead", ahead))
    for h, g in pts:
        ax.annotate(_pct(g), (h, 100 * g), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    shown = [100 * g for g in gs]
    for i, r in enumerate(curve.references):
        if r.gap_recovered is not None:
            shown.append(100 * r.gap_recovered)
            kind = "needs future" if r.needs_future else "causal"
            ax.axhline(100 * r.gap_recovered, color=_color(i + 1), linestyle=":", linewidth=1.8,
                       label=f"{r.policy} ({kind}): {_pct(r.gap_recovered)}")
    ax.axhline(0, color="0.4", linewidth=0.8)
    ax.axhline(100, color="0.4", linewidth=0.8)
    ax.set_ylim(min(-5.0, min(shown) - 5), max(110.0, max(shown) + 10))
    ax.set_xscale("log", base=2)
    ax.set_xticks(hs, [str(h) for h in hs])
    ax.set(xlabel="foresight h (tokens of future requests visible, log2 scale)",
           ylabel="share of the LRU-to-Belady gap recovered (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    lru, bel = curve.lru, curve.belady
    fig.suptitle(
        f"{trace}: limited foresight at capacity {curve.capacity} {_unit(lru.pool)}\n{_setup(lru)}; "
        f"0% = LRU ({lru.copies_per_token:.3g} copies/token), 100% = Belady ({bel.copies_per_token:.3g})",
        fontsize=10,
    )
    return _save(fig, path, fmt)


def plot_pools(comparisons: Sequence, path: str | os.PathLike, *, trace: str) -> Path:
    """Global pool against the equal per-layer split (:class:`~expertcache.sim.curves.PoolComparison`):
    hit rate (left) and copies per token (right). One per-layer capacity gives grouped bars,
    several give lines against capacity (solid: global pool, dashed: per-layer split)."""
    fmt = plot_format(path)
    fig = _figure(2)
    ax_h, ax_c = fig.axes
    policies = list(dict.fromkeys(c.policy for c in comparisons))
    labels = {c.policy: policy_label(c.policy, c.split.needs_future) for c in comparisons}
    caps = sorted({c.capacity for c in comparisons})
    first = comparisons[0]
    L = len(first.split.layers)
    if len(caps) == 1:
        width = 0.38
        for j, (name, pick) in enumerate((("per-layer split", "split"), ("global pool", "shared"))):
            xs = [i + (j - 0.5) * width for i in range(len(policies))]
            rs = [getattr(c, pick) for c in comparisons]
            kw = dict(width=width, color=_color(j), label=name)
            ax_h.bar(xs, [100 * r.hit_rate for r in rs], **kw)
            ax_c.bar(xs, [r.copies_per_token for r in rs], **kw)
        for i, c in enumerate(comparisons):  # global minus split above each pair
            top = 100 * max(c.split.hit_rate, c.shared.hit_rate)
            ax_h.annotate(f"{c.hit_rate_diff_pp:+.1f} pp", (i, top), textcoords="offset points", xytext=(0, 4),
                          ha="center", fontsize=8)
            top = max(c.split.copies_per_token, c.shared.copies_per_token)
            ax_c.annotate(f"{c.copies_per_token_diff:+.2f}", (i, top), textcoords="offset points", xytext=(0, 4),
                          ha="center", fontsize=8)
        for ax in fig.axes:
            ax.set_xticks(range(len(policies)), [labels[p].replace(" (", "\n(") for p in policies])
            ax.set_xlabel("policy")
        budget = f"{caps[0]} experts per layer = {L * caps[0]} shared"
    else:
        for i, name in enumerate(policies):
            rows = [c for c in comparisons if c.policy == name]
            x = [c.capacity for c in rows]
            for pick, ls, tag in (("shared", "-", "global"), ("split", "--", "split")):
                rs = [getattr(c, pick) for c in rows]
                kw = dict(color=_color(i), linestyle=ls, marker="o" if ls == "-" else "s", markersize=3,
                          label=f"{labels[name]}, {tag}")
                ax_h.plot(x, [100 * r.hit_rate for r in rs], **kw)
                ax_c.plot(x, [r.copies_per_token for r in rs], **kw)
        for ax in fig.axes:
            ax.set_xlabel(f"capacity per layer (experts; global pool = {L} x this)")
        budget = f"{caps[0]}..{caps[-1]} experts per layer"
    note = " (labels: global minus split)" if len(caps) == 1 else ""
    ax_h.set(ylabel="hit rate (% of scored requests)", title="Hit rate" + note)
    ax_c.set(ylabel="steady copies per token (all layers)", title="Copies per token" + note)
    for ax in fig.axes:
        ax.grid(True, alpha=0.3, axis="y" if len(caps) == 1 else "both")
        ax.legend(fontsize=8)
    window = f"warm {first.split.warm:g}" if first.split.warm else "no warm window"
    fig.suptitle(f"{trace}: global pool vs per-layer split at equal budget ({budget}, {L} layers, {window})")
    return _save(fig, path, fmt)


FACTOR_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_frontier(points: Sequence[dict], path: str | os.PathLike, *, factors: Sequence[int], tau_ms: float,
                  tolerance: float, winners: Sequence[str], model: str, title: str) -> Path:
    """Quality against speed (:func:`expertcache.costmodel.choose.frontier`): dNLL (nats) against
    predicted tokens/s at ``factor x tau`` for each factor, one colour per policy, one marker per
    factor (hollow: a rule replayed from a trace); the tolerance as a dashed line and each factor's
    winner ringed, as in the eviction paper's Figure 1. ``model``: ``"c + rho x tau"`` or
    ``"max(c, rho x tau)"``."""
    fmt = plot_format(path)
    fig = frontier_figure(points, factors=factors, tau_ms=tau_ms, tolerance=tolerance, winners=winners, model=model,
                          title=title)
    return _save(fig, path, fmt)


def dodge_points(points: Sequence[dict], step: float = 6.0, close: float = 0.015) -> list[float]:
    """Vertical offsets in points, one per policy, that spread the policies whose dNLL lie within
    ``close`` of the plotted dNLL range of each other (chained in dNLL order: e.g. every lossless
    rule near 0) symmetrically around their place, ``step`` apart and in dNLL order; 0 for a policy
    alone. Only the drawing moves: the axis still reads each true dNLL."""
    order = sorted(range(len(points)), key=lambda i: (float(points[i]["dnll"]), i))
    values = [float(points[i]["dnll"]) for i in order]
    span = (max(values) - min(min(values), 0.0)) if values else 0.0
    gap = close * span if span > 0 else 0.0
    groups, out = [], [0.0] * len(points)
    for i, v in zip(order, values):
        if groups and v - groups[-1][-1][1] <= gap:
            groups[-1].append((i, v))
        else:
            groups.append([(i, v)])
    for members in groups:
        for j, (i, _) in enumerate(members):
            out[i] = (j - (len(members) - 1) / 2) * step
    return out


def frontier_figure(points: Sequence[dict], *, factors: Sequence[int], tau_ms: float, tolerance: float,
                    winners: Sequence[str], model: str, title: str):
    """The figure of :func:`plot_frontier`; policies on the same dNLL are drawn a few points apart
    (:func:`dodge_points`) so their markers do not hide each other."""
    from matplotlib.transforms import offset_copy

    fig = _figure(1, width=10, height=5.6)
    ax = fig.axes[0]
    offsets = dodge_points(points)
    for i, p in enumerate(points):
        color = _color(i)
        shift = offset_copy(ax.transData, fig=fig, x=0, y=offsets[i], units="points")
        label = policy_label(p["policy"], p["needs_future"]) + (" (replayed)" if p["replayed"] else "")
        xs = p["tokens_per_s"]
        ax.plot([x for x in xs if x is not None], [p["dnll"]] * sum(x is not None for x in xs), color=color,
                linewidth=0.8, alpha=0.5, label=label)[0].set_transform(shift)
        for k, x in enumerate(xs):
            if x is not None:
                ax.plot([x], [p["dnll"]], linestyle="none", marker=FACTOR_MARKERS[k % len(FACTOR_MARKERS)],
                        markersize=6, alpha=0.9, markeredgecolor=color,
                        markerfacecolor="none" if p["replayed"] else color)[0].set_transform(shift)
                if p["policy"] == winners[k]:
                    ax.plot([x], [p["dnll"]], linestyle="none", marker="o", markersize=15, markerfacecolor="none",
                            markeredgecolor="black", markeredgewidth=1.2)[0].set_transform(shift)
    ax.axhline(tolerance, color="0.3", linestyle="--", linewidth=1)
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    keys = [Line2D([], [], linestyle="none", marker=FACTOR_MARKERS[k % len(FACTOR_MARKERS)], color="0.3",
                   label=f"tau x{n:g} = {n * tau_ms:.3g} ms") for k, n in enumerate(factors)]
    keys += [Line2D([], [], linestyle="none", marker="o", markersize=12, markerfacecolor="none", color="black",
                    label="fastest admissible"),
             Line2D([], [], color="0.3", linestyle="--", label=f"tolerance {tolerance:g} nats")]
    fig.legend(handles=ax.get_legend_handles_labels()[0], title="policy", fontsize=8, loc="outside right upper")
    fig.legend(handles=keys, title="copy time", fontsize=8, loc="outside right lower")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel=f"predicted tokens/s = 1000 / ({model}), log scale",
           ylabel="dNLL: NLL minus the all-resident NLL (nats)")
    ax.grid(True, alpha=0.3)
    ax.set_title(title + ("\n(policies of nearly equal dNLL drawn a few points apart)" if any(offsets) else ""), fontsize=10)
    return fig


# ---------------------------------------------------------------------------------- helpers
def _figure(panels: int, width: float = 6.4, height: float = 4.8):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - depends on the install
        raise ConfigError("plot: matplotlib is not installed (pip install 'expertcache[plot]')") from None
    fig = Figure(figsize=(width * panels, height), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots(1, panels)
    return fig


def _save(fig, path, fmt: str) -> Path:
    path = Path(path)
    with atomic_open(path, "wb", option="--plot") as fh:
        fig.savefig(fh, format=fmt, dpi=DPI)
    return path


def _color(i: int) -> str:
    return f"C{i % 10}"


def _unit(pool: str) -> str:
    return "experts in the global pool" if pool == "global" else "experts per layer"


def _capacity_label(pool: str) -> str:
    return f"capacity ({_unit(pool)})"


def _pct(share: float) -> str:
    return f"{round(100 * share)}%"  # an int: no "-0%"


def _layers(layers: Sequence[int]) -> str:
    """``'8 layers replayed: 0,2,4,6,8,10,12,14'``, runs as ranges (``0-15``), long lists cut."""
    ids = sorted(int(x) for x in layers)
    text = id_ranges(ids)
    if len(text) > 40:
        text = text[:37].rsplit(",", 1)[0] + ",..."
    return f"{len(ids)} layer{'s' if len(ids) != 1 else ''} replayed: {text}"


def _setup(r) -> str:
    pool = "global pool" if r.pool == "global" else "per-layer pools"
    window = f"warm {r.warm:g}" if r.warm else "whole streams scored"
    reset = "reset per sequence" if r.reset == "sequence" else "no reset"
    return f"{pool}, {reset}, {window}"
