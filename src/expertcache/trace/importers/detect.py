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
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from pathlib import Path

from ...errors import ConfigError, TraceError
from ..core import Trace
from .engine import EngineFields, import_engine_jsonl
from .per_token import TokenFields, import_token_jsonl
from .r3 import import_r3
from .r3_wire import R3_FORMATS, r3_kind
from .records import ZIP_MAGIC, iter_lines, open_regular, parse_record
from .sglang import import_sglang
from .vllm import JsonlFields, import_vllm_jsonl

FORMATS = ("vllm-jsonl", "token-jsonl", "engine-jsonl", "sglang", *R3_FORMATS)
PROBE = 8
R3_PROBE = 1000
DEFAULT_PHASE = {"vllm-jsonl": "decode", "token-jsonl": "decode", "engine-jsonl": "decode", "sglang": "mixed"}


def shapes(vf: JsonlFields = JsonlFields(), tf: TokenFields = TokenFields(),
           ef: EngineFields = EngineFields()) -> dict[str, str]:
    """One line per format: the record shape it reads, with the field names in force."""
    return {
        "vllm-jsonl": f"one JSON record per token and layer: {vf.seq}/{vf.layer}/{vf.token}/{vf.experts} with a flat id list",
        "token-jsonl": f"one JSON record per token: {tf.seq}/{tf.token}/{tf.experts} holding a list of id lists "
                       "or an object keyed by layer",
        "engine-jsonl": f"one JSON record per engine iteration and layer: {ef.iteration}/{ef.layer}/{ef.experts} "
                        f"with a flat id list and no {vf.token} (speculative decoding)",
        "sglang": "a torch.save dump of SGLang's expert-distribution recorder in per_token mode, or a folder of them",
        "sglang-r3": "SGLang server responses with routed experts (sglext.routed_experts or meta_info.routed_experts), "
                     "streamed or not",
        "vllm-r3": "vLLM server responses with routed experts (choices[i].routed_experts)",
    }


def _fits_none(src: str, why: str, vf: JsonlFields, tf: TokenFields, ef: EngineFields = EngineFields()) -> TraceError:
    known = ", ".join(f"{name} ({text})" for name, text in shapes(vf, tf, ef).items())
    return TraceError(f"{src}: {why}; fits none of: {known}")


def detect_format(path: str | os.PathLike, *, vllm_fields: JsonlFields = JsonlFields(),
                  token_fields: TokenFields = TokenFields(), engine_fields: EngineFields = EngineFields()) -> str:
    """The format name of ``path`` (see the module rules)."""
    src, vf, tf, ef = str(path), vllm_fields, token_fields, engine_fields
    if Path(path).is_dir():
        return "sglang"
    with open_regular(path) as fh:
        magic = fh.read(4)
        if magic.startswith(ZIP_MAGIC):
            try:
                names = zipfile.ZipFile(fh).namelist()
            except (zipfile.BadZipFile, OSError, ValueError):
                names = []
            if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
                return "sglang"
            raise _fits_none(src, "a zip archive without data.pkl", vf, tf, ef)
    found: list[tuple[str, str]] = []
    r3: tuple[str, str] | None = None  # (first server-response line, its kind)
    with contextlib.closing(iter_lines(path)) as lines:
        for lineno, body in lines:
            if not body.strip():
                continue
            where = f"{src}:{lineno}"
            kind = r3_kind(body) if not found else None
            if kind is not None:
                if kind != "r3":
                    return kind
                r3 = r3 or (where, kind)
                if lineno >= R3_PROBE:
                    break
                continue
            if r3 is not None:
                shape = _shape(parse_record(body, where), vf, tf, ef) if body.lstrip().startswith(b"{") else None
                raise TraceError(f"{where}: {'a ' + shape + ' record' if shape else 'no server response'}, but {r3[0]} "
                                 "is a server response (one shape per file)")
            try:
                rec = parse_record(body, where)
            except TraceError as exc:
                if found:
                    raise
                raise _fits_none(src, f"line {lineno} is no JSON record ({str(exc)[len(where) + 2:]})", vf, tf, ef) from None
            shape = _shape(rec, vf, tf, ef)
            if shape is None:
                raise _fits_none(where, "this record has no known shape", vf, tf, ef)
            if found and shape != found[0][1]:
                raise TraceError(f"{where}: a {shape} record, but {found[0][0]} is a {found[0][1]} record (one shape per file)")
            found.append((where, shape))
            if len(found) == PROBE:
                break
    if r3 is not None:
        return "sglang-r3"
    if not found:
        raise TraceError(f"{src}: empty file (no records)")
    return found[0][1]


def _shape(rec: dict, vf: JsonlFields, tf: TokenFields, ef: EngineFields = EngineFields()) -> str | None:
    ex = rec.get(tf.experts)
    if isinstance(ex, dict) or (isinstance(ex, list) and ex and all(isinstance(x, list) for x in ex)):
        return "token-jsonl"
    ex = rec.get(ef.experts)
    if (ef.layer in rec and ef.iteration in rec and vf.token not in rec and isinstance(ex, list)
            and not any(isinstance(x, (list, dict)) for x in ex)):
        return "engine-jsonl"
    ex = rec.get(vf.experts)
    if vf.layer in rec and isinstance(ex, list) and not any(isinstance(x, (list, dict)) for x in ex):
        return "vllm-jsonl"
    return None


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
    if fmt == "auto":
        fmt = detect_format(path, vllm_fields=vllm_fields, token_fields=token_fields, engine_fields=engine_fields)
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of auto, {', '.join(FORMATS)}")
    if fmt == "engine-jsonl":
        if pad or drop_incomplete:
            raise ConfigError(f"--{'pad' if pad else 'drop-incomplete'} does not apply to engine-jsonl "
                              "(its typing needs every record)")
        return import_engine_jsonl(path, fields=engine_fields, num_experts=num_experts, top_k=top_k,
                                   expect_tokens=expect_tokens, model=model, phase=phase or DEFAULT_PHASE[fmt]), fmt
    if fmt in R3_FORMATS:
        if pad:
            raise ConfigError(f"--pad does not apply to {fmt} (every row holds the server's k ids)")
        return import_r3(path, fmt, num_experts=num_experts, num_layers=num_layers, top_k=top_k,
                         drop_incomplete=drop_incomplete, model=model, phase=phase), fmt
    common = dict(num_experts=num_experts, drop_incomplete=drop_incomplete, pad=pad, model=model,
                  phase=phase or DEFAULT_PHASE[fmt])
    if fmt == "vllm-jsonl":
        return import_vllm_jsonl(path, fields=vllm_fields, **common), fmt
    if fmt == "token-jsonl":
        return import_token_jsonl(path, fields=token_fields, **common), fmt
    return import_sglang(path, sequences=sequences, rank=rank, **common), fmt
