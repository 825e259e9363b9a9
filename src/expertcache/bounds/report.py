"""The sandwich ``B_flat <= B* <= B_greedy`` on a recorded trace, per stream and in total.

All three are steady copies (``max(0, copies_total - C)`` per stream, docs/design.md section 2), summed
over streams:

* ``b_flat``: per stream, the largest MIN optimum over the flattening orders tried
  (:mod:`.flat`); the order that gave it is kept;
* ``b_greedy``: the ``belady`` policy's count (farthest-future eviction, demand fetch);
* ``b_star`` (optional): the exact optimum (:mod:`.exact`), feasible on small streams only.

A stream is *tight* when ``b_flat == b_greedy``: greedy is then provably optimal on it. The
relative gap of a stream is ``(b_greedy - b_flat) / b_flat`` (0 when both are 0, infinite when only
``b_flat`` is); the certified statement is "belady is within ``(B_greedy - B_flat) / B_flat`` of
the optimum", since ``B*`` lies between the two.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np

from ..errors import ConfigError
from ..sim.layout import StreamLayout, build_layout
from ..sim.replay import check_capacity
from ..trace import Trace
from .exact import DEFAULT_MAX_STATES, exact_stream_totals
from .flat import ORDERS, flat_min_totals
from .streams import distinct_per_stream, steady, stream_totals


@dataclass(frozen=True)
class StreamBound:
    """Bounds of one stream. ``*_total`` count every insertion; ``b_*`` are steady copies."""

    layer: int | None
    sequence: int | None
    tokens: int
    distinct: int
    flat_total: int
    flat_order: str
    greedy_total: int
    b_flat: int
    b_greedy: int
    star_total: int | None = None
    b_star: int | None = None

    @property
    def tight(self) -> bool:
        return self.b_flat == self.b_greedy

    @property
    def gap(self) -> float:
        return relative_gap(self.b_greedy, self.b_flat)

    def to_dict(self) -> dict:
        return {**asdict(self), "tight": self.tight, "gap": self.gap}


@dataclass
class BoundsReport:
    """Bounds of every stream of a trace at one capacity; totals are sums over streams."""

    trace: str
    capacity: int
    pool: str
    reset: str
    layers: list[int]
    orders: tuple[str, ...]
    streams: list[StreamBound] = field(default_factory=list)
    exact: bool = False
    seconds: float = 0.0

    @property
    def b_flat(self) -> int:
        return sum(s.b_flat for s in self.streams)

    @property
    def b_greedy(self) -> int:
        return sum(s.b_greedy for s in self.streams)

    @property
    def b_star(self) -> int | None:
        return sum(s.b_star for s in self.streams) if self.exact else None

    @property
    def streams_tight(self) -> int:
        return sum(s.tight for s in self.streams)

    @property
    def streams_unfilled(self) -> int:
        """Streams requesting at most C distinct items: the pool never fills, every bound is 0."""
        return sum(s.distinct <= self.capacity for s in self.streams)

    @property
    def median_gap(self) -> float:
        return float(np.median([s.gap for s in self.streams])) if self.streams else float("nan")

    @property
    def gap(self) -> float:
        """Certified: belady's steady copies exceed the optimum's by at most this fraction."""
        return relative_gap(self.b_greedy, self.b_flat)

    @property
    def exact_gap(self) -> float | None:
        """With ``exact``: belady's excess over the optimum, as a fraction of the optimum."""
        return relative_gap(self.b_greedy, self.b_star) if self.exact else None

    @property
    def statement(self) -> str:
        if self.b_greedy == self.b_flat:
            text = f"belady is optimal: B_flat = B_greedy = {self.b_greedy:,} steady copies"
        else:
            text = (f"belady is within {100 * self.gap:.2f}% of the optimum "
                    f"({self.b_flat:,} <= B* <= {self.b_greedy:,} steady copies)")
        if self.exact:
            text += f"; exact B* = {self.b_star:,} (belady {100 * self.exact_gap:.2f}% above it)"
        return text

    def orders_used(self) -> dict[str, int]:
        """How many streams took their ``b_flat`` from each flattening order."""
        return {o: sum(s.flat_order == o for s in self.streams) for o in self.orders}

    def to_dict(self, per_stream: bool = True) -> dict:
        out = {
            "trace": self.trace,
            "capacity": self.capacity,
            "b_flat": self.b_flat,
            "b_greedy": self.b_greedy,
            "b_star": self.b_star,
            "streams": len(self.streams),
            "streams_tight": self.streams_tight,
            "streams_unfilled": self.streams_unfilled,
            "median_gap": self.median_gap,
            "gap": self.gap,
            "exact_gap": self.exact_gap,
            "statement": self.statement,
            "b_flat_total": sum(s.flat_total for s in self.streams),
            "b_greedy_total": sum(s.greedy_total for s in self.streams),
            "b_star_total": sum(s.star_total for s in self.streams) if self.exact else None,
            "flat_orders": self.orders_used(),
            "pool": self.pool,
            "reset": self.reset,
            "layers": self.layers,
            "seconds": self.seconds,
        }
        if not self.exact:
            for key in ("b_star", "exact_gap", "b_star_total"):
                del out[key]
        if per_stream:
            out["per_stream"] = [s.to_dict() for s in self.streams]
        return out


def relative_gap(upper: int | None, lower: int | None) -> float:
    """``(upper - lower) / lower``; 0 when equal, infinite when only ``lower`` is 0."""
    if upper == lower:
        return 0.0
    return (upper - lower) / lower if lower else float("inf")


def compute_bounds(
    trace: Trace,
    capacity: int,
    *,
    pool: str = "layer",
    reset: str = "sequence",
    layers: Iterable[int] | None = None,
    orders: Iterable[str] = ORDERS,
    exact: bool = False,
    max_states: int = DEFAULT_MAX_STATES,
) -> BoundsReport:
    """``B_flat``, ``B_greedy`` (and with ``exact``, ``B*``) of every stream of ``trace``.

    Streams are those of :func:`expertcache.sim.build_layout` with the same ``pool``, ``reset``
    and ``layers``. Raises :class:`~expertcache.errors.ConfigError` for a capacity below one
    group's width, or (``exact``) when a stream is too large for the exact program.
    """
    t0 = time.perf_counter()
    orders = (orders,) if isinstance(orders, str) and orders in ORDERS else orders
    if isinstance(orders, str) or not (orders := tuple(orders)) or not all(isinstance(o, str) for o in orders):
        raise ConfigError(f"orders: expected a list of order names (of {', '.join(ORDERS)}), got {str(orders)[:60]}")
    layout = build_layout(trace, pool=pool, reset=reset, layers=layers)
    capacity = check_capacity(layout, capacity)
    labels = _stream_labels(trace, layout)
    flat = flat_min_totals(layout, capacity, orders)
    flat_steady = steady(flat, capacity)
    best = np.argmax(flat_steady, axis=0)  # first order reaching the largest steady count
    greedy = stream_totals(layout, capacity, "belady")
    star = None
    if exact:
        star = exact_stream_totals(layout, capacity, max_states=max_states,
                                   label=lambda s: _describe(labels[s]))
    tokens = np.diff(layout.starts) // layout.steps_per_token
    distinct = distinct_per_stream(layout)
    streams = []
    for s, (layer, sequence) in enumerate(labels):
        o = int(best[s])
        streams.append(StreamBound(
            layer=layer, sequence=sequence, tokens=int(tokens[s]), distinct=int(distinct[s]),
            flat_total=int(flat[o, s]), flat_order=orders[o], greedy_total=int(greedy[s]),
            b_flat=int(flat_steady[o, s]), b_greedy=max(int(greedy[s]) - capacity, 0),
            star_total=None if star is None else int(star[s]),
            b_star=None if star is None else max(int(star[s]) - capacity, 0),
        ))
    return BoundsReport(
        trace=trace.name, capacity=capacity, pool=pool, reset=reset, layers=list(layout.layer_ids),
        orders=orders, streams=streams, exact=exact, seconds=time.perf_counter() - t0,
    )


def _stream_labels(trace: Trace, layout: StreamLayout) -> list[tuple[int | None, int | None]]:
    """``(layer id, sequence id)`` of each stream, in layout order (``None``: not split by it)."""
    seq_ids: list[int | None]
    if layout.reset == "sequence":
        seq_ids = [int(trace.seq[a]) for a in trace.seq_bounds[:-1]]
    else:
        seq_ids = [None]
    if layout.pool == "global":
        return [(None, q) for q in seq_ids]
    return [(lid, q) for lid in layout.layer_ids for q in seq_ids]


def _describe(label: tuple[int | None, int | None]) -> str:
    layer, sequence = label
    parts = ([f"layer {layer}"] if layer is not None else ["the global pool"]) + (
        [f"sequence {sequence}"] if sequence is not None else [])
    return ", ".join(parts)
