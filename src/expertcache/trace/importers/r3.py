"""``sglang-r3`` and ``vllm-r3``: the routed experts ("R3", rollout routing replay) that SGLang and
vLLM servers started with ``--enable-return-routed-experts`` return with each response.

Input: JSON lines of server responses, read by :mod:`.r3_wire` (which says where each server
puts the payload and how it is encoded). SGLang's payload has no shape: layers x k is
``--num-layers`` x ``--top-k``, or learned from the first response that states its prompt and
completion token counts (rows = P + C - 1 - start), and k, without ``--top-k``/``--num-layers``,
is the widest divisor of layers x k whose id groups never repeat an id in the first
:data:`SAMPLE_ROWS` rows (``source.top_k_inferred`` in meta). vLLM's states its shape.

Invariants of the trace built:

* row i of a payload is token position ``s + i``; ``s`` is the request's
  ``routed_experts_start_len``/``routed_experts_prompt_start`` (or ``meta_info``'s echo), else
  ``P + C - 1 - rows`` when both counts are known and that lies in [0, P], else 0. A server that
  ignored the request's start (SGLang 0.5.8-0.5.11: all rows) is read as ``s = 0`` and counted;
* a payload with ``s > 0`` continues the newest of the last :data:`RECENT` sequences, not yet
  continued by the same response, with ``s <= end + 1`` (end: its next position without a row)
  whose token ids agree with the request's prompt on ``[0, s)``; without token ids on either side
  only the newest sequence qualifies. Its rows from ``s`` on are replaced. Otherwise the payload
  starts a new sequence at ``s`` (counted as unstitched);
* sequences keep the order of their first payload, rows ascending positions (extras ``position``
  and ``step``: the position; ``row_phase``: 1 prompt (prefill) position, 0 decode, -1 prompt
  length unknown); ``meta['phase']`` is ``--phase`` or follows ``row_phase``;
* layers whose ids are 0 in every row (dense layers) are left out (``source.dense_layers``), the
  rest keep their index in the payload as layer id; a row whose ids at a kept layer are all 0
  (k >= 2: nothing recorded) is an error unless ``drop_incomplete``; an id twice in a row is an
  error. Every problem is one TraceError line naming ``file:line`` and the field.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError, TraceError, is_int
from ..chunked import ChunkWriter, check_chunk_sequences, open_chunked
from ..core import Trace
from ..validate import MAX_LAYERS, compact_dtype
from .engine import MAX_TOP_K
from .r3_wire import R3_FORMATS, R3Part, R3Reader, r3_kind
from .records import display_name
from .registry import Importer, Options, register
from .values import check_num_experts, check_phase

RECENT = 256  # sequences a suffix may continue
SAMPLE_ROWS = 4096  # rows that decide an inferred k


@dataclass
class _Seq:
    name: str
    resp: int
    end: int = 0
    tokens: list | None = None
    segs: list = field(default_factory=list)  # [chunk, lo, hi, first position, P or None]


class _Build:
    """Parts -> positioned segments of sequences (module invariants) -> one :class:`Trace`."""

    def __init__(self, src: str, lk: int | None, L: int | None, K: int | None, drop: bool,
                 keep_rows: int | None = None):
        self.src, self.lk, self.L, self.K, self.drop = src, lk, L, K, drop
        self.keep_rows = keep_rows  # a scan: keep only the first rows (for an inferred k), no payload after
        self.shape_where = ""
        self.chunks: list = []
        self.owner: list[R3Part] = []
        self.seqs: list[_Seq] = []
        self.recent: list[int] = []
        self.nonzero = None
        self.top = -1
        self.notes = dict(start_len_ignored=0, rows_replaced=0, row_count_mismatches=[], unstitched_suffixes=[])

    def add(self, p: R3Part) -> None:
        arr = p.ids
        if arr.ndim == 3:
            L3, K3 = arr.shape[1:]
            if not L3 * K3:
                raise TraceError(f"{p.where}: {p.loc}: shape {arr.shape}: no layers or no ids per layer")
            if arr.shape[0] == 0:
                return
            if (self.lk is not None and L3 * K3 != self.lk) or (self.K is not None and K3 != self.K):
                was = f"{self.L} layers and k = {self.K}" if self.K else f"L x k = {self.lk}"
                raise TraceError(f"{p.where}: {p.loc}: shape {arr.shape}: {L3} layers and k = {K3}, but "
                                 f"{self.shape_where or 'the options'} gave {was} (one model per file)")
            if self.K is None:
                self.L, self.K, self.lk, self.shape_where = L3, K3, L3 * K3, self.shape_where or p.where
            arr = arr.reshape(arr.shape[0], -1)
        elif arr.size % self.lk:
            shape = f"L x k = {self.L} x {self.K}" if self.L and self.K else f"L x k = {self.lk} (learned from {self.shape_where})"
            raise TraceError(f"{p.where}: {p.loc}: {4 * arr.size} bytes are not a multiple of 4 x {shape}; "
                             "pass --num-layers and --top-k if that is not the model's")
        else:
            arr = arr.reshape(-1, self.lk)
        rows = arr.shape[0]
        if not rows:
            return
        s, link = self._start(p, rows)
        S = self._sequence(p, s, link)
        if self.keep_rows is not None:  # a scan: the first rows only, and what decides the shape
            kept = sum(c.shape[0] for c in self.chunks)
            arr_kept = arr[: max(0, self.keep_rows - kept)]
            nz = arr.any(axis=0)
            self.nonzero = nz if self.nonzero is None else self.nonzero | nz
            self.top = max(self.top, int(arr.max()))
            if arr_kept.shape[0]:
                self.chunks.append(arr_kept)
            S.end, S.resp = s + rows, p.resp
            S.tokens = None if p.prompt is None else p.prompt + (p.output or [])
            p.ids = None
            return
        self.chunks.append(arr)
        self.owner.append(p)
        S.segs.append([len(self.chunks) - 1, 0, rows, s, p.P])
        S.end, S.resp = s + rows, p.resp
        S.tokens = None if p.prompt is None else p.prompt + (p.output or [])
        p.ids = None
        nz = arr.any(axis=0)
        self.nonzero = nz if self.nonzero is None else self.nonzero | nz
        self.top = max(self.top, int(arr.max()))

    def _start(self, p: R3Part, rows: int) -> tuple[int, int]:
        """(position of row 0, the start the request asked for: what finds the sequence continued)."""
        if p.P is None or p.C is None:
            return p.start or 0, p.start or 0
        s = p.P + p.C - 1 - rows
        if p.start is None and 0 <= s <= p.P or s == p.start:
            return s, s
        if s == 0:  # every row although the request set a start: the server ignored it
            self.notes["start_len_ignored"] += 1
            return 0, p.start
        if len(self.notes["row_count_mismatches"]) < 20:
            self.notes["row_count_mismatches"].append({"where": p.where, "rows": rows, "prompt_tokens": p.P,
                                                       "completion_tokens": p.C, "start": p.start})
        return p.start or 0, p.start or 0

    def _sequence(self, p: R3Part, s: int, link: int) -> _Seq:
        """The sequence the rows from position ``s`` belong to (module invariants; ``link``: the
        requested start, which a continued sequence must reach); its rows from ``s`` on are dropped."""
        for age, i in enumerate(reversed(self.recent) if link else ()):
            S = self.seqs[i]
            if S.resp == p.resp or link > S.end + 1:
                continue
            m = min(link, len(S.tokens)) if S.tokens is not None and p.prompt is not None else -1
            if (m < 0 and age == 0) or (m > 0 and S.tokens[:m] == p.prompt[:m]):
                while S.segs and S.segs[-1][3] >= s:
                    self.notes["rows_replaced"] += S.segs[-1][2] - S.segs[-1][1]
                    S.segs.pop()
                if S.segs and S.segs[-1][3] + S.segs[-1][2] - S.segs[-1][1] > s:
                    seg = S.segs[-1]
                    self.notes["rows_replaced"] += seg[3] + seg[2] - seg[1] - s
                    seg[2] = seg[1] + s - seg[3]
                self.recent.remove(i)
                self.recent.append(i)
                return S
        if s and len(self.notes["unstitched_suffixes"]) < 20:
            self.notes["unstitched_suffixes"].append({"where": p.where, "start": s})
        self.seqs.append(_Seq(p.name, p.resp))
        self.recent = self.recent[-RECENT + 1:] + [len(self.seqs) - 1]
        return self.seqs[-1]

    def _infer_k(self) -> int:
        """The widest divisor of L x k whose groups of ids (all-zero groups aside) never repeat an id
        in the first :data:`SAMPLE_ROWS` rows."""
        sample = np.concatenate([c[:SAMPLE_ROWS] for c in self.chunks[:SAMPLE_ROWS]])[:SAMPLE_ROWS]
        for d in [d for d in range(self.lk, 0, -1) if self.lk % d == 0]:
            g = sample.reshape(-1, d)
            g = np.sort(g[g.any(axis=1)], axis=1)
            if d == 1 or not (g[:, 1:] == g[:, :-1]).any():
                return d
        return 1

    def trace(self, meta: dict, phase: str | None, num_experts: int | None, stats: dict) -> Trace:
        if not self.seqs:
            errors = f" ({stats['error_responses']} error responses)" if stats["error_responses"] else ""
            raise TraceError(f"{self.src}: no routed-expert rows in any response{errors}")
        inferred = self.K is None and self.L is None
        for opt, v in (("--top-k", self.K), ("--num-layers", self.L)):
            if v and self.lk % v:
                raise TraceError(f"{self.src}: {opt} {v} does not divide the payload's {self.lk} ids per row ({self.shape_where})")
        self.K = self.K or (self.lk // self.L if self.L else self._infer_k())
        L, K = self.lk // self.K, self.K
        keep = np.flatnonzero(self.nonzero.reshape(L, K).any(axis=1))
        if not keep.size:
            raise TraceError(f"{self.src}: every id in every row is 0: no routing was recorded")
        E = num_experts or self.top + 1
        refs = np.bincount([seg[0] for S in self.seqs for seg in S.segs], minlength=len(self.chunks))
        T = sum(seg[2] - seg[1] for S in self.seqs for seg in S.segs)
        experts = np.empty((T, keep.size, K), compact_dtype(E))
        pos, phase_of, seq = np.empty(T, np.int64), np.empty(T, np.int8), np.empty(T, np.int32)
        ok, t, dropped = np.ones(T, bool), 0, []
        for si, S in enumerate(self.seqs):
            for c, lo, hi, p0, P in S.segs:
                sub = self.chunks[c][lo:hi].reshape(hi - lo, L, K)[:, keep]
                n = hi - lo
                lacking = self._check(sub, self.owner[c], lo, p0, keep)
                experts[t:t + n], pos[t:t + n], seq[t:t + n] = sub, p0 + np.arange(n), si
                phase_of[t:t + n] = -1 if P is None else pos[t:t + n] < P
                ok[t:t + n] = ~lacking
                dropped += [{"sequence": S.name, "position": int(p0 + r)} for r in np.flatnonzero(lacking)[:1000 - len(dropped)]]
                t += n
                refs[c] -= 1
                if not refs[c]:
                    self.chunks[c] = None
        names = [S.name for S in self.seqs]
        if not ok.all():
            if not ok.any():
                raise TraceError(f"{self.src}: every row lacks some layer; nothing left to import")
            experts, pos, phase_of, seq = experts[ok], pos[ok], phase_of[ok], seq[ok]
            kept, seq = np.unique(seq, return_inverse=True)
            names = [names[i] for i in kept]
        kinds = {k: int(np.count_nonzero(phase_of == v)) for k, v in (("prefill", 1), ("decode", 0), ("unknown", -1))}
        derived = "prefill" if kinds["prefill"] == len(pos) else "decode" if kinds["decode"] == len(pos) else "mixed"
        meta = {**meta, "phase": phase or derived, "num_experts": E, "layer_ids": [int(x) for x in keep],
                "sequence_ids": {str(i): n for i, n in enumerate(names)}, "rows": kinds}
        meta["source"].update(layers_in_payload=L, dense_layers=[x for x in range(L) if x not in set(keep)],
                              top_k_inferred=inferred, shape_from=self.shape_where or "the options")
        meta["validation"] = {**stats, "tokens_dropped": int((~ok).sum()), "dropped_tokens": dropped, **self.notes}
        if num_experts is None:
            meta["num_experts_inferred"] = True
        extras = {"position": pos, "step": pos, "row_phase": phase_of}
        return Trace.from_arrays(experts, seq, meta=meta, extras=extras, source=self.src)

    def piece(self, index: list[int], nonzero, top: int, meta: dict, phase: str | None, E: int,
              stats: dict) -> Trace:
        """The sequences at ``index`` as a trace of their own, with the whole file's dense layers
        (``nonzero``), top id and E (:func:`import_r3_chunked`); their payloads are freed."""
        part = _Build(self.src, self.lk, self.L, self.K, self.drop)
        part.shape_where, part.chunks, part.owner = self.shape_where, self.chunks, self.owner
        part.seqs, part.nonzero, part.top = [self.seqs[i] for i in index], nonzero, top
        piece = part.trace({**meta, "source": dict(meta["source"])}, phase, E, stats)
        return piece

    def _check(self, sub: np.ndarray, p: R3Part, lo: int, p0: int, keep: np.ndarray) -> np.ndarray:
        """Rows of ``sub`` lacking a layer (k >= 2 zeros: nothing recorded); an id twice is an error."""
        if sub.shape[2] < 2:
            return np.zeros(sub.shape[0], bool)
        zero = ~sub.any(axis=2)
        srt = np.sort(sub, axis=2)
        dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2) & ~zero
        checks = [(dup, "an expert id appears twice in", "")]
        if not self.drop:
            checks.append((zero, "no routing recorded:", " (--drop-incomplete drops such rows)"))
        for bad, why, tail in checks:
            if bad.any():
                r, c = (int(v) for v in np.argwhere(bad)[0])
                raise TraceError(f"{p.where}: {p.loc}: row {lo + r} (position {p0 + r}), layer {int(keep[c])}: "
                                 f"{why} {sub[r, c].tolist()}{tail}")
        return zero.any(axis=1)


def import_r3(path: str | os.PathLike, fmt: str = "sglang-r3", *, num_experts: int | None = None,
              num_layers: int | None = None, top_k: int | None = None, drop_incomplete: bool = False,
              model: str | None = None, phase: str | None = None) -> Trace:
    """Import a JSONL log of server responses carrying routed experts (module docstring).

    ``num_layers``/``top_k``: the SGLang payload's L and k (default: learned, see above; vLLM's
    payload states them). ``phase`` defaults to what ``row_phase`` shows."""
    if fmt not in R3_FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(R3_FORMATS)}")
    if phase is not None:
        check_phase(phase)
    check_num_experts(num_experts)
    for opt, v, most in (("--num-layers", num_layers, MAX_LAYERS), ("--top-k", top_k, MAX_TOP_K)):
        if v is not None and not (is_int(v) and 0 < v <= most):
            raise ConfigError(f"{opt}: {v!r} is outside [1, {most}]")
        if v is not None and fmt == "vllm-r3":
            raise ConfigError(f"{opt} does not apply to vllm-r3 (its payload states its shape)")
    src = str(path)
    lk, where = (num_layers * top_k, "") if num_layers and top_k else (None, "")
    if lk is None and fmt == "sglang-r3":
        lk, where = _learn_lk(path, src, fmt, num_experts, num_layers or top_k)
    build = _Build(src, lk, num_layers, top_k, drop_incomplete)
    build.shape_where = where
    reader = R3Reader(src, fmt, num_experts)
    with contextlib.closing(reader.parts(path)) as parts:
        for p in parts:
            build.add(p)
    return build.trace(_r3_meta(path, src, fmt, model, reader), phase, num_experts, reader.stats)


def import_r3_chunked(path: str | os.PathLike, out: str | os.PathLike, fmt: str = "sglang-r3", *, chunk_sequences: int,
                      num_experts: int | None = None, num_layers: int | None = None, top_k: int | None = None,
                      drop_incomplete: bool = False, model: str | None = None, phase: str | None = None):
    """:func:`import_r3` written as a chunked trace (:mod:`~expertcache.trace.chunked`) at ``out``,
    ``chunk_sequences`` sequences a chunk, in memory bounded by the log's open sequences rather
    than by the log. Two passes over the file: the first learns what the whole file decides (L x
    k, k, the dense layers, E) keeping no payload; the second builds sequences as
    :func:`import_r3` does and writes each one once no later response can continue it (it has
    left the :data:`RECENT` sequences a suffix may continue), or at the end.

    The same rows, ids, positions and phases as :func:`import_r3`; sequences in the order they
    were completed (a conversation continued later comes after the ones it outlived), not of
    their first response. Returns the opened :class:`~expertcache.trace.chunked.ChunkedTrace`."""
    check_chunk_sequences(chunk_sequences)
    if fmt not in R3_FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(R3_FORMATS)}")
    if phase is not None:
        check_phase(phase)
    check_num_experts(num_experts)
    src = str(path)
    lk, where = (num_layers * top_k, "") if num_layers and top_k else (None, "")
    if lk is None and fmt == "sglang-r3":
        lk, where = _learn_lk(path, src, fmt, num_experts, num_layers or top_k)
    scan = _Build(src, lk, num_layers, top_k, drop_incomplete, keep_rows=SAMPLE_ROWS)  # pass 1
    scan.shape_where = where
    with contextlib.closing(R3Reader(src, fmt, num_experts).parts(path)) as parts:
        for p in parts:
            scan.add(p)
    if not scan.seqs:
        raise TraceError(f"{src}: no routed-expert rows in any response")
    inferred = scan.K is None and scan.L is None
    K = scan.K or (scan.lk // scan.L if scan.L else scan._infer_k())
    build = _Build(src, scan.lk, scan.lk // K, K, drop_incomplete)  # pass 2
    build.shape_where = scan.shape_where
    reader = R3Reader(src, fmt, num_experts)
    meta = _r3_meta(path, src, fmt, model, reader)
    E = num_experts or scan.top + 1
    done, known, unwritten = 0, 0, set()  # sequences written; seen; seen and not written (bounded)

    def flush(final: bool) -> None:
        nonlocal done
        recent = set(build.recent)
        ready = sorted(i for i in unwritten if final or i not in recent)
        while ready and (final or len(ready) >= chunk_sequences):
            batch, ready = ready[:chunk_sequences], ready[chunk_sequences:]
            piece = build.piece(batch, scan.nonzero, scan.top, meta, phase, E, reader.stats)
            writer.add(piece, seq_offset=done)
            done += piece.num_sequences
            unwritten.difference_update(batch)
            for i in batch:  # drop what a written sequence held
                build.seqs[i].segs, build.seqs[i].tokens = [], None

    with ChunkWriter(out) as writer:
        with contextlib.closing(reader.parts(path)) as parts:
            for p in parts:
                build.add(p)
                unwritten.update(range(known, len(build.seqs)))
                known = len(build.seqs)
                if len(unwritten) - len(build.recent) >= chunk_sequences:
                    flush(False)
        flush(True)
        final_meta = {**meta, "phase": phase or "mixed", "num_experts": E}
        final_meta["source"].update(top_k_inferred=inferred)
        final_meta["validation"] = {**reader.stats, **build.notes}
        writer.meta_override = final_meta
    return open_chunked(out)


def _r3_meta(path, src: str, fmt: str, model: str | None, reader: R3Reader) -> dict:
    encodings = {"sglang-r3": "base64 int32 [rows, layers, k], little-endian",
                 "vllm-r3": "base64 .npy [rows, layers, k] (vLLM >= 0.22) or JSON lists (0.21)"}
    return {"name": display_name(path), "model": model or "unknown",
            "source": {"format": fmt, "path": src, "encoding": encodings[fmt], "locations": reader.locations,
                       "positions": "row i of a payload = token position start + i"}}


def _learn_lk(path, src: str, fmt: str, num_experts: int | None, divisor: int | None) -> tuple[int, str]:
    """L x k of an SGLang payload from the first part with known counts (or a stated shape)."""
    with contextlib.closing(R3Reader(src, fmt, num_experts).parts(path)) as parts:
        for p in parts:
            if p.ids.ndim == 3 and p.ids.shape[0]:
                return p.ids.shape[1] * p.ids.shape[2], p.where
            if p.P is None or p.C is None or not p.ids.size:
                continue
            rows = p.P + p.C - 1 - (p.start or 0)
            if rows <= 0 or p.ids.size % rows or (divisor and (p.ids.size // rows) % divisor):
                raise TraceError(f"{p.where}: {p.loc}: {p.ids.size} ids do not split into prompt_tokens + completion_tokens"
                                 f" - 1 - start = {rows} rows of whole layers; pass --num-layers and --top-k")
            return p.ids.size // rows, p.where
    raise TraceError(f"{src}: no response states its prompt and completion token counts (usage, meta_info), so "
                     "the payload's layers x k is unknown; pass --num-layers and --top-k")


def _options(fmt: str, o: Options) -> dict:
    if o.pad:
        raise ConfigError(f"--pad does not apply to {fmt} (every row holds the server's k ids)")
    return dict(num_experts=o.num_experts, num_layers=o.num_layers, top_k=o.top_k, drop_incomplete=o.drop_incomplete,
                model=o.model, phase=o.phase)


def _read(path: str | os.PathLike, fmt: str, o: Options) -> Trace:
    return import_r3(path, fmt, **_options(fmt, o))


def _write_chunked(path: str | os.PathLike, out: str | os.PathLike, fmt: str, o: Options, chunk_sequences: int):
    return import_r3_chunked(path, out, fmt, chunk_sequences=chunk_sequences, **_options(fmt, o))


register(Importer("sglang-r3", shape=lambda o: "SGLang server responses with routed experts (sglext.routed_experts "
                                               "or meta_info.routed_experts), streamed or not",
                  read=_read, claims_line=r3_kind, write_chunked=_write_chunked))
# no probe of its own: sglang-r3's (r3_kind) tells the two servers apart
register(Importer("vllm-r3", shape=lambda o: "vLLM server responses with routed experts (choices[i].routed_experts)",
                  read=_read, write_chunked=_write_chunked))
