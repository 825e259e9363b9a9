"""Model-side signals a live capture records on request (``expertcache capture --record``), as extras.

One row per trace row (a token position of a batch-1 forward):

==================  ======================  ===============================================================
extra               dtype / shape           meaning
==================  ======================  ===============================================================
``token_ids``       int ``[T]``, >= 0       the input token id of the row
``next_top_ids``    int ``[T, M]``, >= 0    the M most likely next tokens under the model's output softmax
                                            at the row, most likely first
``next_top_probs``  float ``[T, M]``        their probabilities (in [0, 1], non-increasing along a row)
``hidden_summary``  float ``[T, D]``        the final hidden state times a fixed random projection
                                            (``meta["signals"]`` records D and the seed), finite
==================  ======================  ===============================================================

``next_top_ids`` and ``next_top_probs`` come together (same M). Causality, for a policy serving step
``t`` of a row: the input id of the row is known before its forward; the next-token distribution
and the final hidden state of a row exist only after its last layer, so at row ``t`` a causal user
reads them for rows ``< t`` (docs/learn.md, "Model-side signals"). A malformed extra is one
:class:`~expertcache.errors.TraceError` line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import TraceError

SIGNAL_EXTRAS = ("token_ids", "next_top_ids", "next_top_probs", "hidden_summary")


def check_signal_extra(name: str, arr: np.ndarray, T: int, src: str) -> np.ndarray:
    """Validate one of :data:`SIGNAL_EXTRAS` (shapes and dtypes of the table above); returns it
    (int64 for the id arrays)."""
    if name == "token_ids":
        if arr.shape != (T,) or arr.dtype.kind not in "iu":
            raise TraceError(f"{src}: token_ids: expected integer shape ({T},), got {arr.dtype} {arr.shape}")
        return _non_negative_ints(name, arr, src)
    if arr.ndim != 2 or arr.shape[0] != T or arr.shape[1] < 1:
        raise TraceError(f"{src}: {name}: expected shape ({T}, m) with m >= 1, got {arr.dtype} {arr.shape}")
    if name == "next_top_ids":
        if arr.dtype.kind not in "iu":
            raise TraceError(f"{src}: next_top_ids: expected an integer dtype, got {arr.dtype}")
        return _non_negative_ints(name, arr, src)
    if arr.dtype.kind != "f":
        raise TraceError(f"{src}: {name}: expected a float dtype, got {arr.dtype}")
    bad = ~np.isfinite(arr)
    if name == "next_top_probs":
        with np.errstate(invalid="ignore"):
            bad |= (arr < 0) | (arr > 1 + 1e-3)
    if bad.any():
        t, j = (int(i) for i in np.argwhere(bad)[0])
        span = "a probability in [0, 1]" if name == "next_top_probs" else "finite"
        raise TraceError(f"{src}: {name}: value {arr[t, j]} at row {t}, column {j} is not {span}")
    return arr


def check_signal_pairs(extras: dict, src: str) -> None:
    """``next_top_ids`` and ``next_top_probs`` come together, with the same shape."""
    ids, probs = extras.get("next_top_ids"), extras.get("next_top_probs")
    if (ids is None) != (probs is None):
        have, lack = ("next_top_ids", "next_top_probs") if probs is None else ("next_top_probs", "next_top_ids")
        raise TraceError(f"{src}: {lack}: missing ({have} needs it)")
    if ids is not None and ids.shape != probs.shape:
        raise TraceError(f"{src}: next_top_probs: shape {probs.shape} differs from next_top_ids {ids.shape}")


def _non_negative_ints(name: str, arr: np.ndarray, src: str) -> np.ndarray:
    bad = arr < 0
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TraceError(f"{src}: {name}: id {int(arr[idx])} at row {idx[0]} is negative")
    return np.require(arr.astype(np.int64, copy=False), requirements="C")


@dataclass(frozen=True)
class SignalRows:
    """The model-side signals one stream can read (a :class:`~expertcache.trace.context.StreamContext`'s
    ``signals``): the trace's signal extras (whole arrays), the trace row of each step (``rows``, the
    stream's rows span ``first_row..last_row``), the stream's sequence id, and the layer id and expert
    of each item of the stream's pool."""

    extras: dict
    rows: np.ndarray
    first_row: int
    last_row: int
    seq_id: int
    item_layer: np.ndarray
    item_expert: np.ndarray
    num_experts: int


def signal_rows(trace, rows: np.ndarray, layer_cols: np.ndarray) -> SignalRows | None:
    """:class:`SignalRows` of a stream whose steps read trace ``rows`` and whose pool holds the experts of
    columns ``layer_cols`` (one column per-layer; all the layout's columns, ``l * E + e``, global);
    None when the trace has no signal extras or the stream is empty."""
    extras = {k: trace.extras[k] for k in SIGNAL_EXTRAS if k in trace.extras}
    if not extras or rows.size == 0:
        return None
    E = trace.num_experts
    lids = np.asarray(trace.layer_ids, dtype=np.int64)[np.asarray(layer_cols, dtype=np.int64)]
    return SignalRows(extras=extras, rows=np.asarray(rows, dtype=np.int64), first_row=int(rows.min()),
                      last_row=int(rows.max()), seq_id=int(trace.seq[int(rows[0])]),
                      item_layer=np.repeat(lids, E), item_expert=np.tile(np.arange(E, dtype=np.int64), lids.size),
                      num_experts=E)
