"""A trace larger than memory: a folder of canonical trace chunks, read one chunk at a time.

On disk a *chunked trace* is a folder holding

* ``chunks.json``: the manifest, ``{"format": "expertcache-chunked-trace", "version": 1,
  "num_experts", "num_layers", "top_k", "layer_ids", "tokens", "sequences", "meta",
  "chunks": [{"file", "tokens", "sequences", "first_seq", "last_seq", "sha256"}, ...]}`` (``sha256``, the
  chunk file's digest, checked when the chunk is read; absent from manifests written before it);
* ``chunk-000000.npz``, ``chunk-000001.npz``, ...: each a canonical trace
  (:mod:`~expertcache.trace.core`, stored without compression so that reading is not the cost).

Invariants, checked when the manifest is opened (no chunk is read) and again for each chunk when
it is read (one :class:`~expertcache.errors.TraceError` line naming the file):

* **every sequence lies in one chunk**, and chunks follow each other in sequence order: each
  chunk's sequence ids lie in ``[first_seq, last_seq]`` and ``last_seq`` of a chunk is below
  ``first_seq`` of the next. Streams that reset at each sequence are therefore never cut by a
  chunk, which is what makes a chunk a unit of work (:mod:`expertcache.sim.chunked`);
* every chunk has the manifest's ``num_experts``, ``top_k`` and ``layer_ids``, and the tokens and
  sequences the manifest gives it; the totals are the sums;
* chunk file names are ``chunk-<digits>.npz`` in the folder itself (no path leaves the folder);
* engine traces (the ``iteration`` / ``accepted`` extras) are not written chunked: an engine
  iteration may batch tokens of several sequences across a chunk's edge.

:class:`ChunkWriter` writes one chunk at a time into a temporary folder beside the target and
renames it into place when closed, so a reader never sees half a trace (atomic).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .._io import clean_stale_temporaries, read_json, temporary_name
from .._text import short
from ..errors import ConfigError, TraceError, is_int
from .core import Trace, load_trace
from .validate import MAX_LAYERS, MAX_META_CHARS

MANIFEST = "chunks.json"
FORMAT = "expertcache-chunked-trace"
VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest read (about 400,000 chunks): a hostile file cannot make the reader allocate more."""
_CHUNK_NAME = re.compile(r"chunk-\d{6,12}\.npz")
_ENGINE_EXTRAS = ("iteration", "accepted")


def is_chunked(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a chunked trace's manifest."""
    try:
        return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class ChunkInfo:
    file: str
    tokens: int
    sequences: int
    first_seq: int
    last_seq: int
    sha256: str | None = None
    """The chunk file's SHA-256 (written since stop 51; None in older manifests): a chunk replaced by
    another of the same shape is refused when read, and a grid's key, which hashes the manifest,
    follows the chunks' bytes."""


@dataclass(frozen=True, eq=False)
class ChunkedTrace:
    """An opened chunked trace: its manifest, checked; chunks are read by :meth:`chunk`."""

    root: Path
    num_experts: int
    top_k: int
    layer_ids: list[int]
    meta: dict
    chunks: list[ChunkInfo]

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def num_sequences(self) -> int:
        return sum(c.sequences for c in self.chunks)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def num_requests_upper(self) -> int:
        """``tokens x layers x k``: the requests when nothing is padded (an upper bound)."""
        return self.num_tokens * self.num_layers * self.top_k

    @property
    def name(self) -> str:
        return str(self.meta.get("name") or self.root.name)

    def __repr__(self) -> str:
        return (f"ChunkedTrace({self.name!r}: T={self.num_tokens} tokens, S={self.num_sequences} sequences in "
                f"{self.num_chunks} chunks, L={self.num_layers} layers, k={self.top_k}, E={self.num_experts})")

    def chunk(self, i: int) -> Trace:
        """Chunk ``i`` as a validated :class:`~expertcache.trace.Trace` that agrees with the manifest."""
        info = self.chunks[i]
        path = self.root / info.file
        where = f"{path}"
        if info.sha256 is not None and path.is_file() and file_sha256(path) != info.sha256:  # a missing one: below
            raise TraceError(f"{where}: its bytes are not the ones {MANIFEST} records (sha256): a chunk was replaced "
                             "or changed after the trace was written")
        tr = load_trace(path)
        if tr.num_experts != self.num_experts or tr.top_k != self.top_k or tr.layer_ids != self.layer_ids:
            raise TraceError(f"{where}: E={tr.num_experts}, k={tr.top_k}, layers {tr.layer_ids[:4]}... disagree with "
                             f"{MANIFEST} (E={self.num_experts}, k={self.top_k})")
        if tr.num_tokens != info.tokens or tr.num_sequences != info.sequences:
            raise TraceError(f"{where}: holds {tr.num_tokens} tokens in {tr.num_sequences} sequences; {MANIFEST} says "
                             f"{info.tokens} in {info.sequences}")
        lo, hi = int(tr.seq.min()), int(tr.seq.max())
        if lo < info.first_seq or hi > info.last_seq:
            raise TraceError(f"{where}: sequence ids {lo}..{hi} outside the range {info.first_seq}..{info.last_seq} "
                             f"{MANIFEST} gives it")
        bad = [e for e in _ENGINE_EXTRAS if e in tr.extras]
        if bad:
            raise TraceError(f"{where}: holds the engine extra {bad[0]!r}; engine traces are not read chunked")
        return tr

    def iter_chunks(self) -> Iterator[Trace]:
        for i in range(self.num_chunks):
            yield self.chunk(i)

    def load(self) -> Trace:
        """The whole trace in memory (every chunk, concatenated): for traces that fit."""
        return concat([self.chunk(i) for i in range(self.num_chunks)], self.meta, str(self.root))

    def load_layers(self, cols: np.ndarray) -> Trace:
        """Every token of the layer columns ``cols`` (a layer block), read chunk by chunk."""
        ids = [self.layer_ids[int(c)] for c in cols]
        parts = [self.chunk(i).select_layers(ids) for i in range(self.num_chunks)]
        return concat(parts, self.meta, str(self.root))


def concat(parts: list[Trace], meta: dict, source: str) -> Trace:
    """Traces with the same layers, sequences disjoint and in order, as one (no re-validation:
    each part was validated and the chunked invariants keep the union valid)."""
    first = parts[0]
    T = sum(p.num_tokens for p in parts)

    def cat(arrays):
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    extras = {}
    for name, value in first.extras.items():
        per_token = value.ndim >= 1 and value.shape[0] == first.num_tokens
        if per_token and all(name in p.extras for p in parts):
            extras[name] = cat([p.extras[name] for p in parts])
        elif not per_token:
            extras[name] = value
    full_meta = dict(first.meta) | {k: v for k, v in meta.items() if k not in ("tokens", "sequences")}
    full_meta["tokens"] = T
    full_meta["sequences"] = sum(p.num_sequences for p in parts)
    full_meta["layer_ids"], full_meta["num_layers"] = first.layer_ids, first.num_layers
    return Trace._trusted(
        experts=cat([p.experts for p in parts]),
        seq=cat([p.seq for p in parts]),
        meta=full_meta,
        probs=cat([p.probs for p in parts]) if all(p.probs is not None for p in parts) else None,
        router_probs=None if any(p.router_probs is None for p in parts) else cat([p.router_probs for p in parts]),
        extras=extras,
        source=source,
    )


# ---------------------------------------------------------------------------------- reading
def open_chunked(path: str | os.PathLike) -> ChunkedTrace:
    """Open the chunked trace in folder ``path`` (its manifest checked; no chunk is read yet)."""
    root = Path(path)
    man = root / MANIFEST
    src = str(man)
    if not os.path.lexists(man):
        raise TraceError(f"{root}: no {MANIFEST} (not a chunked trace)")
    doc = read_json(man, str(root), max_bytes=MAX_MANIFEST_BYTES, error=TraceError)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceError(f"{src}: not a chunked trace manifest (expected \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise TraceError(f"{src}: version {doc.get('version')!r} (this expertcache reads version {VERSION})")

    def integer(obj, key, where, lo=0):
        value = obj.get(key)
        if not is_int(value, lo, (1 << 62) - 1):
            raise TraceError(f"{src}: {where}{key}: expected an integer >= {lo}, got {value!r}")
        return value

    E, k = integer(doc, "num_experts", "", 1), integer(doc, "top_k", "", 1)
    layer_ids = doc.get("layer_ids")
    if (not isinstance(layer_ids, list) or not layer_ids or len(layer_ids) > MAX_LAYERS
            or any(not is_int(x, 0, (1 << 31) - 1) for x in layer_ids)
            or len(set(layer_ids)) != len(layer_ids)):
        raise TraceError(f"{src}: layer_ids: expected 1 to {MAX_LAYERS} distinct layer ids in [0, 2^31)")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict) or len(json.dumps(meta)) > MAX_META_CHARS:
        raise TraceError(f"{src}: meta: expected a JSON object of at most {MAX_META_CHARS:,} characters")
    rows = doc.get("chunks")
    if not isinstance(rows, list) or not rows:
        raise TraceError(f"{src}: chunks: expected a non-empty list")
    chunks: list[ChunkInfo] = []
    for i, row in enumerate(rows):
        where = f"chunks[{i}]."
        if not isinstance(row, dict):
            raise TraceError(f"{src}: chunks[{i}]: expected an object")
        name = row.get("file")
        if not isinstance(name, str) or not _CHUNK_NAME.fullmatch(name):
            raise TraceError(f"{src}: {where}file: expected a name like chunk-000000.npz, got {name!r}")
        digest = row.get("sha256")
        if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise TraceError(f"{src}: {where}sha256: expected 64 hex digits, got {str(digest)[:80]!r}")
        info = ChunkInfo(name, integer(row, "tokens", where, 1), integer(row, "sequences", where, 1),
                         integer(row, "first_seq", where, 0), integer(row, "last_seq", where, 0), digest)
        if info.last_seq < info.first_seq or info.sequences > info.last_seq - info.first_seq + 1 \
                or info.sequences > info.tokens:
            raise TraceError(f"{src}: {where[:-1]}: {info.sequences} sequences cannot have ids "
                             f"{info.first_seq}..{info.last_seq} in {info.tokens} tokens")
        if chunks and info.first_seq <= chunks[-1].last_seq:
            raise TraceError(f"{src}: {where[:-1]}: sequence ids from {info.first_seq} overlap the previous chunk's "
                             f"(up to {chunks[-1].last_seq}); chunks follow each other in sequence order")
        if chunks and name <= chunks[-1].file:
            raise TraceError(f"{src}: {where}file: {name!r} is not after {chunks[-1].file!r}")
        chunks.append(info)
    for key, total in (("tokens", sum(c.tokens for c in chunks)), ("sequences", sum(c.sequences for c in chunks))):
        if doc.get(key) != total:
            raise TraceError(f"{src}: {key}: {doc.get(key)!r}, but the chunks hold {total:,}")
    return ChunkedTrace(root=root, num_experts=E, top_k=k, layer_ids=list(layer_ids), meta=meta, chunks=chunks)


def file_sha256(path: str | os.PathLike) -> str:
    """The file's SHA-256, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------- writing
def check_chunk_sequences(chunk_sequences) -> int:
    """``--chunk-sequences``: a positive integer (a ConfigError line otherwise)."""
    if not is_int(chunk_sequences, 1):
        raise ConfigError(f"--chunk-sequences: expected a positive integer, got {chunk_sequences!r}")
    return int(chunk_sequences)


def write_trace_chunked(trace: Trace, out: str | os.PathLike, *, chunk_sequences: int,
                        option: str = "--out") -> "ChunkedTrace":
    """``trace`` written as a chunked trace at ``out``, ``chunk_sequences`` sequences a chunk in trace
    order, renumbered 0, 1, ... (each chunk's meta keeps the trace's); returns it opened."""
    chunk_sequences = check_chunk_sequences(chunk_sequences)
    bounds = trace.seq_bounds
    with ChunkWriter(out, option=option) as writer:
        for first in range(0, trace.num_sequences, chunk_sequences):
            index = range(first, min(first + chunk_sequences, trace.num_sequences))
            piece = trace.select_sequences(index)
            seq = np.repeat(np.arange(first, first + len(index), dtype=np.int64), np.diff(bounds[index.start:index.stop + 1]))
            writer.add(piece._with(seq=seq))
        writer.meta_override = trace.meta
    return open_chunked(out)


class ChunkWriter:
    """Write a chunked trace one chunk at a time; ``close()`` publishes it (atomically).

    ``with ChunkWriter(out) as w: w.add(trace_a); w.add(trace_b)``. Each added trace becomes one
    chunk and must hold whole sequences whose ids are above every id of the chunks before it
    (renumber with ``seq_offset`` when the pieces each count from 0). An exception inside the
    ``with`` removes the partial folder; ``out`` is then untouched.
    """

    def __init__(self, out: str | os.PathLike, *, option: str = "--out"):
        self.out = Path(out)
        self.option = option
        parent = self.out.parent if str(self.out.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"{option} {self.out}: folder {parent} does not exist")
        if self.out.exists() and not is_chunked(self.out) and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ConfigError(f"{option} {self.out}: exists and is not a chunked trace (it would be replaced)")
        clean_stale_temporaries(self.out, "partial", "old")  # what a killed writer of this trace left
        self.tmp = temporary_name(self.out, "partial")
        try:
            self.tmp.mkdir()
        except OSError as exc:
            raise ConfigError(f"{option} {self.out}: cannot write ({exc.strerror or exc})") from None
        self.rows: list[dict] = []
        self.shape: tuple | None = None
        self.meta: dict = {}
        self.meta_override: dict | None = None
        """The manifest's meta when set before :meth:`close` (e.g. counts known only at the end);
        else the first chunk's meta."""

    def __enter__(self) -> "ChunkWriter":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None:
            self.close()
        else:
            self.abort()
        return False

    def add(self, trace: Trace, *, seq_offset: int = 0) -> None:
        """Append ``trace`` as the next chunk (its sequence ids shifted by ``seq_offset``, an integer
        in ``[0, 2**62]``: 2.5 had written float sequence ids that only the reader refused)."""
        if not isinstance(trace, Trace):
            raise ConfigError(f"{self.option} {self.out}: a chunk must be a Trace, got {type(trace).__name__}")
        if not is_int(seq_offset, 0, 2**62):
            raise ConfigError(f"{self.option} {self.out}: seq_offset must be an integer in [0, 2**62], got "
                              f"{short(seq_offset, 40)}")
        bad = [e for e in _ENGINE_EXTRAS if e in trace.extras]
        if bad:
            raise ConfigError(f"{self.option} {self.out}: engine traces (extra {bad[0]!r}) are not written chunked")
        shape = (trace.num_experts, trace.top_k, tuple(trace.layer_ids))
        if self.shape is None:
            self.shape, self.meta = shape, {k: v for k, v in trace.meta.items() if k not in ("tokens", "sequences")}
        elif shape != self.shape:
            raise ConfigError(f"{self.option} {self.out}: chunk {len(self.rows)} has E, k or layers unlike the first")
        if seq_offset:
            trace = trace._with(seq=trace.seq.astype(np.int64) + seq_offset)
        lo, hi = int(trace.seq.min()), int(trace.seq.max())
        if self.rows and lo <= self.rows[-1]["last_seq"]:
            raise ConfigError(f"{self.option} {self.out}: chunk {len(self.rows)} has sequence ids from {lo}, not above "
                              f"the previous chunk's {self.rows[-1]['last_seq']}")
        if lo < 0:
            raise ConfigError(f"{self.option} {self.out}: chunk {len(self.rows)} has negative sequence ids")
        name = f"chunk-{len(self.rows):06d}.npz"
        trace.save(self.tmp / name, compressed=False)
        self.rows.append({"file": name, "tokens": trace.num_tokens, "sequences": trace.num_sequences,
                          "first_seq": lo, "last_seq": hi, "sha256": file_sha256(self.tmp / name)})

    def close(self) -> Path:
        if not self.rows:
            self.abort()
            raise ConfigError(f"{self.option} {self.out}: nothing to write (no chunk)")
        E, k, layers = self.shape
        doc = {"format": FORMAT, "version": VERSION, "num_experts": E, "top_k": k, "layer_ids": list(layers),
               "tokens": sum(r["tokens"] for r in self.rows), "sequences": sum(r["sequences"] for r in self.rows),
               "meta": self.meta if self.meta_override is None else
               {k: v for k, v in self.meta_override.items() if k not in ("tokens", "sequences")},
               "chunks": self.rows}
        with open(self.tmp / MANIFEST, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        old = None
        if self.out.exists():  # a chunked trace (checked when opened): moved aside, then removed
            old = temporary_name(self.out, "old")
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.tmp)
