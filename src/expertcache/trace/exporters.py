"""Exporters: traces as single-request streams for classic cache simulators (libCacheSim).

A classic simulator serves one request at a time, so a token's k experts are *flattened* into k
consecutive requests in a stated order (``router``, ``ascending`` or ``descending`` id). With
several layers the object id is ``layer_id * E + expert`` and requests go token by token, layer by
layer (the order of a global pool). Classic simulators know no sequences: pools carry over.

Two formats:

* ``csv`` -- ``time,obj_id,obj_size`` with a header; ``time`` is the request index, sizes are 1, so
  a libCacheSim cache size counts objects. Read it in libCacheSim's Python package with
  ``TraceReader(path, TraceType.CSV_TRACE, ReaderInitParam(has_header=True, delimiter=",",
  time_col=1, obj_id_col=2, obj_size_col=3))``.
* ``oracle`` -- libCacheSim's ``oracleGeneral`` binary: 24-byte little-endian records
  ``(u32 time, u64 obj_id, u32 size, i64 next access index or -1)``. Its Belady needs the
  next-access field (without it, it silently gives wrong counts). Read it with
  ``TraceReader(path, TraceType.ORACLE_GENERAL_TRACE)``.

For k = 1 the flattened stream *is* the trace, and libCacheSim's LRU and Belady miss counts equal
expertcache's ``copies_total`` with ``reset="none"`` (a tested cross-check). For k > 1 they differ:
a single-request simulator may evict an expert the same token still needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from .._io import atomic_open
from .._jit import njit
from ..errors import ConfigError
from .core import Trace

ORDERS = ("router", "ascending", "descending")
FORMATS = ("csv", "oracle")
ORACLE_DTYPE = np.dtype([("time", "<u4"), ("obj_id", "<u8"), ("size", "<u4"), ("next", "<i8")])
CSV_BLOCK = 1 << 20
"""Requests formatted per block of the csv export (three int64 columns: 24 MB)."""


def flatten_requests(trace: Trace, order: str = "router", layers: Iterable[int] | None = None) -> np.ndarray:
    """int64 object ids of every request, token by token, layer by layer, each group in ``order``."""
    if order not in ORDERS:
        raise ConfigError(f"--order: {order!r} is not one of {', '.join(ORDERS)}")
    cols = trace.layer_index(layers)
    ex = trace.experts[:, cols, :].astype(np.int64)
    if order == "ascending":  # padding (-1) lands anywhere: it is dropped below
        ex = np.sort(ex, axis=2)
    elif order == "descending":
        ex = -np.sort(-ex, axis=2)
    lid = np.asarray([trace.layer_ids[c] for c in cols], dtype=np.int64)[None, :, None]
    obj = np.where(ex >= 0, lid * trace.num_experts + ex, -1).ravel()
    return obj[obj >= 0]


def next_access(obj: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Index of the next request for the same object, or -1 if there is none, written into ``out``
    (int64 ``[n]``, e.g. the records' ``next`` field; a new array when None): one pass from the end,
    remembering each object's latest index, so nothing beyond ``out`` grows with ``n``."""
    obj = np.ascontiguousarray(obj, dtype=np.int64)
    out = np.empty(obj.size, dtype=np.int64) if out is None else out
    _next_access(obj, np.full(int(obj.max()) + 1 if obj.size else 0, -1, dtype=np.int64), out)
    return out


@njit(cache=True)
def _next_access(obj, seen, out):
    for i in range(obj.size - 1, -1, -1):
        out[i] = seen[obj[i]]
        seen[obj[i]] = i


def export_libcachesim(
    trace: Trace,
    out: str | os.PathLike,
    *,
    order: str = "router",
    layers: Iterable[int] | None = None,
    fmt: str = "csv",
) -> int:
    """Write the flattened request stream (atomically); returns the number of requests."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    obj = flatten_requests(trace, order, layers)
    if obj.size >= 2**32:
        raise ConfigError(f"{obj.size} requests exceed the u32 time field of libCacheSim traces")
    with atomic_open(Path(out), "wb") as fh:
        if fmt == "oracle":
            rec = np.empty(obj.size, dtype=ORACLE_DTYPE)
            rec["time"] = np.arange(obj.size, dtype=np.uint32)
            rec["obj_id"] = obj
            rec["size"] = 1
            next_access(obj, rec["next"])
            fh.write(rec.view(np.uint8))  # the records' own bytes, not a copy of them
        else:
            fh.write(b"time,obj_id,obj_size\n")
            for a in range(0, obj.size, CSV_BLOCK):  # rows formatted a block at a time: bounded memory
                o = obj[a:a + CSV_BLOCK]
                np.savetxt(fh, np.column_stack([np.arange(a, a + o.size), o, np.ones(o.size, dtype=np.int64)]),
                           fmt="%d", delimiter=",")
    return int(obj.size)
