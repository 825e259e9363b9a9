"""Reading the R3 wire formats (:mod:`.r3`): server responses, one per JSONL line, into
:class:`R3Part` s, one per choice carrying routed experts.

Where each server puts them (docs/importers.md names the releases and source files):

* SGLang (>= 0.5.7): base64 of little-endian int32 ``[rows, num_hidden_layers, top_k]``, no
  header, in ``meta_info.routed_experts`` (native ``/generate``; a chat choice's ``meta_info`` with
  ``return_meta_info``, >= 0.5.13) or ``sglext.routed_experts`` (OpenAI routes, >= 0.5.9: response
  level, the first choice's; a list of them, or a ``sglext`` on each choice: one per choice);
* vLLM (>= 0.22): ``choices[i].routed_experts``, base64 of an ``.npy`` file (``|u1``/``<u2``,
  shape stated); vLLM 0.21: nested JSON lists over MoE layers only, with the prompt's rows in the
  response-level ``prompt_routed_experts``.

Invariants: a line is an object (or an array: a batched ``/generate``), an SSE line (``data:``,
``event:``, ``id:``, ``retry:``, a ``:`` comment) or a ``{"request", "response"}`` pair; every
payload decodes to ids in ``[0, num_experts or MAX_EXPERTS)`` in the narrowest of uint8/int16/int32;
a ``.npy`` header is checked against the bytes that follow before anything is allocated; a
response, or a stream at its end, without any payload is an error at its first line naming the
fields looked for and the server/request switch. Counts (prompt, completion tokens) and token ids
are taken from the choice's ``meta_info``, ``token_ids``/``prompt_token_ids``, the request, then
``usage`` (completion tokens only for a single choice).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..._io import numpy_reason
from ...errors import TraceError, is_int
from .records import iter_lines, parse_record
from .values import MAX_EXPERTS, index_value, short

R3_FORMATS = ("sglang-r3", "vllm-r3")
NPY_B64 = "k05VTVBZ"  # base64 of b"\x93NUMPY": vLLM's payload is an .npy file
OPEN_STREAMS = 4096  # streams awaiting their end; beyond it the oldest is ended
_SSE_OTHER = (b"event:", b"id:", b"retry:", b":")
_LOOKED = {"sglang-r3": "sglext.routed_experts, choices[i].meta_info.routed_experts, meta_info.routed_experts",
           "vllm-r3": "choices[i].routed_experts"}
_HINT = {"sglang-r3": 'start the server with --enable-return-routed-experts and send "return_routed_experts": true',
         "vllm-r3": "start the server with --enable-return-routed-experts and request stream=false "
                    "(vLLM returns them on non-streamed choices only)"}


@dataclass
class R3Part:
    """One choice's payload: ``ids`` flat (SGLang's int32) or ``[rows, L, k]``, with what places its
    rows (None where the log does not tell)."""

    where: str
    loc: str
    name: str
    ids: np.ndarray
    choice: int
    resp: int = 0
    P: int | None = None
    C: int | None = None
    start: int | None = None
    prompt: list | None = None
    output: list | None = None


@dataclass
class _Request:
    start: int | None = None
    prompts: list | None = None  # token-id prompts, when the request gives ids
    n: int = 1
    asked: object = None

    def prompt(self, i: int) -> list | None:
        return self.prompts[i // self.n] if self.prompts and i // self.n < len(self.prompts) else None


@dataclass
class _Stream:
    first: str
    name: str
    q: _Request | None
    chunked: bool = False
    parts: list = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    choices: set = field(default_factory=set)
    other: str = ""


def _ids(x: object) -> list | None:
    return x if isinstance(x, list) and all(type(v) is int for v in x) else None


def _count(d: dict, key: str, where: str, prefix: str) -> int | None:
    x = d.get(key) if isinstance(d, dict) else None
    return None if x is None else index_value(x, prefix + key, where)


def _request(req: object, where: str) -> _Request:
    if not isinstance(req, dict):
        raise TraceError(f"{where}: field 'request' must be an object, got {short(req)}")
    q = _Request(asked=req.get("return_routed_experts"))
    for key in ("routed_experts_start_len", "routed_experts_prompt_start"):
        q.start = _count(req, key, where, "request.") if req.get(key) is not None else q.start
    sp = req.get("sampling_params")
    n = req.get("n", sp.get("n") if isinstance(sp, dict) else None)
    q.n = max(1, index_value(n, "request.n", where)) if n is not None else 1
    ids = req.get("input_ids", req.get("prompt"))
    if _ids(ids) is not None:
        q.prompts = [ids]
    elif isinstance(ids, list) and ids and all(_ids(p) is not None for p in ids):
        q.prompts = ids
    return q


# ---------------------------------------------------------------------- payloads
def decode_payload(x: object, where: str, loc: str, num_experts: int | None = None) -> np.ndarray:
    """A payload as ids: flat for SGLang's base64 int32, ``[rows, L, k]`` for vLLM's base64 ``.npy``
    or nested lists; in the narrowest of uint8/int16/int32, every id in ``[0, num_experts or
    MAX_EXPERTS)``."""
    if isinstance(x, str):
        try:
            raw = base64.b64decode(x, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TraceError(f"{where}: {loc}: not valid base64 ({str(exc).splitlines()[0]})") from None
        if x.startswith(NPY_B64):
            arr = _npy(raw, where, loc)
        elif len(raw) % 4:
            raise TraceError(f"{where}: {loc}: {len(raw)} bytes, not a whole number of int32 ids (4 bytes each)")
        else:
            arr = np.frombuffer(raw, "<i4")
    elif isinstance(x, list):
        try:
            arr = np.array(x) if x else np.zeros((0, 0, 0), np.int32)
        except (ValueError, TypeError, OverflowError, RecursionError):
            arr = None
        if (arr is None or arr.ndim != 3 or arr.dtype.kind not in "iu"
                or any(type(v) is bool for row in x for layer in row for v in layer)):  # numpy reads true as 1
            raise TraceError(f"{where}: {loc}: expected [rows][layers][k] integer lists, got {short(x)}")
    else:
        raise TraceError(f"{where}: {loc}: expected a base64 string or a list of id lists, got {short(x)}")
    limit = num_experts or MAX_EXPERTS
    hi = int(arr.max()) if arr.size else 0
    if arr.size and (hi >= limit or arr.min() < 0):
        i = np.unravel_index(int(np.flatnonzero((arr.ravel() < 0) | (arr.ravel() >= limit))[0]), arr.shape)
        at = f"row {i[0]}, layer {i[1]}, slot {i[2]}" if arr.ndim == 3 else f"value #{i[0]}"
        what = f"--num-experts {num_experts}" if num_experts else f"MAX_EXPERTS = {MAX_EXPERTS}"
        raise TraceError(f"{where}: {loc}: expert id {int(arr[i])} at {at} is outside [0, {limit}) ({what})")
    return arr.astype(np.uint8 if hi < 256 else np.int16 if hi < 32768 else np.int32, copy=False)


def _npy(raw: bytes, where: str, loc: str) -> np.ndarray:
    """An ``.npy`` file's integer array of rank 3, its header checked against the bytes before use."""
    fh = io.BytesIO(raw)
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fh)
        shape, fortran, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(fh)
    except (ValueError, OSError, SyntaxError, TypeError, EOFError) as exc:
        raise TraceError(f"{where}: {loc}: not a readable .npy payload ({numpy_reason(exc)})") from None
    if dtype.kind not in "iu" or len(shape) != 3:
        raise TraceError(f"{where}: {loc}: .npy payload of {dtype} {shape}, expected integer [rows, layers, k]")
    count = int(np.prod(shape, dtype=object))
    if count * dtype.itemsize != len(raw) - fh.tell():
        raise TraceError(f"{where}: {loc}: .npy header says {shape} {dtype}, but {len(raw) - fh.tell()} data bytes follow")
    return np.frombuffer(raw, dtype, count, fh.tell()).reshape(shape, order="F" if fortran else "C")


# ---------------------------------------------------------------------- reading
class R3Reader:
    """Server responses -> :class:`R3Part` s, line by line. A stream is tracked by response id until it
    ends: ``data: [DONE]`` (the stream of the latest chunk), its usage chunk, its final ``/generate``
    chunk, or the end of the file; one without a payload is an error at its first line."""

    def __init__(self, src: str, fmt: str, num_experts: int | None):
        self.src, self.fmt, self.E = src, fmt, num_experts
        self.ready: list[R3Part] = []
        self.stats = dict(records=0, responses=0, error_responses=0, choices_without_routing=0)
        self.locations: dict[str, int] = {}

    def parts(self, path):
        streams: OrderedDict = OrderedDict()
        for lineno, body in iter_lines(path):
            if body.strip():
                self.stats["records"] += 1
                self._line(body.strip(), f"{self.src}:{lineno}", None, streams)
                yield from self._take()
        for key in list(streams):
            self._end(streams, key)
        yield from self._take()
        if not self.stats["records"]:
            raise TraceError(f"{self.src}: empty file (no records)")

    def _take(self) -> list[R3Part]:
        out, self.ready = self.ready, []
        return out

    def _line(self, body: bytes, where: str, q: _Request | None, streams: OrderedDict) -> None:
        if body.startswith(b"data:"):
            body = body[5:].strip()
            if body == b"[DONE]":
                if streams:
                    self._end(streams, next(reversed(streams)))
                return
        elif body.startswith(_SSE_OTHER):
            return
        self._response(parse_record(body, where, arrays=True), where, q, streams)

    def _response(self, obj: object, where: str, q: _Request | None, streams: OrderedDict) -> None:
        if isinstance(obj, dict) and "request" in obj and "response" in obj and q is None:
            q, local, resp = _request(obj["request"], where), OrderedDict(), obj["response"]
            if isinstance(resp, str):
                for text in resp.splitlines():
                    if text.strip():
                        self._line(text.strip().encode(), where, q, local)
            else:
                self._response(resp, where, q, local)
            for key in list(local):
                self._end(local, key)
            return
        for b, item in enumerate(obj if isinstance(obj, list) else [obj]):
            self._item(item, where, q, streams, b)

    def _item(self, obj: object, where: str, q: _Request | None, streams: OrderedDict, b: int) -> None:
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a server response object, got {short(obj)}")
        if obj.get("object") == "error" or ("error" in obj and "choices" not in obj and "meta_info" not in obj):
            self.stats["error_responses"] += 1
            return
        if isinstance(obj.get("choices"), list):
            rid = obj.get("id") if isinstance(obj.get("id"), (str, int)) else where
            chunk = str(obj.get("object", "")).endswith(".chunk") or obj.get("usage") is None or not obj["choices"]
            last = not obj["choices"] and isinstance(obj.get("usage"), dict)  # the usage chunk ends a stream
        elif isinstance(obj.get("meta_info"), dict):
            if self.fmt == "vllm-r3":
                raise TraceError(f"{where}: an SGLang /generate response (meta_info); import it as sglang-r3")
            mi = obj["meta_info"]
            rid = mi.get("id") if isinstance(mi.get("id"), (str, int)) else f"{where}#{b}"
            chunk, last = mi.get("finish_reason") is None and mi.get("routed_experts") in (None, []), False
        else:
            raise TraceError(f"{where}: not a server response (no 'choices' list, no 'meta_info' object)")
        key = (type(rid).__name__, rid)
        st = streams.pop(key, None) or _Stream(where, f"{rid}", q)
        st.chunked |= chunk
        self._collect(obj, where, st, b)
        if chunk and not last:
            streams[key] = st
            if len(streams) > OPEN_STREAMS:
                self._end(streams, next(iter(streams)))
        else:
            self._finish(st)

    def _collect(self, obj: dict, where: str, st: _Stream, b: int) -> None:
        q = st.q
        found: dict[int, tuple] = {}
        if "meta_info" in obj and "choices" not in obj:
            mi = obj["meta_info"]
            i = obj["index"] if is_int(obj.get("index")) else b
            if mi.get("routed_experts") not in (None, []):
                found[i] = ("meta_info.routed_experts", mi["routed_experts"], mi, obj, _ids(obj.get("output_ids")))
        else:
            st.usage = obj["usage"] if isinstance(obj.get("usage"), dict) else st.usage
            by_index = {}
            for j, ch in enumerate(obj["choices"]):
                if not isinstance(ch, dict):
                    raise TraceError(f"{where}: choices[{j}] must be an object, got {short(ch)}")
                i = index_value(ch.get("index", j), f"choices[{j}].index", where)
                st.choices.add(i)
                by_index[i] = ch
                mi = ch.get("meta_info") if isinstance(ch.get("meta_info"), dict) else {}
                if self.fmt == "vllm-r3":
                    cands = [(f"choices[{j}].routed_experts", ch.get("routed_experts"))]
                    st.other = st.other or ("sglang-r3" if "routed_experts" in mi else "")
                else:
                    cands = [(f"choices[{j}].meta_info.routed_experts", mi.get("routed_experts"))]
                    cands += [(f"choices[{j}].{e}.routed_experts", ch[e].get("routed_experts"))
                              for e in ("sglext", "sgl_ext") if isinstance(ch.get(e), dict)]
                    st.other = st.other or ("vllm-r3" if "routed_experts" in ch else "")
                for loc, x in cands:
                    if x is not None:
                        if isinstance(x, list) and isinstance(obj.get("prompt_routed_experts"), list):
                            loc, x = "prompt_routed_experts + " + loc, obj["prompt_routed_experts"] + x  # vLLM 0.21
                        found.setdefault(i, (loc, x, mi, ch, _ids(ch.get("token_ids"))))
            if self.fmt == "vllm-r3" and ("sglext" in obj or "sgl_ext" in obj):
                st.other = "sglang-r3"
            for e in ("sglext", "sgl_ext") if self.fmt == "sglang-r3" else ():
                x = obj[e].get("routed_experts") if isinstance(obj.get(e), dict) else None
                many = x if isinstance(x, list) else [x]
                for i, v in enumerate(many):
                    ch = by_index.get(i, {})
                    mi = ch.get("meta_info") if isinstance(ch.get("meta_info"), dict) else {}
                    if v is not None:
                        loc = f"{e}.routed_experts" + (f"[{i}]" if x is many else "")
                        found.setdefault(i, (loc, v, mi, ch, _ids(ch.get("token_ids"))))
        for i, (loc, x, mi, holder, output) in sorted(found.items()):
            prompt = _ids(holder.get("prompt_token_ids"))
            prompt = prompt if prompt is not None else _ids(obj.get("prompt_token_ids"))
            prompt = prompt if prompt is not None or q is None else q.prompt(i)
            P, C = _count(mi, "prompt_tokens", where, "meta_info."), _count(mi, "completion_tokens", where, "meta_info.")
            start = q.start if q is not None and q.start is not None else _count(
                mi, "routed_experts_start_len", where, "meta_info.")
            ids = decode_payload(x, where, loc, self.E)
            if self.fmt == "vllm-r3" and ids.ndim != 3:
                raise TraceError(f"{where}: {loc}: a raw int32 payload without a shape (SGLang's), not vLLM's base64 .npy; "
                                 "import it as sglang-r3 if SGLang wrote it")
            kind = re.sub(r"\[\d+\]", "[i]", loc)
            self.locations[kind] = self.locations.get(kind, 0) + 1
            st.parts.append(R3Part(where, loc, f"{st.name}#{i}", ids, choice=i,
                                   P=P if P is not None else (len(prompt) if prompt is not None else None),
                                   C=C if C is not None else (len(output) if output is not None else None),
                                   start=start, prompt=prompt, output=output))

    def _end(self, streams: OrderedDict, key) -> None:
        self._finish(streams.pop(key))

    def _finish(self, st: _Stream) -> None:
        if not st.parts:
            other = f" (this looks like the other server's: import it as {st.other})" if st.other else ""
            asked = (" (the request does not set return_routed_experts)"
                     if self.fmt == "sglang-r3" and st.q is not None and st.q.asked is not True else "")
            what = "stream (or it ends before its last chunk)" if st.chunked else "response"
            ident = "" if st.name.startswith(st.first) else f", id {short(st.name)}"
            raise TraceError(f"{st.first}: no routed experts in this {what}{ident}; looked for "
                             f"{_LOOKED[self.fmt]}{other}{asked}: {_HINT[self.fmt]}")
        self.stats["responses"] += 1
        self.stats["choices_without_routing"] += len(st.choices - {p.choice for p in st.parts})
        one_prompt = st.q is None or not st.q.prompts or len(st.q.prompts) == 1
        single = len(st.parts) == 1 and len(st.choices) <= 1
        for p in st.parts:
            p.resp = self.stats["responses"]
            if p.P is None and one_prompt:
                p.P = _count(st.usage, "prompt_tokens", p.where, "usage.")
            if p.C is None and single:
                p.C = _count(st.usage, "completion_tokens", p.where, "usage.")
            self.ready.append(p)


def r3_kind(body: bytes) -> str | None:
    """For ``--format auto``: 'sglang-r3' or 'vllm-r3' when a line shows that server's fields, 'r3' for
    a server response showing neither (an early stream chunk), None when it is no server response."""
    body = body.strip()
    if body.startswith(b"data:"):
        body = body[5:].strip()
        if body == b"[DONE]":
            return "r3"
    elif body.startswith(_SSE_OTHER):
        return "r3"
    try:
        obj = parse_record(body, "", arrays=True)
    except TraceError:
        return None
    return _cue(obj)


def _cue(obj: object) -> str | None:
    if isinstance(obj, list):
        cues = [_cue(x) for x in obj[:8]]
        return next((c for c in cues if c != "r3"), "r3" if cues and "r3" in cues else None)
    if not isinstance(obj, dict):
        return None
    if "request" in obj and "response" in obj:
        resp = obj["response"]
        if isinstance(resp, str):
            cues = [r3_kind(t.encode()) for t in resp.splitlines()[:64] if t.strip()]
            return next((c for c in cues if c not in ("r3", None)), "r3")
        return _cue(resp) or "r3"
    if isinstance(obj.get("meta_info"), dict) or "sglext" in obj or "sgl_ext" in obj:
        return "sglang-r3"
    if not isinstance(obj.get("choices"), list):
        return "r3" if obj.get("object") == "error" else None
    chs = [c for c in obj["choices"] if isinstance(c, dict)]
    if "prompt_routed_experts" in obj or any("routed_experts" in c for c in chs):
        return "vllm-r3"
    if any(isinstance(c.get("meta_info"), dict) or "sglext" in c for c in chs):
        return "sglang-r3"
    return "r3"
