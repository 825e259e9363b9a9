"""An OpenAI-compatible HTTP server for a GGUF MoE in a page-cache mode (``expertcache serve``).

FastAPI and uvicorn (the ``serve`` extra) carry the HTTP; llama-cpp-python's ``Llama`` (through a
:class:`~.textgen.Session`) tokenizes, applies the model's chat template, samples and keeps the KV
cache; expertcache's mode decides the expert page cache. ``llama_cpp.server``'s app is not used:
it builds its own ``Llama`` inside a module-level proxy (no seam for the observer), answers an
unknown model with the default one and a malformed body with FastAPI's 422 shape.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (streamed as server-sent events with ``"stream": true``, ending in ``data:
[DONE]``; ``stream_options.include_usage`` adds a usage chunk), ``GET /metrics`` (Prometheus text
format, :class:`Metrics`).

Invariants:

* **One slot.** One model, one request decoding at a time; the others wait in arrival order (at
  most :data:`MAX_QUEUE`; beyond, 429). A request's slot is released when its response ends, fails
  or its client goes away (a streamed response stops within one token of the disconnect).
* **Errors are OpenAI's shape**, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx
  for every mistake in a request: malformed JSON or a body over :data:`MAX_BODY_BYTES` (400, 413),
  a field out of range (400, ``param`` names it), an unknown model (404 ``model_not_found``), a
  prompt that with ``max_tokens`` exceeds the context (400 ``context_length_exceeded``), a chat to
  a model without a chat template, an unsupported option (``n`` > 1, ``logprobs``, ``echo``), an
  unknown route (404) or method (405). Anything else is a 500 of the same shape; the server keeps
  serving either way.
* **Greedy text is the model's**: ``temperature`` 0 samples the argmax with no repetition penalty,
  so a server's greedy completion equals ``expertcache llama generate``'s in every mode.
* **Routed experts** (``--enable-return-routed-experts``): a request asking ``return_routed_experts``
  gets every evaluated position's experts in SGLang's ``sglext.routed_experts`` encoding
  (:meth:`Generation.routed_experts`); without the switch the field is refused, never ignored.
* Binds 127.0.0.1 unless told otherwise; SIGTERM and SIGINT stop it cleanly (in-flight requests get
  a few seconds, then the model is closed).
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import sys
import threading
import time
import uuid
from typing import Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ConfigError
from .textgen import Session, completion_kwargs, request_figures

MAX_BODY_BYTES = 1 << 20
"""A request body larger than this is refused (413) before it is read whole."""
MAX_QUEUE = 64
"""Requests that may wait for the slot; one more is refused (429)."""
MAX_STOP = 4
"""Stop sequences per request (OpenAI's limit)."""
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class ApiError(Exception):
    """A request's mistake: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_json(self.status, self.message, self.type, self.param, self.code)


def error_json(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


# ------------------------------------------------------------------------------ requests
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream_options: dict | None = None
    logprobs: int | bool | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int | None = Field(None, ge=0)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def parse_body(raw: bytes, model_cls):
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not JSON ({str(exc)[:120]})") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body is not a JSON object")
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or None
        raise ApiError(400, f"{where or 'body'}: {err.get('msg', 'invalid')}", param=where) from None


# ------------------------------------------------------------------------------ metrics
class Metrics:
    """The counters of ``/metrics`` (Prometheus text format 0.0.4). ``requests_total`` counts a stream
    its client left before the end as code 499 (nginx's "client closed request"). Expert hits and misses are counted
    by the modes that read the routing (``managed``: its cache's steps; ``advise``, ``pin``,
    ``lookahead``, ``nocache``: whether a routed expert's pages were all resident); the others
    export no such series. ``device_read_bytes_total`` is this process's ``/proc/self/io``
    ``read_bytes``."""

    def __init__(self, session: Session):
        self.session = session
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = 0
        self.decode_rate: float | None = None
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.waiting = 0
        self.wall = None  # a callable giving the live wall state, where the server runs inside one
        self.bandwidth: dict = {}
        self._measure_bandwidth()

    def _measure_bandwidth(self) -> None:
        """The device's read bandwidth at the expert slice size, 1 and 4 readers (:mod:`.roofline`;
        cached per device for a day, else about 2 s of ``O_DIRECT`` reads before the server answers)."""
        from .roofline import device_bandwidth
        from .runner import request_bytes

        g = self.session.geometry
        try:
            for readers in (1, 4):
                self.bandwidth[readers] = device_bandwidth(g.path, request_bytes(g), readers)["bytes_per_s"]
        except OSError:
            pass  # no roofline gauges

    def roofline(self, snap: dict) -> dict:
        """The roofline of the decode steps so far (docs/serve.md, Metrics): ``c`` the rate of the
        steps that read nothing, ``D`` the bytes read per decode step, the device's bandwidths."""
        from .roofline import limits

        c = snap["resident_steps"] / snap["resident_seconds"] if snap["resident_seconds"] else None
        d = snap["decode_read_bytes"] / snap["decode_steps"] if snap["decode_steps"] else None
        rate = snap["decode_steps"] / snap["decode_seconds"] if snap["decode_seconds"] else None
        return {"compute": c, "missed": d, **limits(c, d, self.bandwidth.get(1), self.bandwidth.get(4), rate)}

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, int(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self) -> str:
        s = self.session
        snap = s.snapshot()
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP expertcache_{name} {help_}")
            lines.append(f"# TYPE expertcache_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"expertcache_{name}{{{lab}}} {value}" if lab else f"expertcache_{name} {value}")

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [({"endpoint": e, "code": c}, n) for (e, c), n in sorted(self.requests.items())] or [({}, 0)])
        if snap["expert_hits"] is not None:
            metric("expert_hits_total", "counter", "Routed experts already in the expert cache when their layer routed.",
                   [({}, snap["expert_hits"])])
            metric("expert_misses_total", "counter", "Routed experts not (wholly) in the expert cache when their layer "
                   "routed.", [({}, snap["expert_misses"])])
        if snap["read_bytes"] is not None:
            metric("device_read_bytes_total", "counter", "Bytes this process read from the device (/proc/self/io "
                   "read_bytes).", [({}, snap["read_bytes"])])
        metric("major_faults_total", "counter", "Major page faults of this process.", [({}, snap["major_faults"])])
        resident = s.advisor.resident_expert_bytes()
        if resident is not None:
            metric("resident_expert_bytes", "gauge", "Expert bytes in the page cache now (managed: the pool's residents; "
                   "else experts whose pages are all resident).", [({}, resident)])
        if s.cache_bytes is not None:
            metric("cache_memory_bytes", "gauge", "The managed pool's bound: --cache-memory less the dense part and "
                   "page slack.", [({}, s.cache_bytes)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of answered requests.", [({}, self.prompt_tokens)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [({}, self.completion_tokens)])
        metric("decode_steps_total", "counter", "One-token forwards.", [({}, snap["decode_steps"])])
        metric("decode_seconds_total", "counter", "Seconds of one-token forwards.", [({}, round(snap["decode_seconds"], 6))])
        if self.decode_rate is not None:
            metric("decode_tokens_per_second", "gauge", "Decode rate of the last request: its one-token forwards / "
                   "their seconds.", [({}, round(self.decode_rate, 4))])
        roof = self.roofline(snap)
        metric("decode_read_bytes_total", "counter", "Bytes this process read from the device during one-token "
               "forwards.", [({}, snap["decode_read_bytes"])])
        for key, name, help_ in (
                ("compute", "compute_tokens_per_second", "The compute rate: one-token forwards that read nothing / "
                 "their seconds."),
                ("limit_tokens_per_s", "limit_tokens_per_second", "The decode rate's physical limit, reads overlapped "
                 "with compute: min(compute rate, device bandwidth / bytes read per decode step)."),
                ("serial_limit_tokens_per_s", "serial_limit_tokens_per_second", "The limit with reads and compute one "
                 "after the other: 1 / (1/compute rate + bytes per step / one reader's bandwidth)."),
                ("efficiency", "efficiency", "Decode rate (every one-token forward) / limit_tokens_per_second.")):
            if roof.get(key) is not None:
                metric(name, "gauge", help_, [({}, round(roof[key], 4))])
        metric("time_to_first_token_seconds", "summary", "Request arrival to its first generated text.", [])
        lines.append(f"expertcache_time_to_first_token_seconds_sum {round(self.ttft_sum, 6)}")
        lines.append(f"expertcache_time_to_first_token_seconds_count {self.ttft_count}")
        metric("queue_waiting", "gauge", "Requests waiting for the slot.", [({}, self.waiting)])
        if self.wall is not None:
            for name, help_, value in self.wall():
                metric(name, "gauge", help_, [({}, value)])
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ generation
class Generation:
    """One request's decode, advanced one piece at a time from a worker thread (never two at once).

    :meth:`start` runs the prefill and returns the first piece (or raises :class:`ApiError` before
    anything is sent: a prompt too long for the context with its ``max_tokens``); :meth:`next`
    returns the next piece or None at the end; :meth:`close` stops the decode (idempotent)."""

    def __init__(self, session: Session, *, prompt=None, messages=None, max_tokens: int | None, body: _Sampling):
        self.session, self.body = session, body
        self.chat = messages is not None
        llm = session.llama
        n_ctx = session.n_ctx
        temperature = body.temperature
        kw = completion_kwargs(max_tokens or n_ctx, temperature, body.top_p, body.seed)
        kw.update(presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                  stop=body.stop, stream=True)
        self.max_tokens = max_tokens
        self.before = session.snapshot()
        self.sampled0 = llm.sampled
        self._it = (llm.create_chat_completion(messages=messages, **kw) if self.chat else
                    llm.create_completion(prompt, **kw))
        self.finish: str | None = None
        self.prompt_tokens: int | None = None
        self.done = False

    def _pull(self) -> str | None:
        """The next non-empty piece of text, or None when the decode has ended."""
        while not self.done:
            try:
                chunk = next(self._it)
            except StopIteration:
                self.done = True
                break
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            self.finish = choice.get("finish_reason") or self.finish
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                return piece
        return None

    def start(self) -> str | None:
        llm = self.session.llama
        try:
            first = self._pull()
        except ValueError as exc:  # llama-cpp-python: "Requested tokens (N) exceed context window of M"
            self.close()
            raise ApiError(400, str(exc), param="messages" if self.chat else "prompt",
                           code="context_length_exceeded") from None
        self.prompt_tokens = llm.prompt_length
        if self.max_tokens is not None and self.prompt_tokens + self.max_tokens > self.session.n_ctx:
            self.close()
            raise ApiError(400, f"this model's context is {self.session.n_ctx} tokens; the prompt has "
                           f"{self.prompt_tokens} and max_tokens asks {self.max_tokens} more",
                           param="max_tokens", code="context_length_exceeded")
        return first

    def next(self) -> str | None:
        return self._pull()

    def check_routed_start(self) -> None:
        """A ``routed_experts_start_len`` beyond the prompt is a 400 before anything is sent (SGLang
        aborts such a request)."""
        start = self.body.routed_experts_start_len or 0
        if start > (self.prompt_tokens or 0):
            self.close()
            raise ApiError(400, f"routed_experts_start_len {start} is beyond the prompt's {self.prompt_tokens} tokens",
                           param="routed_experts_start_len")

    def routed_experts(self) -> str:
        """SGLang's encoding of the routing of every position this request evaluated from
        ``routed_experts_start_len`` on: base64 of little-endian int32 ``[rows, layers, top_k]``, the
        layers every decoder layer (a dense one reads 0), the last sampled token (never evaluated)
        absent; prompt rows first (docs/serve.md, Routed experts)."""
        rows = self.session.llama.routing.since(self.body.routed_experts_start_len or 0, self.session.llama.n_tokens)
        return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")

    def drain(self) -> list[str]:
        """Every remaining piece (one call from the event loop's side, not one per piece)."""
        out = []
        while (piece := self._pull()) is not None:
            out.append(piece)
        return out

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._it.close()

    def usage(self) -> dict:
        llm = self.session.llama
        sampled = llm.sampled - self.sampled0
        completion = sampled - (1 if sampled and llm.last_sampled_is_eog else 0)
        return {"prompt_tokens": self.prompt_tokens or 0, "completion_tokens": completion,
                "total_tokens": (self.prompt_tokens or 0) + completion}

    def figures(self) -> dict:
        return request_figures(self.before, self.session.snapshot())


# ------------------------------------------------------------------------------ the app
def create_app(session: Session, *, model_id: str, max_queue: int = MAX_QUEUE, version: str = "") -> FastAPI:
    """The FastAPI app serving ``session`` as model ``model_id`` (see the module docstring)."""
    app = FastAPI(title="expertcache", version=version, docs_url=None, redoc_url=None)
    metrics = Metrics(session)
    app.state.metrics, app.state.session = metrics, session
    slot = asyncio.Lock()
    created = int(time.time())

    def label(request: Request) -> str:
        """The ``endpoint`` label: a served path, else ``other`` (a client cannot grow the series)."""
        return request.url.path if request.url.path in ENDPOINTS else "other"

    @app.middleware("http")
    async def bounded_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            metrics.count(label(request), 413)
            return error_json(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        metrics.count(label(request), exc.status_code)
        return error_json(exc.status_code, f"{request.method} {request.url.path[:100]}: {exc.detail}",
                          code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        print(f"expertcache serve: error in {request.url.path[:100]}: {type(exc).__name__}: {str(exc)[:300]}",
              file=sys.stderr)
        metrics.count(label(request), 500)
        return error_json(500, f"internal error ({type(exc).__name__})", "server_error")

    async def read_body(request: Request) -> bytes:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return bytes(raw)

    def check_model(body: _Sampling) -> None:
        if body.model not in (None, "", model_id):
            raise ApiError(404, f"The model `{body.model[:200]}` does not exist (this server serves `{model_id}`)",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, "n: one choice per request is served", param="n")
        if body.logprobs not in (None, False):
            raise ApiError(400, "logprobs are not served", param="logprobs")
        if body.return_routed_experts and session.llama.routing is None:
            raise ApiError(400, "this server does not return routed experts: start it with "
                           "--enable-return-routed-experts", param="return_routed_experts", code="routed_experts_disabled")
        if body.routed_experts_start_len is not None and not body.return_routed_experts:
            raise ApiError(400, "routed_experts_start_len needs return_routed_experts", param="routed_experts_start_len")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} sequences", param="stop")

    async def acquire() -> None:
        if metrics.waiting >= max_queue:
            raise ApiError(429, f"{metrics.waiting} requests are waiting for the one slot; retry later",
                           "rate_limit_error", code="queue_full")
        metrics.waiting += 1
        try:
            await slot.acquire()
        finally:
            metrics.waiting -= 1

    async def generate(request: Request, kind: str):
        t0 = time.perf_counter()
        endpoint = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        try:
            raw = await read_body(request)
            if kind == "completion":
                body = parse_body(raw, CompletionRequest)
                prompt = body.prompt
                if isinstance(prompt, list):
                    if len(prompt) != 1:
                        raise ApiError(400, "prompt: one prompt per request is served", param="prompt")
                    prompt = prompt[0]
                if body.echo:
                    raise ApiError(400, "echo is not served", param="echo")
                args = {"prompt": prompt, "max_tokens": body.max_tokens}
            else:
                body = parse_body(raw, ChatRequest)
                if not session.chat_ready:
                    raise ApiError(400, f"{model_id} has no chat template; use /v1/completions, or restart the server "
                                   "with --chat-format", param="messages", code="chat_template_missing")
                messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
                             else "".join(p.text for p in m.content)} for m in body.messages]
                args = {"messages": messages, "max_tokens": body.max_completion_tokens or body.max_tokens}
            check_model(body)
        except ApiError as exc:
            metrics.count(endpoint, exc.status)
            return exc.response()
        try:
            await acquire()
        except ApiError as exc:
            metrics.count(endpoint, exc.status)
            return exc.response()
        gen = None
        try:
            if await request.is_disconnected():
                raise anyio.get_cancelled_exc_class()()
            gen = Generation(session, body=body, **args)
            first = await anyio.to_thread.run_sync(gen.start)
            if body.return_routed_experts:
                gen.check_routed_start()
        except ApiError as exc:
            slot.release()
            metrics.count(endpoint, exc.status)
            return exc.response()
        except BaseException:
            if gen is not None:
                await anyio.to_thread.run_sync(gen.close)
            slot.release()
            raise
        ttft = time.perf_counter() - t0
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]

        def finished() -> dict:
            usage = gen.usage()
            figures = gen.figures()
            metrics.prompt_tokens += usage["prompt_tokens"]
            metrics.completion_tokens += usage["completion_tokens"]
            metrics.ttft_sum += ttft
            metrics.ttft_count += 1
            if figures["decode_tokens_per_s"] is not None:
                metrics.decode_rate = figures["decode_tokens_per_s"]
            return usage

        if not body.stream:
            try:
                pieces = ([first] if first else []) + await anyio.to_thread.run_sync(gen.drain)  # one hop
                usage = finished()
                routed = gen.routed_experts() if body.return_routed_experts else None
            finally:
                await anyio.to_thread.run_sync(gen.close)
                slot.release()
            metrics.count(endpoint, 200)
            text = "".join(pieces)
            if kind == "completion":
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish or "stop"}
                obj = "text_completion"
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": gen.finish or "stop"}
                obj = "chat.completion"
            out = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice],
                   "usage": usage}
            if body.return_routed_experts:
                out["sglext"] = {"routed_experts": routed}
            return JSONResponse(out)

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

        def chunk(piece: str | None, finish: str | None, first_chunk: bool = False) -> str:
            if kind == "completion":
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            else:
                delta = {"role": "assistant", "content": piece or ""} if first_chunk else \
                    ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                          "choices": [choice]}) + "\n\n"

        completed = []
        producer = Producer(gen, asyncio.get_running_loop())

        async def events():
            piece = first
            yield chunk(piece, None, first_chunk=True)
            while True:
                piece = await producer.get()
                if piece is None:
                    break
                yield chunk(piece, None)
            yield chunk(None, gen.finish or "stop")
            usage = finished()
            if body.return_routed_experts:  # SGLang's tail: one chunk without choices carrying them
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                             "choices": [], "sglext": {"routed_experts": gen.routed_experts()}}) + "\n\n"
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                             "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            completed.append(True)

        async def release() -> None:
            await producer.stop()
            slot.release()
            metrics.count(endpoint, 200 if completed else 499)  # 499: the client closed the stream first

        return SlotStream(events(), release)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models():
        metrics.count("/v1/models", 200)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "expertcache"}]}

    @app.get("/health")
    async def health():
        metrics.count("/health", 200)
        return {"status": "ok", "model": model_id, "mode": session.mode, "waiting": metrics.waiting,
                "busy": slot.locked()}

    @app.get("/metrics")
    async def prometheus():
        metrics.count("/metrics", 200)
        text = await anyio.to_thread.run_sync(metrics.render)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


class Producer:
    """A streamed request's decode on a thread of its own, handing each piece to the event loop
    (``call_soon_threadsafe``: one wake-up per piece, not a thread-pool round trip). :meth:`stop`
    asks it to end after the piece being decoded, waits until it has, and stops the decode."""

    def __init__(self, gen: Generation, loop: asyncio.AbstractEventLoop):
        self.gen, self.loop = gen, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.halt = threading.Event()
        self.finished = asyncio.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            while not self.halt.is_set():
                piece = self.gen.next()
                self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)
                if piece is None:
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the stream, which ends with it
            self.loop.call_soon_threadsafe(self.queue.put_nowait, exc)
        finally:
            self.gen.close()
            self.loop.call_soon_threadsafe(self.finished.set)

    async def get(self) -> str | None:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def stop(self) -> None:
        self.halt.set()
        await self.finished.wait()


class WallGauge:
    """The live proof of a server inside ``serve --memory-wall``: the GGUF's page cache now and its
    peak (sampled every 50 ms by a thread of its own, as the wall's sampler measures it: the
    file's cached bytes), the capacity, the proof's slack, the cgroup's limit now, and whether the
    peak has stayed within the capacity + slack so far (the wall's parent process reads the same
    measure and prints the final proof when the server stops)."""

    def __init__(self, path: str, capacity: int):
        import threading

        from ..wall.pagecache import FileCache
        from ..wall.capacity import proof_slack

        self.files, self.capacity, self.slack = FileCache([path]), capacity, proof_slack(capacity)
        self.peak = self.files.bytes()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.files.bytes())

    def limit(self) -> int | None:
        from ..wall.cgroupfs import locate_memory_cgroup, read_int

        loc, _ = locate_memory_cgroup()
        if loc is None:
            return None
        return read_int(f"{loc['dir']}/{'memory.limit_in_bytes' if loc['version'] == 'v1' else 'memory.high'}")

    def __call__(self) -> list[tuple[str, str, float]]:
        now = self.files.bytes()
        self.peak = max(self.peak, now)
        out = [("wall_capacity_bytes", "The memory wall: the most the model's page cache may hold.", self.capacity),
               ("wall_tier_bytes", "The model file's page cache now (cachestat).", now),
               ("wall_tier_peak_bytes", "The most the model file's page cache held since the server started.",
                self.peak),
               ("wall_proof_ok", "1 while the peak has stayed within the capacity + the proof's slack.",
                int(self.peak <= self.capacity + self.slack))]
        lim = self.limit()
        if lim is not None:
            out.append(("wall_limit_bytes", "The cgroup limit now (it follows the server's own memory).", lim))
        return out


class SlotStream(StreamingResponse):
    """A server-sent event stream that releases the slot however it ends: done, failed, or its
    client gone (the release waits for the piece being decoded, then stops the decode)."""

    def __init__(self, content, release):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()


def serve(session: Session, *, host: str = "127.0.0.1", port: int = 8000, model_id: str,
          announce=None, wall_state=None, version: str = "") -> None:
    """Serve until SIGTERM / SIGINT. The socket is bound first (``port`` 0: any free port), then
    ``announce(url)`` is called (the CLI prints it), then requests are answered."""
    import socket

    import uvicorn

    app = create_app(session, model_id=model_id, version=version)
    if wall_state is not None:
        app.state.metrics.wall = wall_state
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    sock.listen(128)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            lifespan="off", h11_max_incomplete_event_size=64 * 1024)
    server = uvicorn.Server(config)
    if announce is not None:
        announce(f"http://{f'[{host}]' if ':' in host else host}:{bound}")
    # uvicorn catches SIGTERM/SIGINT to shut down, then re-raises them to the handlers it found: make
    # those note the signal only, so that the model is closed and the process exits 0
    stops: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
