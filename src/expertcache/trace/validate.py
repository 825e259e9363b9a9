"""Validation of a trace's arrays and metadata: the one place that decides what a valid trace is.

Every way a :class:`~expertcache.trace.Trace` comes to exist (a file, arrays, an importer) passes
through :func:`build`, so every command accepts and rejects the same traces. A failure is a
:class:`~expertcache.errors.TraceError` whose one-line message names the file, the field and the
first bad index.

Limits (so that per-item tables always fit in memory; see docs/semantics.md):

* ``num_experts`` E is at most :data:`MAX_EXPERTS` (1,048,576);
* at most :data:`MAX_LAYERS` (4,096) layers, layer ids in ``[0, 2**31)``;
* ``L * E`` (the item space of one global pool) at most :data:`MAX_ITEMS` (4,194,304);
* the meta JSON at most :data:`MAX_META_CHARS` characters;
* ``expert_bytes`` (optional) at most :data:`MAX_EXPERT_BYTES`.

On success arrays are canonical, whatever integer width or byte order the file used:
``experts`` int16 when E fits (else int32), ``seq`` and ``step`` int64, everything C-ordered in
native byte order.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import TraceError, is_int
from .model_signals import SIGNAL_EXTRAS, check_signal_extra, check_signal_pairs
from .units import UNIT_EXTRAS, check_unit_extra

PHASES = ("decode", "prefill", "teacher-forced", "mixed", "unknown")
MAX_EXPERTS = 1 << 20
MAX_LAYERS = 1 << 12
MAX_ITEMS = 1 << 22
MAX_LAYER_ID = (1 << 31) - 1
MAX_META_CHARS = 1 << 24
MAX_EXPERT_BYTES = 10**13
"""Largest ``expert_bytes`` (10 TB): beyond it no sizing figure is a plan (the cost model's bound)."""

_INT_META = ("num_experts", "top_k", "num_layers", "tokens", "sequences")
_WHAT = {"top_k": "k", "num_layers": "L", "tokens": "T", "sequences": "distinct runs of seq"}


def parse_meta(text: str, src: str) -> dict:
    """The meta JSON object, or a one-line TraceError (too long, too deep, giant numbers, not an object)."""
    if len(text) > MAX_META_CHARS:
        raise TraceError(f"{src}: meta: {len(text):,} characters of JSON (at most {MAX_META_CHARS:,})")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{src}: meta: not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise TraceError(f"{src}: meta: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise TraceError(f"{src}: meta: not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{src}: meta: expected a JSON object, got {type(meta).__name__}")
    return meta


def check(arrays: dict[str, np.ndarray], meta: dict, src: str, *, fill_meta: bool) -> dict:
    """Validate arrays + meta and return a Trace's fields (``Trace(**check(...))``, as
    :mod:`.core` builds every trace). With ``fill_meta`` missing keys are derived."""
    arrays = dict(arrays)
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise TraceError(f"{src}: {name}: expected an array, got {type(arr).__name__}")
        if arr.dtype.hasobject:
            raise TraceError(f"{src}: {name}: object arrays are not allowed in a trace")
    if "experts" not in arrays:
        raise TraceError(f"{src}: experts: missing (a trace needs 'experts' [T, L, k] and 'seq' [T])")
    experts = arrays.pop("experts")
    if experts.ndim != 3:
        raise TraceError(f"{src}: experts: expected rank 3 [tokens, layers, k], got shape {experts.shape}")
    if experts.dtype.kind not in "iu":
        raise TraceError(f"{src}: experts: expected an integer dtype, got {experts.dtype}")
    T, L, k = experts.shape
    if T == 0 or L == 0 or k == 0:
        raise TraceError(f"{src}: experts: empty shape {experts.shape}")
    if L > MAX_LAYERS:
        raise TraceError(f"{src}: experts: {L:,} layers (at most {MAX_LAYERS:,})")

    if "seq" not in arrays:
        if not fill_meta:
            raise TraceError(f"{src}: seq: missing (expected int [{T}] sequence ids)")
        arrays["seq"] = np.zeros(T, dtype=np.int64)
    seq = arrays.pop("seq")
    if seq.ndim != 1 or seq.shape[0] != T:
        raise TraceError(f"{src}: seq: expected shape ({T},), got {seq.shape}")
    if seq.dtype.kind not in "iu":
        raise TraceError(f"{src}: seq: expected an integer dtype, got {seq.dtype}")
    given, seq = seq, _as_int64(seq)
    bounds = seq_bounds(seq)
    _check_contiguous(given, bounds[:-1], src)  # named as given: a uint64 id above 2**63 is not wrapped

    meta = dict(meta)
    _check_meta_types(meta, src)
    if "num_experts" not in meta:
        if not fill_meta:
            raise TraceError(f"{src}: meta: missing 'num_experts'")
        top = int(experts.max())
        if top >= MAX_EXPERTS:
            _check_ids(experts, MAX_EXPERTS, src)
        meta["num_experts"] = top + 1 if top >= 0 else 1
        meta["num_experts_inferred"] = True
    E = meta["num_experts"]
    if L * E > MAX_ITEMS:
        raise TraceError(
            f"{src}: meta: {L:,} layers x {E:,} experts is more than {MAX_ITEMS:,} (layer, expert) items"
        )
    experts = _check_ids(experts, E, src)

    probs = arrays.pop("probs", None)
    if probs is not None:
        probs = _check_float(probs, experts.shape, "probs", src, mask=experts >= 0, upper=None)
    router_probs = arrays.pop("router_probs", None)
    if router_probs is not None:
        router_probs = _check_float(router_probs, (T, L, E), "router_probs", src, upper=1.0)

    _check_derived_meta(meta, {"num_experts": E, "top_k": k, "num_layers": L, "tokens": T,
                               "sequences": len(bounds) - 1}, src)
    extras = {name: _check_extra(name, arr, bounds, T, L, src) for name, arr in arrays.items()}
    check_signal_pairs(extras, src)
    return dict(experts=experts, seq=seq, meta=meta, probs=probs, router_probs=router_probs, extras=extras, source=src)


# ---------------------------------------------------------------------- meta
def _check_derived_meta(meta: dict, derived: dict, src: str) -> None:
    """Fill or check (in place) the meta keys the arrays determine (``derived``), the layer ids and
    the phase."""
    L = derived["num_layers"]
    for key, value in derived.items():
        if key not in meta:
            meta[key] = value
        elif meta[key] != value:
            raise TraceError(
                f"{src}: meta: {key} = {meta[key]!r} contradicts the arrays ({_WHAT.get(key, key)} = {value})"
            )
    if "layer_ids" not in meta:
        meta["layer_ids"] = list(range(L))
    lids = meta["layer_ids"]
    if (
        not isinstance(lids, list)
        or len(lids) != L
        or not all(is_int(x, 0, MAX_LAYER_ID) for x in lids)
        or len(set(lids)) != L
    ):
        shown = repr(lids) if len(repr(lids)) < 200 else repr(lids)[:200] + "..."
        raise TraceError(f"{src}: meta: layer_ids must be {L} distinct integers in [0, 2**31), got {shown}")
    meta.setdefault("phase", "unknown")
    if meta["phase"] not in PHASES:
        raise TraceError(f"{src}: meta: phase {meta['phase']!r} is not one of {', '.join(PHASES)}")


def _check_meta_types(meta: dict, src: str) -> None:
    """Known keys have the documented types: counts are JSON integers (not 8.0, not true)."""
    for key in _INT_META:
        if key in meta and not is_int(meta[key], 1):
            raise TraceError(f"{src}: meta: {key} must be a positive integer, got {_short(meta[key])}")
    if "num_experts" in meta and meta["num_experts"] > MAX_EXPERTS:
        raise TraceError(f"{src}: meta: num_experts = {meta['num_experts']:,} is more than the limit of {MAX_EXPERTS:,}")
    if "expert_bytes" in meta and not is_int(meta["expert_bytes"], 1, MAX_EXPERT_BYTES):
        raise TraceError(f"{src}: meta: expert_bytes must be a positive integer up to 10**13, "
                         f"got {_short(meta['expert_bytes'])}")
    for key in ("name", "model"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise TraceError(f"{src}: meta: {key} must be a string, got {_short(meta[key])}")
    if "num_experts_inferred" in meta and not isinstance(meta["num_experts_inferred"], bool):
        raise TraceError(f"{src}: meta: num_experts_inferred must be true or false, got {_short(meta['num_experts_inferred'])}")
    if "phase" in meta and not isinstance(meta["phase"], str):
        raise TraceError(f"{src}: meta: phase must be a string, got {_short(meta['phase'])}")


def _short(x: Any) -> str:
    text = repr(x) if not isinstance(x, int) or x.bit_length() < 256 else f"an integer of {x.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------- arrays
def _as_int64(arr: np.ndarray) -> np.ndarray:
    """Integers as native int64; uint64 values that do not fit keep their distinctness (a bijection)."""
    return np.require(arr.astype(np.int64, copy=False), requirements="C")


_CHECK_BLOCK = 1 << 24
"""Ids checked at a time (whole tokens): the checks' temporaries stay near 16 M elements, not
several copies of the whole array (a 1 GB trace would otherwise need about 2 GB more to load)."""


def _check_ids(experts: np.ndarray, E: int, src: str) -> np.ndarray:
    """Ids in ``[0, E)`` or -1, no id twice per (token, layer); returns the compact canonical array.

    The range is checked on the array as stored (numpy compares any integer width with Python
    ints exactly, unsigned included), so the narrowing that follows cannot wrap a value. Both
    checks run over blocks of tokens (:data:`_CHECK_BLOCK`) and report the first bad index in
    C order, as a whole-array check would.
    """
    step = max(1, _CHECK_BLOCK // max(1, experts[0].size))
    for a in range(0, experts.shape[0], step):
        blk = experts[a:a + step]
        bad = (blk < -1) | (blk >= E)
        if bad.any():
            t, l, j = np.argwhere(bad)[0]
            raise TraceError(
                f"{src}: experts: id {blk[t, l, j]} at token {a + t}, layer {l}, slot {j} is outside [0, {E}) "
                f"(num_experts = {E}; -1 is the only padding value)"
            )
    compact = np.require(experts.astype(compact_dtype(E), copy=False), requirements="C")
    if compact.shape[2] > 1:
        for a in range(0, compact.shape[0], step):
            srt = np.sort(compact[a:a + step], axis=2)
            dup = (srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)
            if dup.any():
                t, l, j = np.argwhere(dup)[0]
                raise TraceError(
                    f"{src}: experts: id {int(srt[t, l, j])} appears twice at token {a + t}, layer {l} "
                    f"(ids {compact[a + t, l].tolist()})"
                )
    return compact


def compact_dtype(E: int) -> np.dtype:
    """The narrowest signed dtype holding ids ``-1..E-1``: int16 or int32."""
    return np.dtype(np.int16 if E <= np.iinfo(np.int16).max else np.int32)


def _check_contiguous(seq: np.ndarray, starts: np.ndarray, src: str) -> None:
    """Each sequence id names one run of tokens (``starts``: where the runs begin)."""
    values = seq[starts]
    if np.unique(values).size != values.size:
        seen: set[int] = set()
        for s, v in zip(starts, values):
            if int(v) in seen:
                raise TraceError(
                    f"{src}: seq: sequence {int(v)} resumes at token {int(s)} after other tokens "
                    "(each sequence's tokens must be contiguous)"
                )
            seen.add(int(v))


def _check_float(arr, shape, name, src, mask=None, upper=None) -> np.ndarray:
    """Finite, non-negative floats of the given shape (at most ``upper`` when given)."""
    if arr.dtype.kind != "f":
        raise TraceError(f"{src}: {name}: expected a float dtype, got {arr.dtype}")
    if arr.shape != tuple(shape):
        raise TraceError(f"{src}: {name}: expected shape {tuple(shape)}, got {arr.shape}")
    bad = ~np.isfinite(arr)
    if mask is not None:
        bad &= mask
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TraceError(f"{src}: {name}: non-finite value {arr[idx]} at index {idx}")
    with np.errstate(invalid="ignore"):
        low = arr < 0
        if upper is not None:
            low |= arr > upper * (1 + 1e-3)
    if mask is not None:
        low &= mask
    if low.any():
        idx = tuple(int(i) for i in np.argwhere(low)[0])
        span = f"[0, {upper:g}]" if upper is not None else "non-negative"
        raise TraceError(f"{src}: {name}: value {arr[idx]} at index {idx} is outside {span}")
    return arr


def _check_extra(name: str, arr: np.ndarray, bounds: np.ndarray, T: int, L: int, src: str) -> np.ndarray:
    """Extras are kept as they are, except those with a documented meaning (``step``, ``aligned``,
    and the engine units ``iteration``, ``accepted``, ``pass_kind``: :mod:`.units`)."""
    if name in UNIT_EXTRAS:
        return check_unit_extra(name, arr, bounds, T, src)
    if name in SIGNAL_EXTRAS:  # model-side signals (.model_signals)
        return check_signal_extra(name, arr, T, src)
    if name == "step":
        if arr.shape != (T,) or arr.dtype.kind not in "iu":
            raise TraceError(f"{src}: step: expected integer shape ({T},), got {arr.dtype} {arr.shape}")
        step = _as_int64(arr)
        first = np.zeros(T, dtype=bool)
        first[bounds[:-1]] = True
        bad = np.flatnonzero(~first[1:] & (step[1:] <= step[:-1])) + 1
        if bad.size:
            t = int(bad[0])
            raise TraceError(
                f"{src}: step: not increasing inside a sequence at token {t} "
                f"(step {int(step[t - 1])} then {int(step[t])})"
            )
        return step
    if name == "aligned" and (arr.shape != (T, L) or arr.dtype.kind != "b"):
        raise TraceError(f"{src}: aligned: expected bool shape ({T}, {L}), got {arr.dtype} {arr.shape}")
    return arr


def seq_bounds(seq: np.ndarray) -> np.ndarray:
    """``[S + 1]`` token offsets of the sequences (runs of equal ``seq``)."""
    if seq.size == 0:
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    return np.r_[starts, seq.size].astype(np.int64)
