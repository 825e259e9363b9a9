"""The independent checker of trace files used by the fuzzer (see ``tests/fuzzing.py``).

Written from the format's definition (docs/semantics.md) with numpy and plain Python loops,
sharing no code with expertcache's loader: when expertcache accepts a file, this must find it
valid too.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np

PHASES = ("decode", "prefill", "teacher-forced", "mixed", "unknown")


def oracle_trace_problem(path: Path) -> str | None:
    """Why the trace file at ``path`` is invalid, or None. Written from the format's definition
    (docs/semantics.md), independently of expertcache's loader; only called on small files that
    expertcache accepted."""
    if path.is_dir():
        path = path / "routing.npz"
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if len(names) != len(set(names)) or not all(n.endswith(".npy") for n in names):
                return "members"
        with np.load(path, allow_pickle=False) as z:
            arrs = {n: z[n] for n in z.files}
    except Exception as exc:  # noqa: BLE001 - the oracle only needs to know it failed
        return f"numpy cannot read it: {type(exc).__name__}"
    if "experts" not in arrs:
        return "missing experts"
    ex = arrs["experts"]
    if ex.ndim != 3 or ex.dtype.kind not in "iu" or 0 in ex.shape:
        return "experts"
    T, L, k = ex.shape
    if "meta" in arrs:
        if "seq" not in arrs:
            return "missing seq"
        if arrs["meta"].ndim != 0 or arrs["meta"].dtype.kind != "U":
            return "meta shape"
        try:
            meta = json.loads(str(arrs["meta"]))
        except (ValueError, RecursionError):
            return "meta JSON"
        if not isinstance(meta, dict):
            return "meta not an object"
    else:  # no meta: everything is derived, E from the largest id
        meta = {"num_experts": max(int(ex.max()) + 1, 1)}
    seq = arrs.get("seq", np.zeros(T, dtype=np.int64))
    if seq.shape != (T,) or seq.dtype.kind not in "iu":
        return "seq"
    runs = [int(seq[0])] + [int(b) for a, b in zip(seq[:-1].tolist(), seq[1:].tolist()) if a != b]
    if len(runs) != len(set(runs)):
        return "seq contiguity"

    def is_int(x):
        return type(x) is int

    E = meta.get("num_experts")
    if not is_int(E) or not 1 <= E <= (1 << 20) or L * E > (1 << 22):
        return "num_experts"
    for key, value in (("top_k", k), ("num_layers", L), ("tokens", T), ("sequences", len(runs))):
        if key in meta and not (is_int(meta[key]) and meta[key] == value):
            return key
    lids = meta.get("layer_ids", list(range(L)))
    if not isinstance(lids, list) or len(lids) != L or len(set(map(repr, lids))) != L:
        return "layer_ids"
    if not all(is_int(x) and 0 <= x < 2**31 for x in lids):
        return "layer_ids values"
    if meta.get("phase", "unknown") not in PHASES:
        return "phase"
    for key in ("name", "model"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return key
    if "expert_bytes" in meta and not (is_int(meta["expert_bytes"]) and 0 < meta["expert_bytes"] <= 10**13):
        return "expert_bytes"
    if "num_experts_inferred" in meta and not isinstance(meta["num_experts_inferred"], bool):
        return "num_experts_inferred"
    for row in ex.reshape(T * L, k).tolist():
        used = [x for x in row if x != -1]
        if any(not 0 <= x < E for x in used) or len(used) != len(set(used)):
            return "ids"
    if "probs" in arrs:
        p = arrs["probs"]
        if p.dtype.kind != "f" or p.shape != ex.shape:
            return "probs"
        for x, e in zip(p.ravel().tolist(), ex.ravel().tolist()):
            if e != -1 and not (math.isfinite(x) and x >= 0):
                return "probs values"
    if "router_probs" in arrs:
        rp = arrs["router_probs"]
        if rp.dtype.kind != "f" or rp.shape != (T, L, E):
            return "router_probs"
        if any(not (math.isfinite(x) and 0 <= x <= 1.001) for x in rp.ravel().tolist()):
            return "router_probs values"
    if "step" in arrs:
        st = arrs["step"]
        if st.shape != (T,) or st.dtype.kind not in "iu":
            return "step"
        vals, s = st.tolist(), seq.tolist()
        if any(s[i] == s[i - 1] and vals[i] <= vals[i - 1] for i in range(1, T)):
            return "step order"
    if "aligned" in arrs and (arrs["aligned"].shape != (T, L) or arrs["aligned"].dtype != bool):
        return "aligned"
    for name, arr in arrs.items():
        if arr.dtype.hasobject:
            return name
    return None
