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
import re
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .._io import write_npz
from .._text import id_ranges
from ..errors import ConfigError, TraceError, is_int
from .model_signals import SIGNAL_EXTRAS
from .npz import read_npz, resolve_trace_path
from .validate import MAX_LAYER_ID, MAX_LAYERS, check, compact_dtype, parse_meta, seq_bounds

CORE_ARRAYS = ("experts", "seq", "probs", "router_probs")


def _owned(arr: np.ndarray | None, given: list = ()) -> np.ndarray | None:
    """``arr`` made read-only, copied first where it shares memory with one of the caller's arrays
    (``given``): checked once, a trace's arrays never change after (the compiled loops trust the
    ids; a caller's array changed after :meth:`Trace.from_arrays` had made a checked id invalid:
    a segfault)."""
    if arr is None:
        return arr
    if any(isinstance(g, np.ndarray) and np.may_share_memory(arr, g) for g in given):  # bounds: never slow
        arr = arr.copy()
    arr.flags.writeable = False
    return arr


def _frozen(fields: dict, given: list = ()) -> dict:
    """:func:`check`'s fields with every array :func:`_owned`."""
    for key in CORE_ARRAYS:
        fields[key] = _owned(fields[key], given)
    fields["extras"] = {name: _owned(arr, given) for name, arr in fields["extras"].items()}
    return fields


@dataclass(frozen=True, eq=False)
class Trace:
    """Router decisions of one model over one or more sequences.

    Invariants (checked on construction and load; the arrays are then read-only, and
    :meth:`from_arrays` copies any the caller still holds): ``experts`` is an integer ``[T, L, k]`` array
    with ids in ``[0, num_experts)`` or -1 (padding), no id twice in one (token, layer);
    ``seq`` has one entry per token and each sequence's tokens are contiguous; ``probs`` matches
    ``experts`` in shape; ``router_probs`` is ``[T, L, num_experts]``; ``meta`` agrees with the
    arrays (keys it lacks are derived, as :meth:`from_arrays` derives them). :meth:`from_arrays`
    builds one from any arrays; the dataclass constructor checks its fields the same way (before,
    it took them unchecked, and an id past ``num_experts`` reached the compiled loops: a segfault).
    Code that derives a trace from a checked one uses :meth:`_trusted`.
    """

    experts: np.ndarray
    seq: np.ndarray
    meta: dict
    probs: np.ndarray | None = None
    router_probs: np.ndarray | None = None
    extras: dict = field(default_factory=dict)
    source: str = "<arrays>"

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        """The check :meth:`from_arrays` and a direct construction share: the fields checked
        (:func:`check`, missing meta derived) and owned (:func:`_frozen`)."""
        if not isinstance(self.extras, Mapping):
            raise TraceError(f"{self.source}: extras: expected a mapping of name -> array, got "
                             f"{type(self.extras).__name__}")
        if not isinstance(self.meta, Mapping):
            raise TraceError(f"{self.source}: meta: expected a mapping, got {type(self.meta).__name__}")
        arrays = {name: value for name, value in (("experts", self.experts), ("seq", self.seq), ("probs", self.probs),
                                                  ("router_probs", self.router_probs)) if value is not None}
        arrays.update(self.extras)
        given = list(arrays.values())
        fields = _frozen(check({k: np.asarray(v) for k, v in arrays.items()}, dict(self.meta), str(self.source),
                               fill_meta=True), given)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def _trusted(cls, **fields) -> "Trace":
        """A trace from fields already checked (:func:`check`'s, or derived from a checked trace's:
        a selection, a concatenation, a window), without checking them again; not for a caller's
        arrays. Fields left out take their defaults."""
        trace = object.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.name in fields:
                value = fields.pop(f.name)
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(trace, f.name, value)
        if fields:
            raise TypeError(f"Trace._trusted: unknown fields {sorted(fields)}")
        return trace

    def _with(self, **changes) -> "Trace":
        """:meth:`_trusted` with this trace's fields, ``changes`` replacing some (checked by the caller)."""
        return Trace._trusted(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | changes)

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
        if num_experts is not None:  # checked with the meta: 4.7 and "4" had become 4, True 1
            meta["num_experts"] = int(num_experts) if isinstance(num_experts, np.integer) else num_experts
        if seq is None and experts.ndim >= 1:  # else the check names experts' rank (it had blamed a seq of None)
            seq = np.zeros(experts.shape[0], dtype=np.int32)
        return Trace(experts, seq, meta, probs, router_probs, {} if extras is None else extras, source)  # checked there

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
        return seq_bounds(self.seq)

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
        return layer_columns(self.layer_ids, layers, self.source)

    def select_layers(self, layers: Iterable[int] | None) -> "Trace":
        """A trace holding only the given layer ids, in trace order."""
        if layers is None:
            return self
        cols = self.layer_index(layers)
        meta = dict(self.meta)
        meta["layer_ids"] = [self.layer_ids[c] for c in cols]
        meta["num_layers"] = len(cols)
        extras = {
            k: (v[:, cols] if v.ndim >= 2 and v.shape[:2] == self.experts.shape[:2] and k not in SIGNAL_EXTRAS else v)
            for k, v in self.extras.items()
        }
        return Trace._trusted(
            experts=self.experts[:, cols],
            seq=self.seq,
            meta=meta,
            probs=None if self.probs is None else self.probs[:, cols],
            router_probs=None if self.router_probs is None else self.router_probs[:, cols],
            extras=extras,
            source=self.source,
        )

    def select_sequences(self, index: Sequence[int]) -> "Trace":
        """A trace holding the sequences at the given positions (0-based, in the order given), each
        position once and in ``[0, num_sequences)``: a TraceError otherwise (a position named twice had
        merged two copies into one sequence, ``-1`` had given an empty trace, ``-2`` the last one)."""
        index = list(index)
        S = self.num_sequences
        bad = next((i for i in index if not is_int(i, 0, S - 1)), None)
        if not index or bad is not None or len(set(index)) != len(index):
            what = ("no position" if not index else f"position {bad!r} is not in [0, {S})" if bad is not None
                    else "a position is named twice")
            raise TraceError(f"{self.source}: select_sequences: {what} ({S} sequences; got {str(index)[:60]})")
        bounds = self.seq_bounds
        rows = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in index])
        meta = dict(self.meta)
        meta["tokens"] = int(rows.size)
        meta["sequences"] = len(index)
        extras = {k: (v[rows] if v.ndim >= 1 and v.shape[0] == self.num_tokens else v) for k, v in self.extras.items()}
        return Trace._trusted(
            experts=self.experts[rows],
            seq=self.seq[rows],
            meta=meta,
            probs=None if self.probs is None else self.probs[rows],
            router_probs=None if self.router_probs is None else self.router_probs[rows],
            extras=extras,
            source=self.source,
        )

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike, *, compressed: bool = True) -> Path:
        """Write the canonical ``.npz`` atomically (temp file + rename); returns the path.
        ``compressed=False`` stores the arrays (a chunk of a chunked trace: read by copying)."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {
            "experts": self.experts.astype(compact_dtype(self.num_experts), copy=False),
            "seq": _narrow(self.seq),
        }
        if self.probs is not None:
            arrays["probs"] = self.probs
        if self.router_probs is not None:
            arrays["router_probs"] = self.router_probs
        arrays.update(self.extras)
        arrays["meta"] = np.array(json.dumps(self.meta, sort_keys=False))
        write_npz(path, arrays, compressed=compressed)
        return path


# ---------------------------------------------------------------------- loading
def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a canonical trace (``.npz``), such as the real traces this project tests on.

    ``path`` may be the ``.npz`` file or a folder holding ``routing.npz``. The archive is read by
    :func:`~expertcache.trace.npz.read_npz` (sizes checked before allocating, no pickle) and
    validated by :func:`~expertcache.trace.validate.check`; any problem is one
    :class:`~expertcache.errors.TraceError` line naming the file, the field and the index.
    """
    src = str(path)
    arrays = read_npz(resolve_trace_path(path), src)
    meta_arr = arrays.pop("meta", None)
    meta: dict = {}
    if meta_arr is not None:
        if meta_arr.dtype.kind not in "US" or meta_arr.ndim != 0:
            raise TraceError(f"{src}: meta: expected a 0-d JSON string, got {meta_arr.dtype} {meta_arr.shape}")
        try:
            text = str(meta_arr) if meta_arr.dtype.kind == "U" else bytes(meta_arr.item()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(f"{src}: meta: not UTF-8 text (byte {exc.start})") from None
        meta = parse_meta(text, src)
    return Trace._trusted(**_frozen(check(arrays, meta, src, fill_meta=meta_arr is None)))


def layer_columns(ids: list[int], layers: Iterable[int] | None, source: str) -> np.ndarray:
    """Column indices, ascending, of the layer ids ``layers`` among a trace's ``ids`` (``None``: all);
    a layer the trace lacks, or one named twice, is a TraceError naming ``source``."""
    if layers is None:
        return np.arange(len(ids))
    layers = list(layers)
    if not layers:  # an empty list had replayed to 0 copies and nan per token
        raise TraceError(f"{source}: layers: no layer named (None means every layer)")
    out = []
    for lid in layers:
        if lid not in ids:
            raise TraceError(f"{source}: layers: layer {lid} is not in this trace (layer ids {id_ranges(ids)})")
        out.append(ids.index(lid))
    if len(set(out)) != len(out):
        raise TraceError(f"{source}: layers: a layer is named twice in {list(layers)}")
    return np.asarray(sorted(out), dtype=np.int64)


def _narrow(seq: np.ndarray) -> np.ndarray:
    """Sequence ids as int32 when they all fit (the shared traces' dtype), else int64."""
    i32 = np.iinfo(np.int32)
    if seq.size == 0 or (seq.min() >= i32.min and seq.max() <= i32.max):
        return seq.astype(np.int32)
    return seq.astype(np.int64, copy=False)


def parse_layers(spec: str | None) -> list[int] | None:
    """Parse ``"4-8"``, ``"4,5,6"`` or ``"2,4-6"`` into layer ids (``None``/``"all"``: every layer).

    Ids are integers in ``[0, 2**31)``, at most :data:`~expertcache.trace.validate.MAX_LAYERS` of
    them, none twice; anything else is a one-line :class:`~expertcache.errors.ConfigError`.
    """
    if spec is None or spec.strip() in ("", "all"):
        return None
    out: list[int] = []
    for part in spec.split(","):
        m = _LAYER_PART.fullmatch(part.strip())
        if m is None:
            raise ConfigError(f"--layers: cannot read {spec!r} (expected e.g. '4-8' or '4,5,11')")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"--layers: {part.strip()!r} runs backwards")
        if hi > MAX_LAYER_ID or len(out) + hi - lo + 1 > MAX_LAYERS:
            raise ConfigError(f"--layers: {spec!r} names ids beyond 2**31 - 1 or more than {MAX_LAYERS:,} layers")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise ConfigError(f"--layers: {spec!r} names a layer twice")
    return out


_LAYER_PART = re.compile(r"(\d{1,10})(?:\s*-\s*(\d{1,10}))?")
