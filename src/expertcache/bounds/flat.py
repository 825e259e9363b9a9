"""``B_flat``: classical MIN on each stream flattened to single requests (the lower bound).

Flattening lists each group's ids as consecutive single requests, in one of three orders
(:data:`ORDERS`): ``router`` (as recorded), ``ascending`` or ``descending`` id. Every lossless
schedule of the real stream also serves any flattened stream with the same insertions, so the
MIN optimum of each order is a lower bound on ``B*``, and so is the largest of them (docs/design.md
section 2). It is not tight in general: on a flattened stream MIN may evict an item right after
its request within a token, which a lossless schedule may not do.

MIN is computed by the package's own farthest-future rule on a layout whose groups hold one id
each: the only resident a single request protects is itself, and that one is a miss, so every
resident is a candidate and the victim is the one requested farthest ahead -- Belady's classical
MIN, optimal for single requests. (Ties occur only among items never requested again, and do not
change the count.)
"""

from __future__ import annotations

import numpy as np

from ..sim.layout import StreamLayout
from .streams import bare_layout, stream_totals

ORDERS = ("router", "ascending", "descending")


def flatten(layout: StreamLayout, order: str = "router") -> StreamLayout:
    """The streams of ``layout`` as single requests: groups ``[R, 1]``, padding dropped.

    Stream ``s`` of the result is stream ``s`` of ``layout`` with each group's ids listed in
    ``order``; the stream boundaries are kept, so per-stream counts line up.
    """
    groups = layout.groups
    if order == "ascending":
        groups = np.sort(groups, axis=1)  # pads (-1) sort first and are dropped below
    elif order == "descending":
        groups = -np.sort(-groups, axis=1)
    elif order != "router":
        raise ValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
    flat = groups[groups >= 0]  # row-major: each group's ids stay consecutive, in order
    csum = np.concatenate(([0], np.cumsum(layout.requests, dtype=np.int64)))
    return bare_layout(flat, csum[layout.starts], layout.n_items)


def flat_min_totals(layout: StreamLayout, capacity: int, orders=ORDERS) -> np.ndarray:
    """int64 ``[len(orders), S]``: MIN's ``copies_total`` on each stream flattened in each order."""
    return np.stack([stream_totals(flatten(layout, o), capacity, "belady") for o in orders])
