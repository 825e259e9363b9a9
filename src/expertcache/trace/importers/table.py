"""The routing table the JSONL importers fill: (sequence, token) -> {layer: (ids, probs)}, then one
canonical :class:`~expertcache.trace.Trace`; or, with :func:`write_table_chunked`, a chunked trace
written while the log is read (:mod:`expertcache.trace.chunked`).

Invariants of the trace built:

* sequences keep the order in which they first appear; tokens are sorted by token index within a
  sequence, gaps kept in the ``step`` extra array; layers are sorted;
* every (sequence, token, layer) was given once; a token lacking a layer is an error unless
  ``drop_incomplete`` drops it (counted in ``meta['validation']``);
* every id list has the same length k, unless ``pad``: then k is the longest and shorter lists
  are padded with -1 (gate weights with NaN, which the trace ignores under padding);
* gate weights were given for every entry or for none.
"""

from __future__ import annotations

import numpy as np

import os
from dataclasses import asdict
from typing import Callable

from ...errors import TraceError
from ..chunked import ChunkWriter, check_chunk_sequences, open_chunked
from ..core import Trace
from .records import display_name
from .values import check_num_experts, check_phase, short


class RoutingTable:
    """Collects routing entries from records; ``names`` maps roles (seq, token, experts, probs) to
    the field names used in messages."""

    def __init__(self, src: str, names: dict[str, str | None], *, pad: bool):
        self.src = src
        self.names = names
        self.pad = pad
        self.seqs: dict[int | str, int] = {}
        self.rows: dict[tuple[int, int], dict[int, tuple[list[int], list[float] | None]]] = {}
        self.layers: set[int] = set()
        self.k: int | None = None
        self.k_where = ""
        self.k_max = 0
        self.k_min = 0
        self.has_probs: bool | None = None
        self.probs_where = ""

    def probs_present(self, present: bool, where: str) -> None:
        """Record whether a record carries gate weights: all records or none must."""
        if self.has_probs is None:
            self.has_probs, self.probs_where = present, where
        elif present != self.has_probs:
            state = "present here but absent" if present else "missing here but present"
            raise TraceError(f"{where}: field '{self.names['probs']}' is {state} at {self.probs_where} (all records or none)")

    def take_k(self, n: int, where: str) -> None:
        """Check an id list's length ``n`` against the first one's (unless ``pad``)."""
        if self.k is None:
            self.k, self.k_where = n, where
        elif n != self.k and not self.pad:
            raise TraceError(
                f"{where}: field '{self.names['experts']}' holds {n} ids where {self.k_where} holds {self.k} "
                "(every id list needs the same length k; --pad pads shorter lists with -1)"
            )
        self.k_max = max(self.k_max, n)
        self.k_min = min(self.k_min, n) if self.k_min else n

    def put(self, slot: dict, seq, tok: int, layer: int, ids: list[int], probs: list[float] | None, where: str) -> None:
        """Store one entry in its token's ``slot`` (a second entry for the layer is an error)."""
        if layer in slot:
            raise TraceError(
                f"{where}: a second entry for {self.names['seq']}={short(seq)}, {self.names['token']}={tok}, layer {layer}"
            )
        slot[layer] = (ids, probs)

    def add(self, seq: int | str, tok: int, layer: int, ids: list[int], probs: list[float] | None, where: str) -> None:
        self.take_k(len(ids), where)
        key = self.seqs.setdefault(seq, len(self.seqs))
        self.put(self.rows.setdefault((key, tok), {}), seq, tok, layer, ids, probs, where)
        self.layers.add(layer)

    def incomplete(self, seq, tok: int, slot: dict, layer_ids: list[int], drop_incomplete: bool) -> dict:
        """A token lacking a layer: the error naming it, or (``drop_incomplete``) its dropped record."""
        if not drop_incomplete:
            missing = next(lid for lid in layer_ids if lid not in slot)
            raise TraceError(
                f"{self.src}: no entry for {self.names['seq']}={short(seq)}, {self.names['token']}={tok}, layer {missing} "
                "(every token needs every layer; --drop-incomplete drops such tokens)"
            )
        return {"seq": seq, "token": tok}

    def build(self, *, num_experts: int | None, drop_incomplete: bool, meta: dict, records: int) -> Trace:
        """The trace of everything added; ``meta`` adds name, model, phase, source, ..."""
        src = self.src
        if not self.rows:
            raise TraceError(f"{src}: no routing records")
        layer_ids = sorted(self.layers)
        L, k = len(layer_ids), self.k_max
        seq_names = {v: key for key, v in self.seqs.items()}
        kept, dropped = [], []
        for s, tok in sorted(self.rows):
            slot = self.rows[(s, tok)]
            if len(slot) == L:
                kept.append((s, tok))
            else:
                dropped.append(self.incomplete(seq_names[s], tok, slot, layer_ids, drop_incomplete))
        if not kept:
            raise TraceError(f"{src}: every token lacks some layer; nothing left to import")
        experts, probs = fill([self.rows[key] for key in kept], layer_ids, k, bool(self.has_probs))
        renumber = {old: new for new, old in enumerate(dict.fromkeys(s for s, _ in kept))}
        seq = np.array([renumber[s] for s, _ in kept], dtype=np.int32)
        step = np.array([tok for _, tok in kept], dtype=np.int32)
        E = num_experts if num_experts is not None else int(experts.max()) + 1
        full = {
            **meta,
            "num_experts": E,
            "top_k": k,
            "num_layers": L,
            "layer_ids": layer_ids,
            "sequence_ids": {str(new): seq_names[old] for old, new in renumber.items()},
            "validation": {"records": records, "tokens_dropped": len(dropped), "dropped_tokens": dropped[:1000],
                           "padded": self.k_min < k},
        }
        if num_experts is None:
            full["num_experts_inferred"] = True
        return Trace.from_arrays(experts, seq, probs=probs, meta=full, extras={"step": step}, source=src)


def fill(slots: list[dict], layer_ids: list[int], k: int, has_probs: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """``experts`` int32 ``[T, L, k]`` (short lists padded with -1) and ``probs`` float32 (NaN-padded,
    or None) of complete tokens' slots ``{layer: (ids, probs)}``, in the given order."""
    T, L = len(slots), len(layer_ids)
    experts = np.full((T, L, k), -1, dtype=np.int32)
    probs = np.full((T, L, k), np.nan, dtype=np.float32) if has_probs else None
    col = {lid: i for i, lid in enumerate(layer_ids)}
    for t, slot in enumerate(slots):
        for lid, (ids, pr) in slot.items():
            experts[t, col[lid], : len(ids)] = ids
            if probs is not None:
                probs[t, col[lid], : len(pr)] = pr
    return experts, probs


class _Survey(RoutingTable):
    """Pass 1 of :func:`write_table_chunked`: what the whole log decides (k, the layers, gate weights
    or none, the largest id) and each sequence's entry count, without keeping any entry."""

    def __init__(self, src: str, names: dict[str, str | None], *, pad: bool):
        super().__init__(src, names, pad=pad)
        self.entries: dict[int | str, int] = {}
        self.top = -1

    def add(self, seq, tok, layer, ids, probs, where) -> None:
        self.take_k(len(ids), where)
        self.entries[seq] = self.entries.get(seq, 0) + 1
        self.layers.add(layer)
        if ids:
            self.top = max(self.top, max(ids))


class _Sequences(RoutingTable):
    """Pass 2 of :func:`write_table_chunked`: entries kept per open sequence; a sequence whose last
    entry (counted by the survey) has been read is finished at once and handed to ``emit``."""

    def __init__(self, survey: _Survey, drop_incomplete: bool, emit: Callable[[object, list[int], list[dict]], None]):
        super().__init__(survey.src, survey.names, pad=survey.pad)
        self.left = dict(survey.entries)
        self.layer_ids = sorted(survey.layers)
        self.layers_known = survey.layers
        self.drop_incomplete = drop_incomplete
        self.emit = emit
        self.open: dict[int | str, dict[int, dict]] = {}
        self.dropped: list[dict] = []
        self.tokens_dropped = 0

    def add(self, seq, tok, layer, ids, probs, where) -> None:
        self.take_k(len(ids), where)
        if not self.left.get(seq) or layer not in self.layers_known:
            raise TraceError(f"{where}: the file changed between the two passes (an entry the first did not count)")
        toks = self.open.setdefault(seq, {})
        self.put(toks.setdefault(tok, {}), seq, tok, layer, ids, probs, where)
        self.left[seq] -= 1
        if self.left[seq] == 0:
            del self.open[seq], self.left[seq]
            kept_toks, kept = [], []
            for t in sorted(toks):
                if len(toks[t]) == len(self.layer_ids):
                    kept_toks.append(t)
                    kept.append(toks[t])
                else:
                    gone = self.incomplete(seq, t, toks[t], self.layer_ids, self.drop_incomplete)
                    self.tokens_dropped += 1
                    if len(self.dropped) < 1000:
                        self.dropped.append(gone)
            if kept:
                self.emit(seq, kept_toks, kept)


def write_table_chunked(feed: Callable[[RoutingTable], int], out: str | os.PathLike, *, src: str,
                        names: dict[str, str | None], pad: bool, chunk_sequences: int, num_experts: int | None,
                        drop_incomplete: bool, meta: dict):
    """What ``RoutingTable.build`` makes of ``feed``'s entries, written as a chunked trace at ``out``
    (:class:`~expertcache.trace.chunked.ChunkWriter`), ``chunk_sequences`` sequences a chunk.

    ``feed(table)`` reads the log once, calling ``table.probs_present`` and ``table.add`` as it
    would for :meth:`RoutingTable.build`, and returns the records read; it is called twice. Pass 1
    keeps no entry: it learns k, the layers, whether gate weights are given and the largest id, and
    counts each sequence's entries. Pass 2 keeps the entries of the sequences still open and
    finishes a sequence when its last entry is read, so memory is bounded by the sequences open at
    once (a log written a sequence at a time: one), not by the log.

    The result holds the rows of the whole import: the same tokens (sorted by token index, gaps in
    ``step``), ids, gate weights, k, layers, padding and drops, and the same errors for bad entries.
    Two things differ, by design: sequences come in the order they were *finished* (their last
    entry), not first seen; and an inferred E is the largest id of the whole log + 1 (the whole
    import's is that of the tokens kept: they differ only when ``drop_incomplete`` drops every token
    holding the largest id). Each chunk's ``meta['sequence_ids']`` names its sequences as the log
    does. Returns the opened :class:`~expertcache.trace.chunked.ChunkedTrace`."""
    check_chunk_sequences(chunk_sequences)
    survey = _Survey(src, names, pad=pad)
    records = feed(survey)
    if not survey.entries:
        raise TraceError(f"{src}: no routing records")
    layer_ids, k = sorted(survey.layers), survey.k_max
    E = num_experts if num_experts is not None else survey.top + 1
    shape = {"num_experts": E, "top_k": k, "num_layers": len(layer_ids), "layer_ids": layer_ids}
    pending: list[tuple[object, list[int], list[dict]]] = []
    done = 0

    def write() -> None:
        nonlocal done
        experts, probs = fill([slot for _, _, slots in pending for slot in slots], layer_ids, k, bool(survey.has_probs))
        seq = np.repeat(np.arange(len(pending), dtype=np.int32), [len(toks) for _, toks, _ in pending])
        step = np.array([t for _, toks, _ in pending for t in toks], dtype=np.int32)
        piece_meta = {**meta, **shape, "sequence_ids": {str(done + i): name for i, (name, _, _) in enumerate(pending)}}
        writer.add(Trace.from_arrays(experts, seq, probs=probs, meta=piece_meta, extras={"step": step}, source=src),
                   seq_offset=done)
        done += len(pending)
        pending.clear()

    def emit(name, toks: list[int], slots: list[dict]) -> None:
        pending.append((name, toks, slots))
        if len(pending) >= chunk_sequences:
            write()

    with ChunkWriter(out) as writer:
        sink = _Sequences(survey, drop_incomplete, emit)
        if feed(sink) != records or sink.left:
            raise TraceError(f"{src}: the file changed between the two passes (records or entries differ)")
        if pending:
            write()
        if not done:
            raise TraceError(f"{src}: every token lacks some layer; nothing left to import")
        final = {**meta, **shape, "sequence_ids": "each chunk's meta['sequence_ids']",
                 "validation": {"records": records, "tokens_dropped": sink.tokens_dropped,
                                "dropped_tokens": sink.dropped, "padded": survey.k_min < k}}
        if num_experts is None:
            final["num_experts_inferred"] = True
        writer.meta_override = final
    return open_chunked(out)


def jsonl_names(f) -> dict:
    """The roles' field names of a JSONL reader's fields (``JsonlFields``, ``TokenFields``), for messages."""
    return {"seq": f.seq, "token": f.token, "experts": f.experts, "probs": f.probs}


def jsonl_meta(path, fmt: str, f, model: str | None, phase: str) -> dict:
    """The trace meta a JSONL import records (name, model, phase, source with the fields in force)."""
    return {"name": display_name(path), "model": model or "unknown", "phase": phase,
            "source": {"format": fmt, "path": str(path), "fields": asdict(f)}}


def write_jsonl_chunked(path, out, fmt: str, fields, feed: Callable[[RoutingTable], int], *, chunk_sequences: int,
                        num_experts: int | None = None, drop_incomplete: bool = False, pad: bool = False,
                        model: str | None = None, phase: str = "decode"):
    """A JSONL routing log (``fmt``, read by ``feed``) written as a chunked trace at ``out``
    (:func:`write_table_chunked`); the options are the whole import's."""
    check_phase(phase)
    check_num_experts(num_experts)
    return write_table_chunked(feed, out, src=str(path), names=jsonl_names(fields), pad=pad,
                               chunk_sequences=chunk_sequences, num_experts=num_experts,
                               drop_incomplete=drop_incomplete, meta=jsonl_meta(path, fmt, fields, model, phase))
