"""The canonical router trace: which experts each token used at each MoE layer.

On disk a trace is a ``.npz`` archive (no pickle) holding

=================  =====================  ==========================================================
array              dtype / shape          meaning
=================  =====================  ==========================================================
``experts``        int ``[T, L, k]``      expert ids of token t at layer l, router order; -1 pads
``seq``            int ``[T]``            sequence id; each sequence's tokens contiguous, in order
``probs``          float ``[T, L, k]``    optional: gate weights of those experts
``router_probs``   float ``[T, L, E]``    optional: the full router softmax
``meta``           0-d unicode string     JSON: model, num_experts, top_k, num_layers, layer_ids,
                                          tokens, sequences, phase, provenance, ...
anything else      any                    kept as an extra (e.g. ``step``, ``aligned``)
=================  =====================  ==========================================================

Every load validates the archive and reports the first problem in one line naming the file, the
field and the index (:class:`~expertcache.errors.TraceError`).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .._io import atomic_open
from ..errors import ConfigError, TraceError

PHASES = ("decode", "prefill", "teacher-forced", "mixed", "unknown")
CORE_ARRAYS = ("experts", "seq", "probs", "router_probs")


@dataclass(frozen=True, eq=False)
class Trace:
    """Router decisions of one model over one or more sequences.

    Invariants (checked on construction and load): ``experts`` is an integer ``[T, L, k]`` array
    with ids in ``[0, num_experts)`` or -1 (padding), no id twice in one (token, layer);
    ``seq`` has one entry per token and each sequence's tokens are contiguous; ``probs`` matches
    ``experts`` in shape; ``router_probs`` is ``[T, L, num_experts]``; ``meta`` agrees with the
    arrays. Use :meth:`from_arrays` to build one; the dataclass constructor does not validate.
    """

    experts: np.ndarray
    seq: np.ndarray
    meta: dict
    probs: np.ndarray | None = None
    router_probs: np.ndarray | None = None
    extras: dict = field(default_factory=dict)
    source: str = "<arrays>"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(
        cls,
        experts: Any,
        seq: Any = None,
        *,
        num_experts: int | None = None,
        probs: Any = None,
        router_probs: Any = None,
        meta: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
        source: str = "<arrays>",
    ) -> "Trace":
        """Validate arrays and fill the metadata that follows from them.

        ``experts`` may be ``[T, L, k]`` or ``[T, k]`` (one layer). ``seq`` defaults to a single
        sequence. ``num_experts`` defaults to ``meta['num_experts']`` or, failing that, the
        largest id + 1 (recorded as ``num_experts_inferred``).
        """
        experts = np.asarray(experts)
        if experts.ndim == 2:
            experts = experts[:, None, :]
            if probs is not None:
                probs = np.asarray(probs)[:, None, :]
        meta = dict(meta or {})
        if num_experts is not None:
            meta["num_experts"] = int(num_experts)
        if seq is None and experts.ndim >= 1:
            seq = np.zeros(experts.shape[0], dtype=np.int32)
        arrays = {"experts": experts, "seq": np.asarray(seq)}
        if probs is not None:
            arrays["probs"] = np.asarray(probs)
        if router_probs is not None:
            arrays["router_probs"] = np.asarray(router_probs)
        for name, value in (extras or {}).items():
            arrays[name] = np.asarray(value)
        return _build(arrays, meta, source, fill_meta=True)

    # ------------------------------------------------------------------ shape
    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def layer_ids(self) -> list[int]:
        return list(self.meta["layer_ids"])

    @property
    def num_sequences(self) -> int:
        return len(self.seq_bounds) - 1

    @property
    def seq_bounds(self) -> np.ndarray:
        """``[S + 1]`` token offsets: sequence i is tokens ``seq_bounds[i]:seq_bounds[i+1]``."""
        return _seq_bounds(self.seq)

    @property
    def num_requests(self) -> int:
        """Expert requests over all tokens and layers (padding excluded)."""
        return int(np.count_nonzero(self.experts >= 0))

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or Path(self.source).parent.name or self.source)

    def __repr__(self) -> str:
        return (
            f"Trace({self.name!r}: T={self.num_tokens} tokens, S={self.num_sequences} sequences, "
            f"L={self.num_layers} layers, k={self.top_k}, E={self.num_experts}, "
            f"phase={self.meta.get('phase', 'unknown')})"
        )

    # ------------------------------------------------------------------ views
    def layer_index(self, layers: Iterable[int] | None) -> np.ndarray:
        """Column indices of the given layer ids (``None``: all layers)."""
        ids = self.layer_ids
        if layers is None:
            return np.arange(self.num_layers)
        out = []
        for lid in layers:
            if lid not in ids:
                raise TraceError(f"{self.source}: layers: layer {lid} is not in this trace (layer ids {_ranges(ids)})")
            out.append(ids.index(lid))
        if len(set(out)) != len(out):
            raise TraceError(f"{self.source}: layers: a layer is named twice in {list(layers)}")
        return np.asarray(sorted(out), dtype=np.int64)

    def select_layers(self, layers: Iterable[int] | None) -> "Trace":
        """A trace holding only the given layer ids, in trace order."""
        if layers is None:
            return self
        cols = self.layer_index(layers)
        meta = dict(self.meta)
        meta["layer_ids"] = [self.layer_ids[c] for c in cols]
        meta["num_layers"] = len(cols)
        extras = {
            k: (v[:, cols] if v.ndim >= 2 and v.shape[:2] == self.experts.shape[:2] else v)
            for k, v in self.extras.items()
        }
        return Trace(
            experts=self.experts[:, cols],
            seq=self.seq,
            meta=meta,
            probs=None if self.probs is None else self.probs[:, cols],
            router_probs=None if self.router_probs is None else self.router_probs[:, cols],
            extras=extras,
            source=self.source,
        )

    def select_sequences(self, index: Sequence[int]) -> "Trace":
        """A trace holding the sequences at the given positions (0-based, in trace order)."""
        bounds = self.seq_bounds
        rows = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in index]) if len(index) else np.zeros(0, int)
        meta = dict(self.meta)
        meta["tokens"] = int(rows.size)
        meta["sequences"] = len(index)
        extras = {k: (v[rows] if v.ndim >= 1 and v.shape[0] == self.num_tokens else v) for k, v in self.extras.items()}
        return Trace(
            experts=self.experts[rows],
            seq=self.seq[rows],
            meta=meta,
            probs=None if self.probs is None else self.probs[rows],
            router_probs=None if self.router_probs is None else self.router_probs[rows],
            extras=extras,
            source=self.source,
        )

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> Path:
        """Write the canonical ``.npz`` atomically (temp file + rename); returns the path."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {"experts": _compact_ids(self.experts, self.num_experts), "seq": self.seq.astype(np.int32)}
        if self.probs is not None:
            arrays["probs"] = self.probs
        if self.router_probs is not None:
            arrays["router_probs"] = self.router_probs
        arrays.update(self.extras)
        arrays["meta"] = np.array(json.dumps(self.meta, sort_keys=False))
        with atomic_open(path, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        return path


# ---------------------------------------------------------------------- loading
def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a canonical trace (``.npz``), such as those in ``shared/traces``.

    ``path`` may be the ``.npz`` file or a folder holding ``routing.npz``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "routing.npz"
    src = str(path)
    if not p.exists():
        raise TraceError(f"{src}: no such file")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, zipfile.LargeZipFile) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(f"{src}: not a readable .npz trace ({reason})") from None
    meta_arr = arrays.pop("meta", None)
    meta: dict = {}
    if meta_arr is not None:
        if meta_arr.dtype.kind not in "US" or meta_arr.ndim != 0:
            raise TraceError(f"{src}: meta: expected a 0-d JSON string, got {meta_arr.dtype} {meta_arr.shape}")
        try:
            meta = json.loads(str(meta_arr))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{src}: meta: not valid JSON ({exc.msg} at char {exc.pos})") from None
        if not isinstance(meta, dict):
            raise TraceError(f"{src}: meta: expected a JSON object, got {type(meta).__name__}")
    return _build(arrays, meta, src, fill_meta=meta_arr is None)


def _build(arrays: dict[str, np.ndarray], meta: dict, src: str, *, fill_meta: bool) -> Trace:
    """Validate arrays + meta and return a Trace. With ``fill_meta`` missing keys are derived."""
    for name, arr in arrays.items():
        if arr.dtype == object:
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

    if "seq" not in arrays:
        if fill_meta:
            arrays["seq"] = np.zeros(T, dtype=np.int32)
        else:
            raise TraceError(f"{src}: seq: missing (expected int [{T}] sequence ids)")
    seq = arrays.pop("seq")
    if seq.ndim != 1 or seq.shape[0] != T:
        raise TraceError(f"{src}: seq: expected shape ({T},), got {seq.shape}")
    if seq.dtype.kind not in "iu":
        raise TraceError(f"{src}: seq: expected an integer dtype, got {seq.dtype}")
    _check_contiguous(seq, src)

    meta = dict(meta)
    if "num_experts" not in meta:
        if not fill_meta:
            raise TraceError(f"{src}: meta: missing 'num_experts'")
        meta["num_experts"] = int(experts.max()) + 1 if experts.max() >= 0 else 1
        meta["num_experts_inferred"] = True
    E = meta["num_experts"]
    if not isinstance(E, int) or isinstance(E, bool) or E <= 0:
        raise TraceError(f"{src}: meta: num_experts must be a positive integer, got {E!r}")
    _check_ids(experts, E, src)

    probs = arrays.pop("probs", None)
    if probs is not None:
        _check_float(probs, experts.shape, "probs", src, mask=experts >= 0)
    router_probs = arrays.pop("router_probs", None)
    if router_probs is not None:
        _check_float(router_probs, (T, L, E), "router_probs", src)

    n_seq = len(_seq_bounds(seq)) - 1
    derived = {"num_experts": E, "top_k": k, "num_layers": L, "tokens": T, "sequences": n_seq}
    for key, value in derived.items():
        if key not in meta:
            meta[key] = value
        elif meta[key] != value:
            what = {"top_k": "k", "num_layers": "L", "tokens": "T", "sequences": "distinct runs of seq"}.get(key, key)
            raise TraceError(f"{src}: meta: {key} = {meta[key]!r} contradicts the arrays ({what} = {value})")
    if "layer_ids" not in meta:
        meta["layer_ids"] = list(range(L))
    lids = meta["layer_ids"]
    if (
        not isinstance(lids, list)
        or len(lids) != L
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in lids)
        or len(set(lids)) != L
    ):
        raise TraceError(f"{src}: meta: layer_ids must be {L} distinct integers, got {lids!r}")
    meta.setdefault("phase", "unknown")
    if meta["phase"] not in PHASES:
        raise TraceError(f"{src}: meta: phase {meta['phase']!r} is not one of {', '.join(PHASES)}")
    return Trace(experts=experts, seq=seq, meta=meta, probs=probs, router_probs=router_probs, extras=arrays, source=src)


# ---------------------------------------------------------------------- checks
def _check_ids(experts: np.ndarray, E: int, src: str) -> None:
    bad = (experts < -1) | (experts >= E)
    if bad.any():
        t, l, j = np.argwhere(bad)[0]
        raise TraceError(
            f"{src}: experts: id {int(experts[t, l, j])} at token {t}, layer {l}, slot {j} is outside [0, {E}) "
            f"(num_experts = {E}; -1 is the only padding value)"
        )
    srt = np.sort(experts, axis=2)
    dup = (srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)
    if dup.any():
        t, l, j = np.argwhere(dup)[0]
        raise TraceError(
            f"{src}: experts: id {int(srt[t, l, j])} appears twice at token {t}, layer {l} "
            f"(ids {experts[t, l].tolist()})"
        )


def _check_contiguous(seq: np.ndarray, src: str) -> None:
    if seq.size == 0:
        return
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
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


def _check_float(arr: np.ndarray, shape: tuple, name: str, src: str, mask: np.ndarray | None = None) -> None:
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


def _seq_bounds(seq: np.ndarray) -> np.ndarray:
    if seq.size == 0:
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    return np.r_[starts, seq.size].astype(np.int64)


def _compact_ids(experts: np.ndarray, E: int) -> np.ndarray:
    dtype = np.int16 if E <= np.iinfo(np.int16).max else np.int32
    return experts.astype(dtype, copy=False)


def _ranges(ids: Sequence[int]) -> str:
    if len(ids) > 8:
        return f"{ids[0]}..{ids[-1]} ({len(ids)} layers)"
    return ", ".join(map(str, ids))


def parse_layers(spec: str | None) -> list[int] | None:
    """Parse ``"4-8"``, ``"4,5,6"`` or ``"2,4-6"`` into layer ids (``None``/``"all"``: every layer)."""
    if spec is None or spec.strip() in ("", "all"):
        return None
    out: list[int] = []
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part[1:]:
                a, b = part.split("-", 1) if not part.startswith("-") else (part, "")
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ConfigError(f"--layers: cannot read {spec!r} (expected e.g. '4-8' or '4,5,11')") from None
    return out

