"""``--format auto``: tell the importers' shapes apart from a file's first bytes and records, and
one entry point, :func:`import_trace`, for every format.

Rules: a folder or a zip archive holding ``data.pkl`` (a ``torch.save`` file) is ``sglang``;
a log of server responses (SSE lines, OpenAI-style ``choices``, ``/generate`` ``meta_info``, or
request/response pairs; :func:`~.r3_wire.r3_kind`) is ``sglang-r3`` or ``vllm-r3``, decided by
the first line showing either server's fields (``sglext``/``meta_info`` vs ``choices[i].routed_experts``),
``sglang-r3`` when none of the first :data:`R3_PROBE` lines does (vLLM never streams them);
otherwise the first :data:`PROBE` records decide (after gzip/zstd decompression): an experts
field holding a flat id list next to a layer field is ``vllm-jsonl``; one holding a list of id
lists, or an object keyed by layer, is ``token-jsonl``; a flat id list next to a layer field and
an iteration field, without a token field, is ``engine-jsonl``. The probed records must agree; a
file that fits no shape is a one-line error listing the shapes known.

Each rule is its format's probe, registered in its module (:mod:`.registry`); here they are tried:
path probes, then (until a record is found) line probes, then record probes, ``loose`` ones last.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ...errors import ConfigError, TraceError
from ..chunked import check_chunk_sequences, write_trace_chunked
from ..core import Trace
from . import vllm, per_token, engine, sglang, r3  # noqa: F401  (they register, in FORMATS' order: keep it first)
from .engine import EngineFields
from .per_token import TokenFields
from .records import ZIP_MAGIC, iter_lines, parse_record, sniff
from .registry import Importer, Options, get, importers
from .vllm import JsonlFields

FORMATS = tuple(f.name for f in importers())
"""The formats registered when the package is imported (the CLI's choices)."""
PROBE = 8
R3_PROBE = 1000
DEFAULT_PHASE = {f.name: f.phase for f in importers() if f.phase is not None}


def shapes(vf: JsonlFields = JsonlFields(), tf: TokenFields = TokenFields(),
           ef: EngineFields = EngineFields()) -> dict[str, str]:
    """One line per format: the record shape it reads, with the field names in force."""
    return _shapes(Options(vf, tf, ef))


def _shapes(o: Options) -> dict[str, str]:
    return {f.name: f.shape(o) for f in importers()}


def _fits_none(src: str, why: str, o: Options) -> TraceError:
    known = ", ".join(f"{name} ({text})" for name, text in _shapes(o).items())
    return TraceError(f"{src}: {why}; fits none of: {known}")


def detect_format(path: str | os.PathLike, *, vllm_fields: JsonlFields = JsonlFields(),
                  token_fields: TokenFields = TokenFields(), engine_fields: EngineFields = EngineFields()) -> str:
    """The format name of ``path`` (see the module rules)."""
    src, o = str(path), Options(vllm_fields, token_fields, engine_fields)
    head = b"" if Path(path).is_dir() else sniff(path)
    for f in importers():
        if f.claims_path is not None and f.claims_path(path, head):
            return f.name
    if head.startswith(ZIP_MAGIC):
        raise _fits_none(src, "a zip archive without data.pkl", o)
    found: list[tuple[str, str]] = []
    response: tuple[str, str] | None = None  # (the first server-response line that does not tell, its default)
    with contextlib.closing(iter_lines(path)) as lines:
        for lineno, body in lines:
            if not body.strip():
                continue
            where = f"{src}:{lineno}"
            claim = None if found else _claim_line(body)
            if claim is not None:
                told, name = claim
                if told:
                    return name
                response = response or (where, name)
                if lineno >= R3_PROBE:
                    break
                continue
            if response is not None:
                shape = _shape(parse_record(body, where), o) if body.lstrip().startswith(b"{") else None
                raise TraceError(f"{where}: {'a ' + shape + ' record' if shape else 'no server response'}, "
                                 f"but {response[0]} is a server response (one shape per file)")
            try:
                rec = parse_record(body, where)
            except TraceError as exc:
                if found:
                    raise
                raise _fits_none(src, f"line {lineno} is no JSON record ({str(exc)[len(where) + 2:]})", o) from None
            shape = _shape(rec, o)
            if shape is None:
                raise _fits_none(where, "this record has no known shape", o)
            if found and shape != found[0][1]:
                raise TraceError(f"{where}: a {shape} record, but {found[0][0]} is a {found[0][1]} record (one shape per file)")
            found.append((where, shape))
            if len(found) == PROBE:
                break
    if response is not None:
        return response[1]
    if not found:
        raise TraceError(f"{src}: empty file (no records)")
    return found[0][1]


def _claim_line(body: bytes) -> tuple[bool, str] | None:
    """``(True, format)`` for a line that tells its format, ``(False, format)`` for a server response
    that does not (the format of the probe that claims it), None for a line no line probe claims."""
    for f in importers():
        kind = f.claims_line(body) if f.claims_line is not None else None
        if kind:
            return (True, kind) if get(kind) is not None else (False, f.name)
    return None


def _shape(rec: dict, o: Options) -> str | None:
    """The first format whose record probe claims ``rec`` (loose probes last), or None."""
    probes = sorted((f for f in importers() if f.claims_record is not None), key=lambda f: f.loose)
    return next((f.name for f in probes if f.claims_record(rec, o)), None)


def import_trace(
    path: str | os.PathLike,
    fmt: str = "auto",
    *,
    vllm_fields: JsonlFields = JsonlFields(),
    token_fields: TokenFields = TokenFields(),
    engine_fields: EngineFields = EngineFields(),
    num_experts: int | None = None,
    drop_incomplete: bool = False,
    pad: bool = False,
    model: str | None = None,
    phase: str | None = None,
    sequences: str = "auto",
    rank: int | None = None,
    top_k: int | None = None,
    expect_tokens: int | None = None,
    num_layers: int | None = None,
) -> tuple[Trace, str]:
    """Import ``path`` in format ``fmt`` (``'auto'``: :func:`detect_format`); returns the trace and
    the format read. ``phase`` defaults to decode for the JSONL formats, mixed for sglang, and what
    the rows show for sglang-r3/vllm-r3; ``sequences`` and ``rank`` apply to sglang only;
    ``expect_tokens`` to engine-jsonl only (which takes neither ``pad`` nor ``drop_incomplete``);
    ``top_k`` to engine-jsonl and sglang-r3, ``num_layers`` to sglang-r3 (neither takes ``pad``)."""
    f, fmt, o = _resolve(path, fmt, vllm_fields=vllm_fields, token_fields=token_fields, engine_fields=engine_fields,
                         num_experts=num_experts, drop_incomplete=drop_incomplete, pad=pad, model=model, phase=phase,
                         sequences=sequences, rank=rank, top_k=top_k, expect_tokens=expect_tokens, num_layers=num_layers)
    return f.read(path, fmt, o), fmt


def import_chunked(path: str | os.PathLike, out: str | os.PathLike, fmt: str = "auto", *, chunk_sequences: int,
                   **options):
    """:func:`import_trace` written as a chunked trace at ``out`` (:mod:`expertcache.trace.chunked`),
    ``chunk_sequences`` sequences a chunk; ``options`` are :func:`import_trace`'s. A format that
    registers ``write_chunked`` (the JSONL logs and the R3 server logs) is written while it is read,
    in memory bounded by the sequences open at once; any other is read whole, then written chunked
    in trace order (engine traces are refused: an iteration batches several sequences). Returns
    ``(ChunkedTrace, format read)``."""
    check_chunk_sequences(chunk_sequences)
    f, fmt, o = _resolve(path, fmt, **options)
    if f.write_chunked is not None:
        return f.write_chunked(path, out, fmt, o, chunk_sequences), fmt
    return write_trace_chunked(f.read(path, fmt, o), out, chunk_sequences=chunk_sequences), fmt


def _resolve(path, fmt: str, *, vllm_fields: JsonlFields = JsonlFields(), token_fields: TokenFields = TokenFields(),
             engine_fields: EngineFields = EngineFields(), num_experts: int | None = None, drop_incomplete: bool = False,
             pad: bool = False, model: str | None = None, phase: str | None = None, sequences: str = "auto",
             rank: int | None = None, top_k: int | None = None, expect_tokens: int | None = None,
             num_layers: int | None = None) -> tuple[Importer, str, Options]:
    """The importer of ``fmt`` (``'auto'``: detected), the format's name and the options it is given."""
    if fmt == "auto":
        fmt = detect_format(path, vllm_fields=vllm_fields, token_fields=token_fields, engine_fields=engine_fields)
    f = get(fmt)
    if f is None:
        raise ConfigError(f"--format: {fmt!r} is not one of auto, {', '.join(x.name for x in importers())}")
    o = Options(vllm_fields, token_fields, engine_fields, num_experts=num_experts, drop_incomplete=drop_incomplete,
                pad=pad, model=model, phase=(phase or f.phase) if f.phase is not None else phase, sequences=sequences,
                rank=rank, top_k=top_k, expect_tokens=expect_tokens, num_layers=num_layers)
    return f, fmt, o
