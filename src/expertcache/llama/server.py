"""An OpenAI-compatible HTTP server for a GGUF MoE in a page-cache mode (``expertcache serve``).

FastAPI and uvicorn (the ``serve`` extra) carry the HTTP; llama-cpp-python's ``Llama`` (through a
:class:`~.textgen.Session`) tokenizes, applies the model's chat template, samples and keeps the KV
cache; expertcache's mode decides the expert page cache. ``llama_cpp.server``'s app is not used:
it builds its own ``Llama`` inside a module-level proxy (no seam for the observer), answers an
unknown model with the default one and a malformed body with FastAPI's 422 shape.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (streamed as server-sent events with ``"stream": true``, ending in ``data:
[DONE]``; ``stream_options.include_usage`` adds a usage chunk), OpenAI's ``POST /v1/responses`` and
``POST /v1/responses/input_tokens`` (:mod:`.responses`), Anthropic's ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`.anthropic`): the chat path in their shapes,
``GET /metrics`` (Prometheus text format, :class:`Metrics`); llama.cpp's server's ``POST
/completion`` (its native API: :mod:`.native`), ``/tokenize``, ``/detokenize``, ``/apply-template``,
``/v1/chat/completions/input_tokens`` and ``GET /props`` (:data:`LLAMA_PATHS`).

Invariants:

* **One slot.** One model, one request decoding at a time; the others wait in arrival order (at
  most :data:`MAX_QUEUE`; beyond, 429). A request's slot is released when its response ends, fails
  or its client goes away: a waiting request looks every :data:`POLL_SECONDS`, a decoding one stops
  before its next token (:mod:`.completion` yields a chunk per token), and either is counted 499.
* **Bounded by clients.** At most ``--max-connections`` open (one more: 503, closed unread); a
  request's headers and body read within ``--request-timeout`` of its first byte, else closed
  (:func:`guarded_protocol`); bodies over :data:`MAX_BODY_BYTES` refused. So a flood holds at most
  ``max_connections`` bodies and descriptors.
* **Errors are OpenAI's shape** (a dialect's own on its paths: :data:`DIALECT_PATHS`),
  ``{"error": {"message", "type", "param", "code"}}``, with a 4xx
  for every mistake in a request: malformed JSON or a body over :data:`MAX_BODY_BYTES` (400, 413),
  a field out of range (400, ``param`` names it), an unknown model (404 ``model_not_found``), a
  prompt that with ``max_tokens`` exceeds the context (400 ``context_length_exceeded``), a chat to
  a model without a chat template, a field of the wrong JSON type (no coercion), a string holding
  a lone surrogate, an empty prompt or stop sequence, an option that would change the result and
  is not implemented (``n`` > 1, ``suffix``, ``tool_choice`` ``auto`` where the chat template
  teaches no call format this server reads, ...), an unknown
  route (404) or method (405), a request the HTTP parser refuses (400). Anything else is a 500 of
  the same shape and one line on stderr (:class:`Guard`; uvicorn's and asyncio's records are folded
  to one line: :func:`one_line`); the server keeps serving either way.
* **Greedy text is the model's**: ``temperature`` 0 samples the argmax with no repetition penalty,
  so a server's greedy completion equals ``expertcache llama generate``'s in every mode.
* **Log-probabilities** (``logprobs``): one entry per token sampled, the end-of-generation token
  left out as the usage leaves it out (so as many as ``completion_tokens``), each the log-softmax of
  the logits it was sampled from (:func:`~.textgen.token_logprobs`) in OpenAI's shape
  (:class:`Logprobs`); a stream sends each token's entry with the chunk that sends its text. With
  ``echo`` the prompt's tokens come first, each scored by the row before it (the prompt evaluated
  whole, every row's logits read: :attr:`~.textgen.ObservedLlama.prompt_logprobs`).
* **Structured output and tools**: ``response_format``'s JSON schema, and a forced tool call's
  parameters, become a grammar every token keeps to (:mod:`.constraints`: a keyword the grammar would
  not hold is a 400, never ignored; the grammar checks the token the chain drew, as llama.cpp's own
  sampler); with a chat template that teaches a call format (Hermes', Qwen3-Coder's XML, GLM's,
  MiniMax's, DeepSeek's V3 and V3.2 (DSML), Kimi's, Mistral's, LFM2's, gpt-oss's channels), the
  model's calls are read back into ``tool_calls`` (:mod:`.toolcalls`), a block that is not a valid
  call left in the content as written (:func:`tool_plan`).
* **Routed experts** (``--enable-return-routed-experts``): a request asking ``return_routed_experts``
  gets every evaluated position's experts in SGLang's ``sglext.routed_experts`` encoding
  (:meth:`Generation.routed_experts`); without the switch the field is refused, never ignored.
* **A request starts no thread.** Its decode and the rendering of ``/metrics`` run on two threads
  made at the start (:class:`Workers`; ``expertcache serve`` makes them before the model loads).
  Inside ``serve --memory-wall`` a new thread's stack and kernel memory would be charged to a cgroup
  whose limit hugs the server after its warm-up.
* Binds 127.0.0.1 unless told otherwise; SIGTERM and SIGINT stop it cleanly: the decode in progress
  ends before its next token (a stream gets an error event, a non-streamed request a 503), waiting
  requests get a 503, the model is closed, exit 0.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import collections
import concurrent.futures
import contextlib
import hmac
import math
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Literal

import anyio
import llama_cpp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse as _JSONResponse
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from ..errors import ConfigError
from .completion import (PromptError, arguments_as_objects, chat_prompt, preserved_tokens, prompt_tokens,
                         rendered_roles, stream_chat, stream_completion, template_reads, template_variables)
from .callgrammar import FORMS, HARMONY_MESSAGES, Thinking, call_grammar, writes
from .constraints import ConstraintError, logit_bias, response_grammar
from .reasoning import MARKERS as THINK_MARKERS
from .reasoning import DEEPSEEK, HarmonyStream, ThinkStream, opens_thinking, read_harmony, split_reasoning, think_format
from .reasoning import BREAKS as THINK_BREAKS
from .reasoning import TAGS as THINK_TAGS
from .toolcalls import MARKERS as CALL_MARKERS
from .toolcalls import (ALTERNATIVES, DSV4, ENDS_THINKING, GEMMA4, GEMMA4_REOPEN, GEMMA4_TOOL_ROLE, HARMONY, KIMI_K3,
                        MINIMAX_M3, TAGS, TaggedCalls, call_format, gemma4_tool_responses, new_call_id, parse_tagged,
                        results_in_call_order)
from . import MAX_SEED, anthropic, native, responses
from .native import LLAMA_UNSERVED
from .dialect import ToolName
from .textgen import Session, completion_kwargs, request_figures, token_bytes

MAX_BODY_BYTES = 1 << 20
"""A request body larger than this is refused (413) before it is read whole."""
MAX_QUEUE = 64
"""Requests that may wait for the slot; one more is refused (429)."""
MAX_STOP = 4
"""Stop sequences per request (OpenAI's limit)."""
MAX_STOP_CHARS = 1000
"""Characters per stop sequence (each token's text is checked against every prefix of each)."""
MAX_CONNECTIONS = 2 * MAX_QUEUE
"""Open connections; one more is answered 503 and closed at once (bounded memory and descriptors)."""
REQUEST_SECONDS = 30.0
"""A request's headers and body must arrive within this many seconds of its first byte (or of the
connection, for one that sends nothing); else the connection is closed."""
MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (``logprobs`` of a completion, ``top_logprobs``
of a chat: OpenAI's chat limit)."""
POLL_SECONDS = 0.25
"""How often a waiting or non-streamed request looks whether its client is still there."""
DIALECTS = {"anthropic": anthropic, "responses": responses}
"""APIs answered by the chat path in their own shapes: each a module with ``Request``,
``CountRequest``, ``to_chat``, ``asked_fields``, ``error_body``, ``new_id``, ``answer``,
``counted`` and ``EventStream`` (:mod:`.anthropic`, :mod:`.responses`)."""
DIALECT_ROUTES = {"anthropic": ("/v1/messages", "/v1/messages/count_tokens"),
                  "responses": ("/v1/responses", "/v1/responses/input_tokens")}
"""Each dialect's paths: a request answered, and one counted."""
DIALECT_PATHS = {path: name for name, paths in DIALECT_ROUTES.items() for path in paths}
"""The dialect of each of its paths (its errors in its shape; every other path: OpenAI's)."""
LLAMA_PATHS = ("/completion", "/tokenize", "/detokenize", "/apply-template", "/props",
               "/v1/chat/completions/input_tokens")
"""llama.cpp's server's paths served here besides OpenAI's (its native ``/completion``: :mod:`.native`;
``/tokenize``, ``/detokenize``, ``/apply-template``, ``GET /props``, and its count of a chat's prompt)."""
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions") + \
    tuple(DIALECT_PATHS) + LLAMA_PATHS


class JSONResponse(_JSONResponse):
    """Starlette's JSON answer, a lone surrogate in a text (a model's ``\\ud800`` escape in a call's
    arguments, which JSON reads as such) written as the same escape: UTF-8 cannot hold it, and the
    answer was a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", "backslashreplace")


class ApiError(Exception):
    """A request's mistake: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self, dialect: str = "openai") -> JSONResponse:
        return error_json(self.status, self.message, self.type, self.param, self.code, dialect)


def error_json(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, dialect: str = "openai") -> JSONResponse:
    """An error answer: OpenAI's shape, or a dialect's (:data:`DIALECTS`: its ``error_body``)."""
    if dialect in DIALECTS:
        return JSONResponse(DIALECTS[dialect].error_body(status, message, type_, param, code), status_code=status)
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


# ------------------------------------------------------------------------------ requests
class _Strict(BaseModel):
    """A request's part: unknown fields ignored (OpenAI's clients send some), known ones typed strictly
    (``"0.5"``, ``true`` or ``5.0`` where a number, a bool or an integer goes is a 400, not a
    coercion)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class _JsonSchema(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the grammar holds the output to the schema either way


class ResponseFormat(_Strict):
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with its schema), and
    llama-cpp-python's server's ``json_object`` with a ``schema`` beside it (:mod:`.constraints`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None
    schema_: dict | None = Field(None, alias="schema")


class _Sampling(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    top_k: int | None = Field(None, ge=0)  # llama.cpp's and vLLM's extension (Anthropic's field); 0: off
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream_options: dict | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = None  # token id -> [-100, 100] (constraints.logit_bias)
    response_format: ResponseFormat | None = None
    # llama.cpp's sampling extensions (its server's names and defaults), served
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)  # over the last 64 tokens
    mirostat: Literal[0, 1, 2] = 0
    mirostat_tau: float = Field(5.0, ge=0.0, le=100.0)
    mirostat_eta: float = Field(0.1, ge=0.0, le=10.0)
    # OpenAI's options this server does not implement: refused when set (check_request), never ignored
    best_of: int | None = None
    # llama.cpp's that it does not: refused where their value would change the answer (LLAMA_UNSERVED)
    repeat_last_n: int | None = None
    dynatemp_range: float | None = None
    xtc_probability: float | None = None
    dry_multiplier: float | None = None
    top_n_sigma: float | None = None
    grammar: str | None = None
    n_probs: int | None = None
    ignore_eos: bool | None = None
    samplers: list | str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids; a list of one prompt
    max_tokens: int | None = Field(16, ge=1)  # null: OpenAI's default, 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # N: the sampled token's and the N likeliest
    echo: bool = False
    suffix: str | None = None
    top_logprobs: int | None = None  # a chat field: refused here


class _Part(_Strict):
    type: Literal["text"]
    text: str


class _CalledFunction(_Strict):
    name: str
    arguments: str


class _ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: _CalledFunction


class Message(_Strict):
    """A chat message; an assistant's ``tool_calls`` and a tool message's ``tool_call_id`` go to the
    chat template as given (a template that has no place for them leaves them out)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's thinking, as this server answered it


class _Function(_Strict):
    name: ToolName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: an object with no properties
    strict: bool | None = None  # the grammar holds the arguments to the schema either way


class Tool(_Strict):
    type: Literal["function"]
    function: _Function


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


class TokenizeRequest(_Strict):
    """llama.cpp's ``/tokenize``: ``content`` to token ids."""

    content: str
    add_special: bool = False  # BOS where the vocabulary adds one
    parse_special: bool = True  # a special token's text read as that token
    with_pieces: bool = False  # each id with its text: a string, or its bytes where they are not UTF-8


class DetokenizeRequest(_Strict):
    """llama.cpp's ``/detokenize``: token ids to their text."""

    tokens: list[int]


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's and llama.cpp's default for such templates)
    functions: list | None = None
    function_call: str | dict | None = None
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None  # None: the server's (--reasoning-format)
    chat_template_kwargs: dict | None = None  # variables for the chat template (enable_thinking), over the server's


@dataclass
class ToolPlan:
    """What a chat's ``tools`` and ``tool_choice`` make of its decode (:func:`tool_plan`)."""

    offered: list
    """The tools, to the chat template (which shows them to the model where it has a place)."""
    arguments_of: Tool | None = None
    """The text is this tool's arguments, under its parameters' grammar (a call forced on a model
    whose call format this server does not read)."""
    parsed: bool = False
    """The text is read for calls in the model's own format (:mod:`.toolcalls`)."""
    forced: list | None = None
    """With ``parsed``: a call to one of these is forced by grammar (``required``, or a name)."""
    named: bool = False
    """``tool_choice`` named the function: a completed call finishes ``stop`` (OpenAI's answer), else ``tool_calls``."""
    form: str | None = None
    """With ``forced``: the call format its grammar writes (:mod:`.callgrammar`)."""
    thinking: Thinking | None = None
    """With ``forced``: the thinking block the call may follow (a reasoning model's)."""
    parallel: bool = False
    """With ``forced``: one call or more (``parallel_tool_calls`` not false), else one."""

    @property
    def template_tools(self) -> list[dict]:
        """The offered tools as the chat template is given them (the decode's, and a count's)."""
        return [t.model_dump(exclude_none=True) for t in self.offered]

    @property
    def sets_grammar(self) -> bool:
        """The decode's grammar comes from a tool's parameters (a call is forced)."""
        return bool(self.forced) or self.arguments_of is not None


def tool_plan(body, call_fmt: str | None, forms: tuple = FORMS, thinking: Thinking | None = None) -> ToolPlan | None:
    """The :class:`ToolPlan` of a chat, or None where no tool is offered or ``tool_choice`` is
    ``none``. With a template that teaches a call format this server reads (``call_fmt``:
    :func:`~.toolcalls.call_format`), ``auto`` lets the model answer or call, ``required`` and a
    named function force a call in that format by grammar. Without one, a named function (or
    ``required`` with one tool) makes the text the call's arguments, and ``auto`` is a 400 (a call
    the model wrote in its own format would be read as text); so is ``required`` among several tools
    there, and a name no tool has. A forced call is written in the model's own format by
    :mod:`.callgrammar`'s grammar where it writes that format and can hold the tools' parameters
    (:func:`~.callgrammar.writes`; ``forms``: those it may write here), after a thinking block, maybe
    (``thinking``: :attr:`ToolPlan.thinking`), one call or more unless ``parallel_tool_calls`` is
    false; elsewhere it is its arguments under the grammar (one call), as for other templates."""
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ApiError(400, "tool_choice: no tools are given", param="tool_choice")
    named = None
    if isinstance(choice, NamedToolChoice):
        named = next((t for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise ApiError(400, f"tool_choice.function.name: no tool is named {choice.function.name[:64]!r}",
                           param="tool_choice")
    if call_fmt is not None and choice == "auto":  # their blocks; gpt-oss's channels (.reasoning)
        return ToolPlan(offered=tools, parsed=True)
    forced = [named] if named is not None else tools
    if call_fmt in forms and writes(call_fmt, [(t.function.name, t.function.parameters) for t in forced]):
        return ToolPlan(offered=tools, parsed=True, named=named is not None, forced=forced, form=call_fmt,
                        thinking=thinking, parallel=getattr(body, "parallel_tool_calls", None) is not False)
    if choice == "auto":
        raise ApiError(400, "tool_choice auto: this model's chat template teaches no tool-call format this server "
                       "reads (it reads the Hermes <tool_call> JSON of Qwen3 and others, Qwen3-Coder's and Qwen3.5's "
                       "XML, GLM-4.5's, MiniMax-M2's and M3's, DeepSeek's V3, V3.2 and V4, Kimi K2's and K3's, "
                       "Mistral's, LFM2's, Gemma 4's, gpt-oss's); name the function "
                       "({\"type\": \"function\", \"function\": {\"name\": ...}}), or give one tool with \"required\", "
                       "or \"none\"", param="tool_choice")
    if choice == "required" and len(tools) != 1:
        why = "teaches no tool-call format this server reads" if call_fmt is None else \
            f"teaches {call_fmt}'s format, in which " + (
                "these tools' parameters cannot be held by a grammar (a text value with a pattern, a format or a "
                "length over 10,000; a key or name holding <, >, \", & or white space at an end; in Gemma 4's, "
                "a $ref or a schema of any value; in LFM2's, a name or key that is not a Python name)"
                if call_fmt in forms else "this server does not force a call")
        raise ApiError(400, f"tool_choice required: {len(tools)} tools given, and this model's chat template {why}; "
                       "give one, or name the function", param="tool_choice")
    return ToolPlan(offered=tools, arguments_of=named or tools[0], named=named is not None)


def parse_body(raw: bytes, model_cls):
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not JSON ({str(exc)[:120]})") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ApiError(400, f"the request body holds a number Python will not read ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body is not a JSON object")
    where = lone_surrogate(obj)
    if where is not None:
        raise ApiError(400, f"{where}: not Unicode text (a lone surrogate escape such as \\ud800)",
                       param=where.split("[", 1)[0].split(".", 1)[0])
    return validated(obj, model_cls)


def validated(obj: dict, model_cls):
    """``obj`` read as ``model_cls``; a 400 naming the first field at fault otherwise (where a
    union's members all fail, the deepest member's error: ``messages.0.content`` a list whose block
    is of no type served says so, not that the list is no string)."""
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0].get("loc", ())[:1]
        err = max((e for e in errors if e.get("loc", ())[:1] == first), key=lambda e: len(e.get("loc", ())))
        loc = tuple(x for x in err.get("loc", ()) if "[" not in str(x))  # a member's label: list[...], tagged-union[...]
        where = ".".join(str(x) for x in loc) or None
        # param: the request's field (a scalar member of a union, "prompt.str", or an item,
        # "messages.0.role", is in the message)
        raise ApiError(400, f"{where or 'body'}: {err.get('msg', 'invalid')}",
                       param=str(loc[0]) if loc else None) from None


def with_object_arguments(messages: list[dict]) -> list[dict]:
    """``messages`` with each tool call's ``arguments`` as the object its JSON text holds, for a
    template that needs objects (:func:`~.completion.arguments_as_objects`); text that is not a JSON
    object stays text (the template then says what it makes of it)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                try:
                    args = json.loads(c["function"]["arguments"])
                except (ValueError, RecursionError):
                    args = None
                calls.append({**c, "function": {**c["function"], "arguments": args}} if isinstance(args, dict) else c)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def kept_roles(messages: list[dict], roles: dict) -> list[dict]:
    """``messages`` as the chat template will take them (``roles``: :func:`~.completion.rendered_roles`):
    a ``developer`` message, which OpenAI's newer clients send for instructions, as ``system`` where
    the template drops the first and keeps the second; any other message of a role the template
    drops, a 400 naming it (it had been left out of the prompt without a word)."""
    out = []
    for i, m in enumerate(messages):
        if roles.get(m["role"]) is False:
            if m["role"] == "developer" and roles.get("system"):
                m = {**m, "role": "system"}
            else:
                raise ApiError(400, f"messages[{i}].role: this model's chat format leaves {m['role']} messages out "
                               "of the prompt", param="messages")
        out.append(m)
    return out


def lone_surrogate(obj) -> str | None:
    """The path (``messages[0].content``) of the first string in a parsed JSON value that holds a
    lone surrogate (``"\\ud800"`` parses to one; a pair parses to its character), or None. Walked
    without recursion (the parser's own depth bounds the value); a path is spelled only when found."""
    def spell(node) -> str:
        parts = []
        while node is not None:
            node, key = node
            parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        return "".join(reversed(parts)).lstrip(".") or "body"

    def bad(text: str) -> bool:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    stack = [(obj, None)]
    while stack:
        value, node = stack.pop()
        if isinstance(value, str):
            if bad(value):
                return spell(node)
        elif isinstance(value, dict):
            for key, item in value.items():
                if bad(key):
                    return spell(node)
                stack.append((item, (node, key)))
        elif isinstance(value, list):
            stack.extend((item, (node, i)) for i, item in enumerate(value))
    return None


# ------------------------------------------------------------------------------ metrics
def device_bandwidths(g) -> dict:
    """``{1: bytes/s, 4: bytes/s}``: the device's read bandwidth at the expert slice size of the GGUF
    ``g``, one and four readers (:func:`~.roofline.device_bandwidths`: cached per device for a day,
    else about 2 s of ``O_DIRECT`` reads by threads with buffers of their own); ``{}`` where the
    file cannot be read so (no roofline gauges). ``serve --memory-wall`` calls it in the wall's
    parent: inside the wall, whose limit hugs the server after its warm-up, the cache's parse and
    rewrite and the reader threads with their buffers had met the limit (``can't start new
    thread``, or ``ENOMEM`` from the next ``socket()``: 3 to 5 of 25 starts beside two CPU burners)."""
    from .roofline import device_bandwidths as records
    from .runner import request_bytes

    try:
        return {readers: rec["bytes_per_s"] for readers, rec in records(g.path, request_bytes(g)).items()}
    except OSError:
        return {}


class Metrics:
    """The counters of ``/metrics`` (Prometheus text format 0.0.4). ``requests_total`` counts a stream
    its client left before the end as code 499 (nginx's "client closed request"). Expert hits and misses are counted
    by the modes that read the routing (``managed``: its cache's steps; ``advise``, ``pin``,
    ``lookahead``, ``nocache``: whether a routed expert's pages were all resident); the others
    export no such series. ``device_read_bytes_total`` is this process's ``/proc/self/io``
    ``read_bytes``."""

    def __init__(self, session: Session, bandwidth: dict | None = None):
        """``bandwidth``: ``{readers: bytes/s or None}`` for 1 and 4 readers, measured beforehand (a
        walled server's parent measures it outside the wall: :func:`device_bandwidths`); None:
        measured here."""
        self.session = session
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = 0
        self.decode_rate: float | None = None
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.waiting = 0
        self.wall = None  # a callable giving the live wall state, where the server runs inside one
        self.bandwidth = device_bandwidths(session.geometry) if bandwidth is None else dict(bandwidth)

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

    :meth:`start` makes the request's grammar (:mod:`.constraints`), runs the
    prefill and returns the first piece (or raises :class:`ApiError` before anything is sent: a
    schema that makes no grammar, an empty prompt, or one too long for the context with its
    ``max_tokens``);
    :meth:`next` returns the next piece or None at the end; :meth:`close` stops the decode
    (idempotent). ``halt`` (this request's) or ``shutdown`` (the server's) set, the decode ends
    before the next token (:mod:`.completion` yields a chunk per token); ``aborted`` then says the
    server's shutdown ended it."""

    def __init__(self, session: Session, *, prompt=None, messages=None, max_tokens: int | None, body: _Sampling,
                 shutdown: threading.Event | None = None, tools: ToolPlan | None = None, bias=None,
                 variables: dict | None = None, preserved: frozenset = frozenset(),
                 reopen: tuple[str, str] | None = None, fit_context: bool = False):
        self.session, self.body = session, body
        self.fit_context = fit_context
        """A ``max_tokens`` beyond the context's room is the room (Anthropic's answer), not a 400."""
        self.fitted = False
        """With ``fit_context``: ``max_tokens`` was more than the room, so the decode may fill the context."""
        self.chat = messages is not None
        llm = session.llama
        n_ctx = session.n_ctx
        temperature = body.temperature
        kw = completion_kwargs(max_tokens or n_ctx, temperature, body.top_p, body.seed, body.top_k)
        kw.update(presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, stop=body.stop,
                  min_p=body.min_p, typical_p=body.typical_p, repeat_penalty=body.repeat_penalty,
                  mirostat_mode=body.mirostat, mirostat_tau=body.mirostat_tau, mirostat_eta=body.mirostat_eta)
        self.max_tokens = max_tokens
        self.top = (body.logprobs if not self.chat else (body.top_logprobs or 0) if body.logprobs else None)
        """Alternatives per token of the request's ``logprobs`` (None: none asked)."""
        self.echo = bool(getattr(body, "echo", False))
        self.prompt_rows: list = []
        """With ``echo`` and ``logprobs``: the prompt's rows (:attr:`~.textgen.ObservedLlama.prompt_rows`)."""
        self.before = session.snapshot()
        self.sampled0 = llm.sampled
        self._make = (lambda **more: stream_chat(llm, messages, preserved, reopen, **kw, **more)) if self.chat else \
            (lambda **more: stream_completion(llm, prompt, **kw, **more))
        self._it = None  # made by start, on the decode's thread: a schema's grammar can take a second to make
        self.tools = tools
        """What the request's tools make of the decode (:func:`tool_plan`), or None."""
        self.bias = bias
        """The request's ``logit_bias`` as a logits processor (:func:`~.constraints.logit_bias`), or None."""
        self.variables = variables or {}
        """A chat's template variables (``chat_template_kwargs``)."""
        self.grammar = False
        """Whether the decode keeps to a grammar (``response_format``, a forced tool call): set by :meth:`start`."""
        self.finish: str | None = None
        self.prompt_tokens: int | None = None
        self.done = False
        self.halt = threading.Event()
        self.shutdown = shutdown if shutdown is not None else threading.Event()
        self.aborted = False

    def _pull(self) -> str | None:
        """The next non-empty piece of text, or None when the decode has ended."""
        while not self.done:
            if self.halt.is_set() or self.shutdown.is_set():
                self.aborted = self.shutdown.is_set()
                self.close()
                break
            try:
                chunk = next(self._it)
            except StopIteration:
                self.done = True
                self.session.llama.logprobs = None
                break
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            self.finish = choice.get("finish_reason") or self.finish
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                return piece
        return None

    def start(self) -> str | None:
        llm = self.session.llama
        more, plan = {}, self.tools
        try:
            fmt = self.body.response_format and self.body.response_format.model_dump(by_alias=True)
            if plan is not None:  # the tools to the template; a forced call's grammar
                more["tools"] = plan.template_tools
                if plan.arguments_of is not None:
                    parameters = plan.arguments_of.function.parameters or {"type": "object", "properties": {}}
                    fmt = {"type": "json_schema", "json_schema": {"schema": parameters}}
            if plan is not None and plan.forced:
                grammar = call_grammar(plan.form, [(t.function.name, t.function.parameters) for t in plan.forced],
                                       llm._model.vocab, plan.thinking, plan.parallel)
            else:
                grammar = response_grammar(fmt, llm._model.vocab)
        except ConstraintError as exc:
            self.done = True
            field = "tools" if plan is not None and plan.sets_grammar and exc.param == "response_format" else exc.param
            raise ApiError(400, f"{field}: {exc}", param=field) from None
        self.grammar = grammar is not None
        llm.stop_sequence = None  # set by the decode that meets one (:func:`~.completion.stream_completion`)
        if self.chat:
            more.update(self.variables)
        self._it = self._make(grammar=grammar, logits_processor=self.bias, **more)
        llm.logprobs, llm.logprob_rows = self.top, []
        if self.echo and self.top is not None:  # every prompt row's logits: the prompt evaluated whole
            llm.reset()
            llm.prompt_logprobs, llm.prompt_rows = self.top, []
        try:
            first = self._pull()
        except PromptError as exc:  # an empty prompt; one that leaves no room in the context
            self.close()
            raise ApiError(400, str(exc), param="messages" if self.chat else "prompt", code=exc.code) from None
        finally:
            llm.prompt_logprobs = None
        self.prompt_rows, llm.prompt_rows = llm.prompt_rows, []
        self.prompt_tokens = llm.prompt_length
        if self.max_tokens is not None and self.prompt_tokens + self.max_tokens > self.session.n_ctx:
            if self.fit_context:  # the decode stops where the context is full (stream_completion's room)
                self.fitted = True
                return first
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

    def close(self) -> None:
        if not self.done:
            self.done = True
            if self._it is not None:
                self._it.close()
            self.session.llama.logprobs = None

    def opened_thinking(self, fmt: str) -> bool:
        """Whether the chat template's prompt (once :meth:`start` has run) ends inside a thinking block
        (format ``fmt``'s: ``<think>``) that the model's text continues (:func:`~.reasoning.opens_thinking`)."""
        tail = self.prompt_ids()[-16:]
        return opens_thinking(_text(self.session.llama.detokenize(tail, special=True)), fmt) if tail else False

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids as evaluated (once :meth:`start` has run)."""
        llm = self.session.llama
        return [int(t) for t in llm.input_ids[:self.prompt_tokens or 0]]

    def take_rows(self) -> list:
        """The log-probability rows of the tokens sampled since the last call
        (:attr:`~.textgen.ObservedLlama.logprob_rows`; none unless ``logprobs`` was asked). Called on
        the thread that decodes, after each piece, or while nothing decodes."""
        llm = self.session.llama
        rows, llm.logprob_rows = llm.logprob_rows, []
        return rows

    @property
    def cached_tokens(self) -> int:
        """The prompt's tokens the KV cache kept from the request before (not evaluated again)."""
        return max(0, (self.prompt_tokens or 0) - (self.figures()["prefill_tokens"] or 0))

    @property
    def ended(self) -> str | None:
        """How the decode ended: its ``finish`` (``stop``, ``length``), or ``context`` where the
        context was full before ``max_tokens`` (``fit_context``)."""
        return "context" if self.fitted and self.done and self.finish == "length" else self.finish

    @property
    def stop_sequence(self) -> str | None:
        """The request's stop sequence that ended the decode (None: none did), once it has ended."""
        return getattr(self.session.llama, "stop_sequence", None) if self.done else None

    def usage(self) -> dict:
        llm = self.session.llama
        sampled = llm.sampled - self.sampled0
        completion = sampled - (1 if sampled and llm.last_sampled_is_eog else 0)
        return {"prompt_tokens": self.prompt_tokens or 0, "completion_tokens": completion,
                "total_tokens": (self.prompt_tokens or 0) + completion}

    def figures(self) -> dict:
        return request_figures(self.before, self.session.snapshot())


class Logprobs:
    """A request's ``logprobs`` in OpenAI's shape, from rows of :func:`~.textgen.token_logprobs`,
    one call per response or chunk, in order (the offsets run on across calls). A token's text is
    its bytes (``detokenize``) decoded as UTF-8 with U+FFFD for what is not; a log-probability that
    is not finite (a model whose logits are NaN) is null.

    * chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
      "bytes"}] (the ``top_logprobs`` likeliest)}], "refusal": null}``;
    * completion: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}] (the
      ``logprobs`` likeliest, and the sampled token), "text_offset"}``, a token's offset being the
      prompt's characters (token ids: their text's) plus those the completion's bytes before it
      decode to (as llama-cpp-python counts them: a character still unfinished is not counted).
      With ``echo`` the prompt's tokens come first (a leading BOS left out), offsets from 0, the
      first one's log-probability and alternatives null, as OpenAI's and llama-cpp-python's.

    A chat's special tokens that its text holds (``preserved``: the tags its format is read by,
    :func:`~.completion.preserved_tokens`) have their text here too, as in the content."""

    def __init__(self, llm, chat: bool, prompt_chars: int, preserved: frozenset = frozenset()):
        """``prompt_chars``: where the completion's offsets begin, the prompt's characters."""
        self.llm, self.chat, self.chars, self.preserved = llm, chat, prompt_chars, preserved
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @staticmethod
    def _num(x: float) -> float | None:
        return x if math.isfinite(x) else None

    def of(self, rows: list, echoed: tuple[list[int], list] | None = None) -> dict:
        """The entries of ``rows``, after those of the prompt where ``echoed`` is ``(the prompt's
        ids, its rows)`` (completions only: row j is the log-probabilities of token j + 1)."""
        if self.chat:
            content = []
            for token, logprob, top in rows:
                b = self.llm.detokenize([token], special=token in self.preserved)
                alts = [(self.llm.detokenize([i], special=i in self.preserved), x) for i, x in top]
                content.append({"token": _text(b), "logprob": self._num(logprob), "bytes": list(b),
                                "top_logprobs": [{"token": _text(a), "logprob": self._num(x), "bytes": list(a)}
                                                 for a, x in alts]})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if echoed is not None:
            ids, prompt_rows = echoed
            first = 1 if ids and ids[0] == self.llm.token_bos() else 0
            decoder, chars = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
            for j in range(first, len(ids)):
                b = self.llm.detokenize([ids[j]])
                out["text_offset"].append(chars)
                chars += len(decoder.decode(b))
                self._add(out, b, prompt_rows[j - 1] if first < j <= len(prompt_rows) else None)
        for row in rows:
            b = self.llm.detokenize([row[0]])
            out["text_offset"].append(self.chars)
            self.chars += len(self.decoder.decode(b))
            self._add(out, b, row)
        return out

    def _add(self, out: dict, b: bytes, row) -> None:
        """One completion-shaped entry: token ``b``'s text, its log-probability and alternatives
        (``row``; None: both null)."""
        out["tokens"].append(_text(b))
        if row is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        _, logprob, top = row
        out["token_logprobs"].append(self._num(logprob))
        alts = {_text(self.llm.detokenize([i])): self._num(x) for i, x in top}
        alts.setdefault(_text(b), self._num(logprob))
        out["top_logprobs"].append(alts)


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ the app
class Slot:
    """The one decode slot: first come, first served. A waiter looks every :data:`POLL_SECONDS`
    whether it should give up (its client gone, the server stopping) and then leaves the queue; a
    slot handed to a waiter that is leaving is passed on."""

    def __init__(self):
        self.busy = False
        self.waiters: collections.deque = collections.deque()

    def locked(self) -> bool:
        return self.busy

    async def acquire(self, give_up) -> str | None:
        """Hold the slot (None), or the reason ``await give_up()`` gave (not None) for leaving the queue."""
        if not self.busy and not self.waiters:
            self.busy = True
            return None
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=POLL_SECONDS)
                if done:
                    return None
                reason = await give_up()
                if reason is not None:
                    self._leave(fut)
                    return reason
        except BaseException:
            self._leave(fut)
            raise

    def _leave(self, fut) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # it was handed over meanwhile: pass it on
        else:
            fut.cancel()
            self.waiters.remove(fut)

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # handed over: still busy
                return
        self.busy = False


PUBLIC_PATHS = ("/health", "/v1/models")
"""What a server with API keys answers without one (llama.cpp's public endpoints that are served here)."""


def presented_key(headers: dict) -> bytes:
    """The API key a request presents: ``Authorization: Bearer KEY`` (OpenAI's clients), else
    ``x-api-key: KEY`` (Anthropic's), as llama.cpp's server reads them; empty for none."""
    key = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
    return key[len(b"Bearer "):] if key.startswith(b"Bearer ") else key


class Guard:
    """The app's outermost layer of its own (pure ASGI, so that a request's disconnect reaches the
    endpoint): with ``api_keys``, a request to any path but :data:`PUBLIC_PATHS` that presents none
    of them (:func:`presented_key`, compared in constant time) is a 401 before anything else; a
    declared body over :data:`MAX_BODY_BYTES` is a 413 before it is read; a client that leaves while
    its body is read is counted 499 and not answered; anything else raised is one line on stderr
    and, if nothing was sent yet, a 500 of OpenAI's shape (Starlette's own handler of last resort
    would log a traceback)."""

    def __init__(self, app, metrics: "Metrics", api_keys: tuple[str, ...] = ()):
        self.app, self.metrics = app, metrics
        self.api_keys = tuple(k.encode() for k in api_keys)

    def authorized(self, headers: dict) -> bool:
        key = presented_key(headers)
        return any([hmac.compare_digest(key, k) for k in self.api_keys])  # each compared: no early exit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        label = path if path in ENDPOINTS else "other"
        dialect = DIALECT_PATHS.get(path, "openai")
        headers = dict(scope.get("headers") or ())
        if self.api_keys and path not in PUBLIC_PATHS and not self.authorized(headers):
            self.metrics.count(label, 401)
            refused = error_json(401, "invalid API key: give one of the server's --api-key as Authorization: Bearer "
                                      "KEY (or x-api-key: KEY)", "authentication_error", code="invalid_api_key",
                                 dialect=dialect)
            return await refused(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            self.metrics.count(label, 413)
            too_large = error_json(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", dialect=dialect)
            return await too_large(scope, receive, send)
        started = False

        async def watch(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:
            self.metrics.count(label, 499)
        except Exception as exc:  # noqa: BLE001 - every failure is one line and, if possible, a 500
            print(f"expertcache serve: error in {path[:100]}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            if not started:
                self.metrics.count(label, 500)
                await error_json(500, f"internal error ({type(exc).__name__})", "server_error",
                                 dialect=dialect)(scope, receive, send)


def create_app(session: Session, *, model_id: str, max_queue: int = MAX_QUEUE, version: str = "",
               bandwidth: dict | None = None, workers: "Workers | None" = None, reasoning_format: str = "auto",
               template_kwargs: dict | None = None, api_keys: tuple[str, ...] = (),
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app serving ``session`` as model ``model_id`` (see the module docstring);
    ``api_keys``: the keys a request must present (:class:`Guard`; none: no key asked);
    ``allowed_origins``: the web origins whose pages may read the answers (CORS; ``*``: any; none:
    no page of another origin);
    ``bandwidth``: :class:`Metrics`'s; ``workers``: the threads requests run on (made here if None);
    ``reasoning_format`` and ``template_kwargs``: a chat's defaults (``--reasoning-format``,
    ``--chat-template-kwargs``), which its ``reasoning_format`` and ``chat_template_kwargs`` override.
    ``app.state.stopping`` (a ``threading.Event``), once set, ends the decode in progress before its
    next token and sends every waiting request a 503: :func:`serve` sets it when shutdown begins."""
    app = FastAPI(title="expertcache", version=version, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # a trailing slash is a JSON 404, not a bare 307 to another URL
    metrics = Metrics(session, bandwidth)
    workers = workers or Workers()
    stopping = threading.Event()
    app.state.metrics, app.state.session, app.state.stopping = metrics, session, stopping
    app.add_middleware(Guard, metrics=metrics, api_keys=api_keys)
    if allowed_origins:  # outside the Guard: a preflight carries no key, and a 401 is readable by the page
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "HEAD"],
                           allow_headers=["*"], max_age=600)
    slot = Slot()
    created = int(time.time())
    roles = rendered_roles(session.llama) if session.chat_ready else {}  # the template is fixed: asked once
    template = session.llama.metadata.get("tokenizer.chat_template") \
        if session.llama.chat_format == "chat_template.default" else None  # the GGUF's own, not a named format
    call_fmt = call_format(template)
    think_fmt = think_format(template)
    forms = FORMS if think_fmt == HARMONY else tuple(f for f in FORMS if f != HARMONY)  # its calls: its channels'
    # a call's opening tags (they end a thinking block never closed, where a call is forced)
    call_opens = tuple(pair[0] for pair in (TAGS[call_fmt],) + ALTERNATIVES.get(call_fmt, ())) if call_fmt in TAGS \
        else ()
    # the thinking a forced call may follow: a <think> (<mm:think>, Gemma 4's thought channel, Kimi K3's think
    # section) block, its text without the tags that end one never closed (the reader's: a call's opening, the
    # format's others); gpt-oss's analysis message
    forced_thinking = None
    if think_fmt in (DEEPSEEK, GEMMA4, MINIMAX_M3, KIMI_K3) and call_opens:
        forced_thinking = Thinking(*THINK_TAGS[think_fmt], ENDS_THINKING.get(call_fmt, ()) + call_opens
                                   + THINK_BREAKS.get(think_fmt, ()))
    elif think_fmt == call_fmt == HARMONY:
        forced_thinking = HARMONY_MESSAGES
    # tool calls' arguments as objects: where the template needs them so, and always for Gemma 4's, which
    # writes a text of arguments as it is, JSON inside its own syntax, and Kimi K3's, which writes a text as
    # one JSON section where its model learnt an argument section per key (MiniMax-M3's fails on a text: asked)
    objects = session.chat_ready and (call_fmt in (GEMMA4, KIMI_K3) or arguments_as_objects(session.llama))
    # Gemma 4's first templates render no tool messages: their results go on the call's message, as llama.cpp does
    responses_on_calls = call_fmt == GEMMA4 and GEMMA4_TOOL_ROLE not in template
    reopen = GEMMA4_REOPEN if call_fmt == GEMMA4 else None
    reads = template_reads(template)  # the template's variables (Anthropic's thinking switch sets some)
    # the tags the chat's text is read by, written into it even where the vocabulary makes them control tokens
    preserved = preserved_tokens(session.llama, THINK_MARKERS.get(think_fmt, ()) + CALL_MARKERS.get(call_fmt, ()))
    if template_kwargs and template is None:
        raise ConfigError(f"--chat-template-kwargs: this server formats chats with llama-cpp-python's named format "
                          f"{session.llama.chat_format!r}, which takes no template variables")

    def label(request: Request) -> str:
        """The ``endpoint`` label: a served path, else ``other`` (a client cannot grow the series)."""
        return request.url.path if request.url.path in ENDPOINTS else "other"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        metrics.count(label(request), exc.status_code)
        return error_json(exc.status_code, f"{request.method} {request.url.path[:100]}: {exc.detail}",
                          code="not_found" if exc.status_code == 404 else None,
                          dialect=DIALECT_PATHS.get(request.url.path, "openai"))

    async def read_body(request: Request) -> bytes:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return bytes(raw)

    def check_request(body: _Sampling) -> tuple[ToolPlan | None, object, dict]:
        """The request's 4xx, if any; else what its tools make of the decode (:func:`tool_plan`), its
        ``logit_bias`` as a logits processor (None for none) and a chat's template variables (the
        server's, then the request's)."""
        if body.model not in (None, "", model_id):
            raise ApiError(404, f"The model `{body.model[:200]}` does not exist (this server serves `{model_id}`)",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, "n: one choice per request is served", param="n")
        if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for field, inert in LLAMA_UNSERVED.items():
            value = getattr(body, field)
            if value is not None and value not in inert:
                why = {"n_probs": " (ask logprobs)", "grammar": " (ask response_format with a JSON schema)"}
                raise ApiError(400, f"{field}: llama.cpp's option is not served here{why.get(field, '')}; leave it "
                               "out, or at its default", param=field)
        unserved = {"best_of": body.best_of not in (None, 1),
                    "top_logprobs": isinstance(body, CompletionRequest) and body.top_logprobs is not None,
                    "suffix": bool(getattr(body, "suffix", None)),
                    "functions": bool(getattr(body, "functions", None)),
                    "function_call": getattr(body, "function_call", None) not in (None, "none", "auto")}
        for field, used in unserved.items():
            if used:
                raise ApiError(400, f"{field} is not served (it would change the result)", param=field)
        plan = tool_plan(body, call_fmt, forms, forced_thinking) if isinstance(body, ChatRequest) else None
        if plan is not None and plan.parsed and call_fmt == HARMONY and (body.reasoning_format or reasoning_format) == "none":
            raise ApiError(400, "reasoning_format none: this model's tool calls are read from its channels, as its "
                           "thinking is; with tool_choice auto, ask reasoning_format auto", param="reasoning_format")
        if plan is not None and plan.sets_grammar and body.response_format is not None \
                and body.response_format.type != "text":
            raise ApiError(400, "response_format: a forced tool call's arguments keep to its parameters; "
                           "leave response_format out", param="response_format")
        try:
            bias = logit_bias(body.logit_bias, session.llama.n_vocab())
        except ConstraintError as exc:
            raise ApiError(400, f"{exc.param}: {exc}", param=exc.param) from None
        if body.return_routed_experts and session.llama.routing is None:
            raise ApiError(400, "this server does not return routed experts: start it with "
                           "--enable-return-routed-experts", param="return_routed_experts", code="routed_experts_disabled")
        if body.routed_experts_start_len is not None and not body.return_routed_experts:
            raise ApiError(400, "routed_experts_start_len needs return_routed_experts", param="routed_experts_start_len")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} sequences", param="stop")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ApiError(400, f"stop: each sequence is 1 to {MAX_STOP_CHARS} characters", param="stop")
        variables = dict(template_kwargs or {})
        if isinstance(body, ChatRequest) and body.chat_template_kwargs is not None:
            if template is None:
                raise ApiError(400, f"chat_template_kwargs: this server formats chats with llama-cpp-python's named "
                               f"format {session.llama.chat_format!r}, which takes no template variables",
                               param="chat_template_kwargs")
            try:
                variables.update(template_variables(body.chat_template_kwargs, "chat_template_kwargs"))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="chat_template_kwargs") from None
        return plan, bias, variables

    async def acquire(request: Request) -> str | None:
        """Wait for the slot: None once held, else why the request left the queue ("gone", "stopping")."""
        if metrics.waiting >= max_queue:
            raise ApiError(429, f"{metrics.waiting} requests are waiting for the one slot; retry later",
                           "rate_limit_error", code="queue_full")

        async def give_up() -> str | None:
            if stopping.is_set():
                return "stopping"
            return "gone" if await request.is_disconnected() else None

        metrics.waiting += 1
        try:
            return await slot.acquire(give_up)
        finally:
            metrics.waiting -= 1

    def tokens_of(text: str | None) -> int:
        """The tokens of ``text`` as the tokenizer reads it (a reasoning text's, for a dialect's usage)."""
        return len(session.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)) if text else 0

    def shutting_down(dialect: str = "openai") -> JSONResponse:
        return error_json(503, "the server is shutting down", "server_error", code="shutting_down", dialect=dialect)

    def dialect_chat(dialect: str, raw: bytes, count: bool = False) -> tuple[object, ChatRequest, list[str]]:
        """A dialect's request body (its ``CountRequest`` where ``count``), the chat request that
        asks the same and where its messages come from (the dialect's ``to_chat``)."""
        api = DIALECTS[dialect]
        asked = parse_body(raw, api.CountRequest if count else api.Request)
        try:
            chat, origins = api.to_chat(asked, reads)
        except ValueError as exc:
            where = str(exc).split(":", 1)[0]
            raise ApiError(400, str(exc), param=where.split(".", 1)[0]) from None
        try:
            return asked, validated(chat, ChatRequest), origins
        except ApiError as exc:
            raise asked_error(dialect, exc, origins) from None

    def asked_error(dialect: str, exc: ApiError, origins: list[str], named=None) -> ApiError:
        """``exc`` (about the chat request made of a dialect's) naming the field of the request as asked,
        in its message and its ``param`` (``named``: another request's naming, text -> text:
        :func:`.native.asked_fields` for llama.cpp's ``/completion``)."""
        if named is None and dialect in DIALECTS:
            named = lambda text: DIALECTS[dialect].asked_fields(text, origins)  # noqa: E731
        if named is not None:
            exc.message = named(exc.message)
            exc.param = exc.param and named(exc.param)
        return exc

    def chat_messages(body: ChatRequest) -> list[dict]:
        """A chat's messages as its template takes them (the roles it renders checked, a call's
        arguments as objects where it needs them, results placed as it renders them)."""
        if not session.chat_ready:
            raise ApiError(400, f"{model_id} has no chat template; use /v1/completions, or restart the server "
                           "with --chat-format", param="messages", code="chat_template_missing")
        messages = kept_roles([{"role": m.role, "content": m.content if isinstance(m.content, str)
                                or m.content is None else "".join(p.text for p in m.content),
                                **m.model_dump(include={"tool_calls", "tool_call_id", "name", "reasoning_content"},
                                               exclude_none=True)}
                               for m in body.messages], roles)
        if objects:
            messages = with_object_arguments(messages)
        if responses_on_calls:
            messages = gemma4_tool_responses(messages)
        if call_fmt == DSV4:  # its results in the order of its calls, as its reference encoder renders them
            messages = results_in_call_order(messages)
        return messages

    async def prompt_of(request: Request, dialect: str, answer: Callable):
        """A chat request's prompt as the request would evaluate it (:func:`~.completion.chat_prompt`:
        its template, tools and variables), nothing decoded and no slot held, answered by ``answer``
        (the prompt -> the answer, on the decode thread): a count of its tokens (Anthropic's
        ``/v1/messages/count_tokens``, the Responses API's ``/v1/responses/input_tokens``, llama.cpp's
        ``/v1/chat/completions/input_tokens`` for a chat request: ``dialect`` ``openai``), or its text
        (llama.cpp's ``/apply-template``)."""
        endpoint, origins = request.url.path, []
        try:
            raw = await read_body(request)
            if dialect in DIALECTS:
                _, body, origins = dialect_chat(dialect, raw, count=True)
            else:
                body = parse_body(raw, ChatRequest)
            messages = chat_messages(body)
            plan, _, variables = check_request(body)
            more = dict(variables, **({"tools": plan.template_tools} if plan is not None else {}))
            try:
                out = await workers.decode.call(lambda: answer(chat_prompt(session.llama, messages, reopen, **more)))
            except PromptError as exc:
                raise ApiError(400, str(exc), param="messages") from None
        except ApiError as exc:
            metrics.count(endpoint, exc.status)
            return asked_error(dialect, exc, origins).response(dialect)
        except ClientDisconnect:
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        metrics.count(endpoint, 200)
        return out

    async def count_tokens(request: Request, dialect: str):
        """A request's input tokens, in its dialect's answer (:func:`prompt_of`)."""
        counted = DIALECTS.get(dialect, responses).counted  # a chat's: the Responses API's shape, as llama.cpp's
        return await prompt_of(request, dialect, lambda prompt: counted(prompt_tokens(session.llama, prompt)))

    async def tokens_answer(request: Request, model_cls, answer: Callable):
        """A request that holds no slot: its body read as ``model_cls``, answered by ``answer`` (the
        body -> the answer, on the decode thread, where the model's tokenizer is used)."""
        endpoint = request.url.path
        try:
            body = parse_body(await read_body(request), model_cls)
            out = await workers.decode.call(lambda: answer(body))
        except ApiError as exc:
            metrics.count(endpoint, exc.status)
            return exc.response()
        except ClientDisconnect:
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        metrics.count(endpoint, 200)
        return out

    def tokenized(body: TokenizeRequest) -> dict:
        """llama.cpp's ``/tokenize`` answer: ``{"tokens": [id, ...]}``, or with ``with_pieces`` each
        ``{"id", "piece"}``, the piece its text where its bytes are UTF-8, else the bytes."""
        ids = session.llama.tokenize(body.content.encode("utf-8"), add_bos=body.add_special, special=body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        pieces = []
        for token in ids:
            piece = token_bytes(session.llama._model.vocab, [token], special=True)
            try:
                pieces.append({"id": token, "piece": piece.decode("utf-8")})
            except UnicodeDecodeError:
                pieces.append({"id": token, "piece": list(piece)})
        return {"tokens": pieces}

    def detokenized(body: DetokenizeRequest) -> dict:
        """llama.cpp's ``/detokenize`` answer: ``{"content": TEXT}``, special tokens' texts in it (bytes
        that are not UTF-8 as U+FFFD); an id outside the vocabulary is a 400 naming it."""
        vocab = session.llama.n_vocab()
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {str(bad)[:40]} is outside the model's vocabulary [0, {vocab})",
                           param="tokens")
        return {"content": _text(token_bytes(session.llama._model.vocab, body.tokens, special=True))}

    def rendered(prompt: str | list[int]) -> dict:
        """llama.cpp's ``/apply-template`` answer: ``{"prompt": TEXT}`` (a prompt of token ids: their text)."""
        text = prompt if isinstance(prompt, str) else _text(token_bytes(session.llama._model.vocab, prompt, special=True))
        return {"prompt": text}

    async def generate(request: Request, kind: str):
        """``kind``: ``completion``, ``chat``, a dialect's name (:data:`DIALECTS`: its request is
        decoded as the chat it asks for, and answered in its shapes) or ``native`` (llama.cpp's
        ``/completion``: decoded as the completion it asks for, answered in its shape: :mod:`.native`)."""
        t0 = time.perf_counter()
        endpoint = request.url.path
        dialect = kind if kind in DIALECTS else "openai"
        api = DIALECTS.get(dialect)
        if api is not None:
            kind = "chat"
        is_native = kind == "native"  # llama.cpp's /completion (.native): its request as asked, native_asked
        named = native.asked_fields if is_native else None  # its errors name its own fields
        if is_native:
            kind = "completion"
        asked, origins, native_asked, body = None, [], None, None
        try:
            raw = await read_body(request)
            if is_native:
                native_asked = parse_body(raw, native.Request)
                try:
                    made = native.to_completion(native_asked, session.n_ctx)
                except ValueError as exc:  # its refusals
                    raise ApiError(400, str(exc), param=str(exc).split(":", 1)[0]) from None
                body = validated(made, CompletionRequest)
            if kind == "completion":
                body = body or parse_body(raw, CompletionRequest)
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a list of prompts
                    if len(prompt) != 1:
                        raise ApiError(400, "prompt: one prompt per request is served", param="prompt")
                    prompt = prompt[0]
                if not prompt:
                    raise ApiError(400, "prompt: the prompt is empty", param="prompt")
                if isinstance(prompt, list):  # token ids
                    vocab = session.llama.n_vocab()
                    bad = next((t for t in prompt if not 0 <= t < vocab), None)
                    if bad is not None:
                        raise ApiError(400, f"prompt: token id {str(bad)[:40]} is outside the model's vocabulary "
                                       f"[0, {vocab})", param="prompt")
                args = {"prompt": prompt, "max_tokens": 16 if body.max_tokens is None else body.max_tokens}
            else:
                if api is not None:
                    asked, body, origins = dialect_chat(dialect, raw)
                else:
                    body = parse_body(raw, ChatRequest)
                args = {"messages": chat_messages(body), "max_tokens": body.max_completion_tokens or body.max_tokens}
            plan, bias, variables = check_request(body)
            left = await acquire(request)
        except ApiError as exc:
            metrics.count(endpoint, exc.status)
            return asked_error(dialect, exc, origins, named).response(dialect)
        except ClientDisconnect:  # gone while its body was read: nobody to answer
            metrics.count(endpoint, 499)
            return Response(status_code=499)
        if left is not None:
            metrics.count(endpoint, 503 if left == "stopping" else 499)
            return shutting_down(dialect) if left == "stopping" else Response(status_code=499)
        gen = None
        try:
            if await request.is_disconnected():  # gone while it waited
                slot.release()
                metrics.count(endpoint, 499)
                return Response(status_code=499)
            gen = Generation(session, body=body, shutdown=stopping, tools=plan, bias=bias, variables=variables,
                             preserved=preserved, reopen=reopen, fit_context=api is not None or is_native,
                             **args)
            first = await workers.decode.call(gen.start)
            if body.return_routed_experts:
                gen.check_routed_start()
        except ApiError as exc:
            slot.release()
            metrics.count(endpoint, exc.status)
            return asked_error(dialect, exc, origins, named).response(dialect)
        except BaseException:
            if gen is not None:
                await workers.decode.call(gen.close)
            slot.release()
            raise
        ttft = time.perf_counter() - t0
        first_rows = gen.take_rows()
        prompt_text = ""  # a completion's prompt as text (token ids: theirs), for echo and the offsets
        if kind == "completion" and (gen.echo or gen.top is not None or is_native):
            given = args["prompt"]
            prompt_text = given if isinstance(given, str) else _text(session.llama.detokenize(given))
        lp = None if gen.top is None else Logprobs(session.llama, kind == "chat", len(prompt_text), preserved)
        echo = prompt_text if gen.echo else ""  # echo: the prompt's text before the completion's,
        echoed = (gen.prompt_ids(), gen.prompt_rows) if gen.echo and lp is not None else None  # its rows first
        rid = api.new_id() if api is not None else \
            ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        one_call = getattr(body, "parallel_tool_calls", None) is False  # the first call only
        call_id = new_call_id(call_fmt)  # a forced call's: 9 letters and digits for Mistral's templates
        plan = gen.tools
        arguments_of = plan.arguments_of if plan is not None else None
        names = [t.function.name for t in plan.offered] if plan is not None and plan.parsed else None
        offered = [(t.function.name, t.function.parameters) for t in plan.offered] if names is not None else []
        tagged = TaggedCalls(call_fmt, offered) if names is not None and call_fmt in TAGS else None

        def finish_reason(calls: int) -> str:
            """``stop`` or ``length``; a decode that completed ``calls`` > 0 tool calls, ``tool_calls``,
            but ``stop`` for a call the request named, as OpenAI's API answers them."""
            finish = gen.finish or "stop"
            return ("stop" if plan.named else "tool_calls") if calls and finish == "stop" else finish
        # a reasoning model's thinking read out of the text (.reasoning), unless a grammar writes the text
        fmt = (body.reasoning_format if kind == "chat" else None) or reasoning_format
        harmony_call = plan is not None and plan.form == HARMONY  # a forced call on gpt-oss's channels
        may_think = plan is not None and plan.thinking is not None  # a forced call, after a thinking block or not
        thinking = kind == "chat" and think_fmt is not None and fmt != "none" and \
            (not gen.grammar or harmony_call or may_think)
        harmony = thinking and think_fmt == HARMONY  # gpt-oss's channels (its calls too), else <think> blocks
        # forced: a block, opened by the prompt, or by the model (its open tag dropped), or an empty one
        opened = thinking and not harmony and (may_think or gen.opened_thinking(think_fmt))
        ends = ENDS_THINKING.get(call_fmt, ()) if tagged is not None else ()  # calls may end the thinking
        if may_think:  # the call itself ends the block its grammar did not close
            ends += call_opens
        think = (HarmonyStream(names) if harmony else ThinkStream(opened, think_fmt, ends)) if thinking else None
        producer = Producer(gen, workers.decode, asyncio.get_running_loop())

        def dialect_usage(usage: dict, reasoning: str | None) -> dict:
            """The chat's ``usage`` with what a dialect's answer reports besides: the prompt's tokens the
            KV cache kept, and the reasoning text's tokens."""
            return dict(usage, cached_tokens=gen.cached_tokens, reasoning_tokens=tokens_of(reasoning))

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

        def native_answer(text: str, usage: dict, streamed: bool = False) -> dict:
            """The ``/completion`` answer (:func:`.native.answer`)."""
            return native.answer(model_id, text, gen.ended, gen.stop_sequence, usage, gen.figures(), gen.cached_tokens,
                                 prompt_text, native.settings(native_asked, body), streamed)

        if not body.stream:
            pieces, rows, gone = [echo, first or ""], first_rows, False
            task, looked = None, time.monotonic()
            try:
                while True:
                    task = task or asyncio.ensure_future(producer.get())
                    done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
                    if time.monotonic() - looked >= POLL_SECONDS:  # is anyone still waiting for the answer?
                        looked = time.monotonic()
                        if await request.is_disconnected():
                            gone = True
                            break
                    if not done:
                        continue
                    (piece, more), task = task.result(), None
                    rows += more
                    if piece is None:
                        break
                    pieces.append(piece)
                if not gone and not gen.aborted:
                    usage = finished()
                    routed = gen.routed_experts() if body.return_routed_experts else None
            finally:
                if task is not None:
                    task.cancel()
                await producer.stop()
                slot.release()
            if gone or gen.aborted:
                metrics.count(endpoint, 499 if gone else 503)
                return Response(status_code=499) if gone else shutting_down(dialect)
            metrics.count(endpoint, 200)
            text = "".join(pieces)
            if is_native:
                return JSONResponse(native_answer(text, usage))
            if kind == "completion":
                choice = {"index": 0, "text": text, "logprobs": lp and lp.of(rows, echoed),
                          "finish_reason": gen.finish or "stop"}
                obj = "text_completion"
            else:
                message, calls = {"role": "assistant", "content": text}, []
                if harmony:
                    reasoning, message["content"], calls = read_harmony(text, names)
                elif thinking:
                    reasoning, text = split_reasoning(text, opened, think_fmt, ends)
                    message["content"] = text
                if thinking and reasoning is not None and (reasoning or not may_think):  # a forced call: none empty
                    message["reasoning_content"] = reasoning
                if arguments_of is not None:
                    calls = [{"id": call_id, "type": "function", "function": {"name": arguments_of.function.name,
                                                                             "arguments": text}}]
                    message["content"] = None
                elif tagged is not None:
                    message["content"], calls = parse_tagged(text, call_fmt, offered)
                if calls:
                    message["tool_calls"] = calls[:1] if one_call else calls
                if api is not None:
                    return JSONResponse(api.answer(rid, model_id, message, gen.ended, gen.stop_sequence,
                                                   dialect_usage(usage, message.get("reasoning_content")), asked))
                choice = {"index": 0, "message": message, "logprobs": lp and lp.of(rows),
                          "finish_reason": finish_reason(len(calls))}
                obj = "chat.completion"
            out = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice],
                   "usage": usage}
            if body.return_routed_experts:
                out["sglext"] = {"routed_experts": routed}
            return JSONResponse(out)

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

        def chunk(piece: str | None, finish: str | None, rows: list, first_chunk: bool = False,
                  flush: bool = False) -> dict:
            if kind == "completion":
                choice = {"index": 0, "text": (echo if first_chunk else "") + (piece or ""),
                          "logprobs": lp and lp.of(rows, echoed if first_chunk else None), "finish_reason": finish}
            elif arguments_of is not None:  # the call's arguments, piece by piece
                call = {"index": 0, "function": {"arguments": piece or ""}}
                if first_chunk:
                    call.update(id=call_id, type="function", function={"name": arguments_of.function.name,
                                                                        "arguments": piece or ""})
                delta = {"role": "assistant", "content": None} if first_chunk else {}
                if first_chunk or piece:
                    delta["tool_calls"] = [call]
                choice = {"index": 0, "delta": delta, "logprobs": lp and lp.of(rows), "finish_reason": finish}
            else:  # thinking as it comes (reasoning_content), content as it comes, a call once its block is complete
                before = think.calls if harmony else 0  # gpt-oss's calls come from its channels
                parts = ([("content", piece or "")] if think is None else
                         think.feed(piece or "") + (think.finish() if flush else []))
                reasoning = "".join(x for k, x in parts if k == "reasoning")
                content = "".join(x for k, x in parts if k == "content")
                calls = [{"index": before + i, **x} for i, x in enumerate(x for k, x in parts if k == "call")]
                if tagged is not None:
                    done = tagged.calls
                    out = tagged.feed(content) + (tagged.finish() if flush else [])
                    content = "".join(x for k, x in out if k == "content")
                    calls = [{"index": done + i, **x} for i, x in enumerate(x for k, x in out if k == "call")]
                if one_call:
                    calls = [c for c in calls if c["index"] == 0]
                delta = {"role": "assistant", "content": content} if first_chunk else \
                    ({"content": content} if content else {})
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": 0, "delta": delta, "logprobs": lp and lp.of(rows), "finish_reason": finish}
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice]}

        outcome = []

        async def chunks():
            """The stream's chunks; None last where the server's shutdown ended it."""
            yield chunk(first, None, first_rows, first_chunk=True)
            while True:
                piece, rows = await producer.get()
                if piece is None:
                    break
                yield chunk(piece, None, rows)
            if gen.aborted:
                yield None
                return
            if tagged is not None or think is not None:  # what they held back, before the finish is known
                yield chunk(None, None, rows, flush=True)
                rows = []
            yield chunk(None, finish_reason(1 if arguments_of is not None else tagged.calls if tagged else
                                            think.calls if harmony else 0), rows)

        async def dialect_events():
            stream = api.EventStream(rid, model_id, {"prompt_tokens": gen.prompt_tokens or 0,
                                                     "cached_tokens": gen.cached_tokens}, asked)
            yield stream.start()
            async for c in chunks():
                if c is None:  # the server is stopping: an error event (the dialect's shape) instead of a finish
                    outcome.append(503)
                    yield stream.error(503, "the server is shutting down")
                    return
                events = stream.feed(c["choices"][0]["delta"])
                if events:
                    yield events
            yield stream.finish(gen.ended, gen.stop_sequence, dialect_usage(finished(), stream.reasoning))
            outcome.append(200)

        async def events():
            async for c in chunks():
                if c is None:  # the server is stopping: an error event (OpenAI's shape) instead of a finish
                    outcome.append(503)
                    yield "data: " + json.dumps({"error": {"message": "the server is shutting down",
                                                           "type": "server_error", "param": None,
                                                           "code": "shutting_down"}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                yield "data: " + json.dumps(c) + "\n\n"
            usage = finished()
            if body.return_routed_experts:  # SGLang's tail: one chunk without choices carrying them
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                             "choices": [], "sglext": {"routed_experts": gen.routed_experts()}}) + "\n\n"
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                             "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            outcome.append(200)

        async def native_events():
            """llama-server's stream of ``/completion``: a piece an event, then the answer; no ``[DONE]``."""
            pieces = []
            async for c in chunks():
                if c is None:  # the server is stopping: an error event instead of the answer
                    outcome.append(503)
                    yield "data: " + json.dumps({"error": {"message": "the server is shutting down",
                                                           "type": "server_error", "code": "shutting_down"}}) + "\n\n"
                    return
                piece = c["choices"][0]["text"]
                if piece:
                    pieces.append(piece)
                    yield "data: " + json.dumps(native.chunk(piece)) + "\n\n"
            yield "data: " + json.dumps(native_answer("".join(pieces), finished(), streamed=True)) + "\n\n"
            outcome.append(200)

        async def release() -> None:
            await producer.stop()
            slot.release()
            metrics.count(endpoint, outcome[0] if outcome else 499)  # 499: the client closed the stream first

        return SlotStream(dialect_events() if api is not None else native_events() if is_native else
                          events(), release)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/completion")
    async def native_completion(request: Request):
        return await generate(request, "native")

    def dialect_routes(dialect: str, create: str, count: str) -> None:
        async def answered(request: Request):
            return await generate(request, dialect)

        async def counted(request: Request):
            return await count_tokens(request, dialect)

        app.add_api_route(create, answered, methods=["POST"])
        app.add_api_route(count, counted, methods=["POST"])

    for name, (create, count) in DIALECT_ROUTES.items():
        dialect_routes(name, create, count)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokens_answer(request, TokenizeRequest, tokenized)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokens_answer(request, DetokenizeRequest, detokenized)

    @app.post("/apply-template")
    async def apply_template(request: Request):
        return await prompt_of(request, "openai", rendered)

    @app.post("/v1/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request):
        return await count_tokens(request, "openai")

    @app.get("/props")
    async def props():
        metrics.count("/props", 200)
        return {"default_generation_settings": {"n_ctx": session.llama.n_ctx()}, "total_slots": 1,
                "model_path": session.llama.model_path, "model_alias": model_id, "chat_template": template or "",
                "modalities": {"vision": False, "audio": False}, "build_info": f"expertcache {version}",
                "is_sleeping": False, "mode": session.mode}

    llm_model = session.llama.model  # llama.cpp's model: its sizes, read once
    meta = {"vocab_type": int(llama_cpp.llama_vocab_type(session.llama._model.vocab)),
            "n_vocab": session.llama.n_vocab(), "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(llm_model)),
            "n_embd": int(llama_cpp.llama_model_n_embd(llm_model)),
            "n_params": int(llama_cpp.llama_model_n_params(llm_model)),
            "size": int(llama_cpp.llama_model_size(llm_model))}
    """``/v1/models``' ``meta``, as llama-server gives it (the trained context, the width, the
    parameters and the tensors' bytes, from llama.cpp's model)."""

    @app.get("/v1/models")
    async def models():
        metrics.count("/v1/models", 200)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "expertcache", "meta": meta}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        metrics.count("/health", 200)
        return {"status": "ok", "model": model_id, "mode": session.mode, "waiting": metrics.waiting,
                "busy": slot.locked()}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        metrics.count("/metrics", 200)
        text = await workers.metrics.call(metrics.render)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


class Worker:
    """One daemon thread, started when made, running the calls handed to it one at a time in the
    order given. A call's exception goes to its caller; the thread goes on."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, done = self._calls.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle
                done.set_exception(exc)

    def submit(self, fn) -> concurrent.futures.Future:
        """Queue ``fn()``; its future."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, done))
        return done

    async def call(self, fn):
        """``fn()`` on this thread, awaited. A caller cancelled meanwhile waits for the call to end
        before it is cancelled (as ``anyio.to_thread.run_sync`` does): what ``fn`` holds is released
        before the caller's cleanup runs."""
        done = asyncio.wrap_future(self.submit(fn))
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            await asyncio.wait({done})
            raise


class Workers:
    """The server's two threads: ``decode`` (a request's prompt, tokens and close: one request at a
    time holds the slot, so one thread) and ``metrics`` (rendering ``/metrics``, which reads the
    pool while a decode runs). Made once, before the first request: a request starts no thread."""

    def __init__(self):
        self.decode = Worker("expertcache-decode")
        self.metrics = Worker("expertcache-metrics")


class Producer:
    """A request's decode on the decode :class:`Worker`, handing each piece to the event loop
    (``call_soon_threadsafe``: one wake-up per piece, not a thread-pool round trip). :meth:`stop`
    asks it to end before the next token (``Generation.halt``), waits until it has, and stops the
    decode."""

    def __init__(self, gen: Generation, worker: Worker, loop: asyncio.AbstractEventLoop):
        self.gen, self.loop = gen, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.halt = gen.halt
        self.finished = asyncio.Event()
        worker.submit(self._run)

    def _run(self) -> None:
        try:
            while not self.halt.is_set():
                piece = self.gen.next()
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (piece, self.gen.take_rows()))
                if piece is None:
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the stream, which ends with it
            self.loop.call_soon_threadsafe(self.queue.put_nowait, exc)
        finally:
            self.gen.close()
            self.loop.call_soon_threadsafe(self.finished.set)

    async def get(self) -> tuple[str | None, list]:
        """The next piece and the log-probability rows of the tokens that made it; ``(None, rows)``
        at the end, with those of tokens that made no text (a stop sequence's)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def stop(self) -> None:
        self.halt.set()
        await self.finished.wait()


class WallGauge:
    """The live proof of a server inside ``serve --memory-wall``: the GGUF's page cache now, the
    peak the wall's proof has measured so far (its sampler, in the parent process, publishes each
    new peak to ``peak_file``: :data:`~expertcache.wall.cgroupfs.PEAK_SUFFIX`), the capacity, the
    proof's slack, the cgroup's limit now, and whether the peak has stayed within the capacity +
    slack. One measurement, the proof's: a sampler of the gauge's own, 50 ms apart from the wall's,
    had read peaks 0.85-1.17 of the proof's. The peak shown is the higher of the published one and
    the reading now (the proof takes its next sample later)."""

    def __init__(self, path: str, capacity: int, peak_file: str | None):
        from ..wall.pagecache import FileCache
        from ..wall.capacity import proof_slack

        self.files, self.capacity, self.slack = FileCache([path]), capacity, proof_slack(capacity)
        self.peak_file = peak_file

    def published(self) -> int | None:
        """The proof's peak so far, as the wall published it (None before its first sample, or where
        the file holds no count)."""
        from ..wall.cgroupfs import read_published_peak

        return read_published_peak(self.peak_file) if self.peak_file else None

    def limit(self) -> int | None:
        from ..wall.cgroupfs import locate_memory_cgroup, read_int

        loc, _ = locate_memory_cgroup()
        if loc is None:
            return None
        return read_int(f"{loc['dir']}/{'memory.limit_in_bytes' if loc['version'] == 'v1' else 'memory.high'}")

    def __call__(self) -> list[tuple[str, str, float]]:
        now = self.files.bytes()
        peak = max(now, self.published() or 0)
        out = [("wall_capacity_bytes", "The memory wall: the most the model's page cache may hold.", self.capacity),
               ("wall_tier_bytes", "The model file's page cache now (cachestat).", now),
               ("wall_tier_peak_bytes", "The most the model file's page cache held since the server started "
                "(the wall's proof's samples, or the reading now where higher).", peak),
               ("wall_proof_ok", "1 while the peak has stayed within the capacity + the proof's slack.",
                int(peak <= self.capacity + self.slack))]
        lim = self.limit()
        if lim is not None:
            out.append(("wall_limit_bytes", "The cgroup limit now (it follows the server's own memory).", lim))
        return out


def one_line(record: logging.LogRecord) -> bool:
    """A logging filter: a record's traceback becomes its exception's name and message on the same
    line (uvicorn and asyncio log some with one: a server's stderr stays one line per event)."""
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        record.msg, record.args = f"{record.getMessage()} ({type(exc).__name__}: {str(exc)[:200]})", ()
        record.exc_info = record.exc_text = None
    record.stack_info = None
    return True


def guarded_protocol(max_connections: int, request_seconds: float, count=None):
    """uvicorn's h11 protocol with the bounds a server open to any client needs: at most
    ``max_connections`` open (one more is answered 503 and closed before it is read), every
    request's headers and body read within ``request_seconds`` of its first byte (a connection that
    sends nothing, or too slowly, is closed: a client that trickles a request holds no descriptor
    for long), and a request the HTTP parser refuses answered 400 in OpenAI's JSON shape.
    ``count(endpoint, status)`` (the metrics' counter) counts these two answers, as ``other``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def raw(status: int, reason: str, message: str, code: str | None) -> bytes:
        body = error_json(status, message, "invalid_request_error" if status < 500 else "server_error", code=code).body
        return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n").encode() + body

    full = raw(503, "Service Unavailable", f"{max_connections} connections are open; retry later",
               "too_many_connections")

    class GuardedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(full)
                transport.close()
                if count is not None:
                    count("other", 503)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # the request is in: the app's time from here
            else:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None and not self.transport.is_closing():
                self._deadline = self.loop.call_later(request_seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
                self.transport.close()  # a request half read: its endpoint sees the client gone

        def send_400_response(self, msg: str) -> None:
            self.transport.write(raw(400, "Bad Request", f"{msg} (the HTTP parser refused it)", None))
            self.transport.close()
            if count is not None:
                count("other", 400)

    return GuardedH11Protocol


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
          announce=None, wall_state=None, version: str = "", max_connections: int | None = None,
          request_seconds: float | None = None, bandwidth: dict | None = None,
          workers: Workers | None = None, reasoning_format: str = "auto", template_kwargs: dict | None = None,
          api_keys: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()) -> None:
    """Serve until SIGTERM / SIGINT. The socket is bound first (``port`` 0: any free port), then
    ``announce(url)`` is called (the CLI prints it), then requests are answered. ``max_connections``
    and ``request_seconds`` (default :data:`MAX_CONNECTIONS`, :data:`REQUEST_SECONDS`):
    :func:`guarded_protocol`; ``bandwidth``: :class:`Metrics`'s; ``workers``: :func:`create_app`'s."""
    import socket

    import uvicorn

    app = create_app(session, model_id=model_id, version=version, bandwidth=bandwidth, workers=workers,
                     reasoning_format=reasoning_format, template_kwargs=template_kwargs, api_keys=api_keys,
                     allowed_origins=allowed_origins)
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
                            lifespan="off", h11_max_incomplete_event_size=64 * 1024,
                            http=guarded_protocol(max_connections or MAX_CONNECTIONS,
                                                  request_seconds or REQUEST_SECONDS, app.state.metrics.count))
    for name in ("uvicorn.error", "asyncio"):
        logging.getLogger(name).addFilter(one_line)
    # uvicorn catches SIGTERM/SIGINT to shut down, then re-raises them to the handlers it found: make
    # those note the signal only, so that the model is closed and the process exits 0. They are set
    # before the URL is announced: a signal from then on is noted, and acted on once uvicorn listens.
    stops: list[int] = []

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.state.stopping.set()  # waiting requests get a 503, the decode in progress ends
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                if stops:  # it came before uvicorn listened (it had been noted only: the server ran on)
                    self.handle_exit(stops[0], None)
                yield

    server = Server(config)
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if announce is not None:
            announce(f"http://{f'[{host}]' if ':' in host else host}:{bound}")
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
