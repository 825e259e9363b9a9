"""Anthropic's Messages API over the server's chat path (``POST /v1/messages``,
``POST /v1/messages/count_tokens``): a request is read in Anthropic's shape, turned into the chat
request the OpenAI endpoint takes (:func:`to_chat`), decoded by the same code, and answered in
Anthropic's shape (:func:`answer`, :class:`EventStream`), as llama.cpp's server does.

A dialect of the server (:data:`~.server.DIALECTS`; :mod:`.responses` is another): ``Request``
and ``CountRequest`` (the bodies), :func:`to_chat`, :func:`asked_fields`, :func:`error_body`,
:func:`new_id`, :func:`answer`, :func:`counted` and :class:`EventStream` (``start``, ``feed``,
``finish``, ``error``).

Invariants:

* **The chat endpoint's decode.** What a ``/v1/messages`` request generates is what the equivalent
  ``/v1/chat/completions`` request generates, token for token: the same template, tools, forced
  calls, thinking and sampling; only the envelope differs (``tests/test_serve.py`` checks text,
  thinking, calls and token counts against the chat endpoint's).
* **Blocks in the order the text has them**: a thinking block, then text, then ``tool_use`` blocks,
  each streamed as ``content_block_start``, its deltas, ``content_block_stop`` before the next one
  opens (Anthropic's order; the indices are the final message's). A thinking block ends with an
  empty ``signature_delta`` (its ``signature`` is ``""``: nothing signs a local model's thinking).
* **Nothing that would change the result is ignored**: a block this server cannot show the model
  (an image, a document, a server tool's result), a server tool, ``redacted_thinking`` and the
  unserved top-level options (:data:`UNSERVED`) are a 400 naming the field; fields that change
  nothing here (``metadata``, ``service_tier``, ``cache_control``) are taken and dropped.
* **Errors are Anthropic's shape**, ``{"type": "error", "error": {"type", "message"}}`` with the
  status of the chat endpoint's error (:func:`error_body`); a stream that fails after it began ends
  in an ``error`` event of that shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from . import dialect
from .dialect import EFFORT_VARIABLE, THINKING_VARIABLES

UNSERVED = ("container", "mcp_servers", "context_management")
"""Top-level request fields that would change the answer and are not served: refused when set."""
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
"""Anthropic's error type of an HTTP status (any other: ``invalid_request_error`` for a 4xx,
``api_error`` for a 5xx)."""


_Part = dialect.Part


class TextBlock(_Part):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Part):
    type: Literal["tool_use"]
    id: dialect.CallId
    name: dialect.FunctionName
    input: dict


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: dialect.CallId
    content: str | list[TextBlock] | None = None
    is_error: bool = False  # the result's text goes to the template, which has no place for the flag


class ThinkingBlock(_Part):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock], Field(discriminator="type")]


class MessageParam(_Part):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Part):
    type: Literal["custom"] | None = None  # a server tool (web search, code execution) is not served
    name: dialect.ToolName
    description: str | None = None
    input_schema: dict


class ToolChoice(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Part):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)  # not enforced: max_tokens bounds the whole answer
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks given empty


class _OutputFormat(_Part):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # what comes next is refused until it is read

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: _OutputFormat | None = None


class MessagesRequest(dialect.Passed):
    """``POST /v1/messages``'s body (Anthropic's ``MessageCreateParams``, as far as it is served)."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict | None = None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``'s body: a message request without ``max_tokens``."""

    max_tokens: int = Field(1, ge=1)


Request, CountRequest = MessagesRequest, CountTokensRequest


def _texts(blocks) -> str:
    """Text blocks' texts, one paragraph each (a client's system prompt and reminders come as several)."""
    return "\n\n".join(b.text for b in blocks)


def to_chat(req: MessagesRequest, template_variables: frozenset = frozenset()) -> tuple[dict, list[str]]:
    """The chat-completions request (a JSON object, for the chat endpoint's own model) that asks
    what ``req`` asks, and where each of its messages comes from in ``req`` (``system``,
    ``messages.I``, ``messages.I.content.J`` for a tool's result).
    ``template_variables``: the variables the chat template reads (where ``thinking`` sets the
    :data:`~.dialect.THINKING_VARIABLES` among them; :func:`asked_fields` reads ``origins``). A
    ``ValueError`` whose first argument is the Anthropic field at fault (``"field: why"``) for what
    is not served."""
    for name in UNSERVED:
        if req.asked(name) is not None:
            raise ValueError(f"{name}: not served by this server")
    messages: list[dict] = []
    origins: list[str] = []
    if req.system:
        messages.append({"role": "system", "content": req.system if isinstance(req.system, str) else _texts(req.system)})
        origins.append("system")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            origins.append(f"messages.{i}")
            continue
        texts, calls, thoughts = [], [], []
        for j, b in enumerate(m.content):
            if isinstance(b, TextBlock):
                texts.append(b)
            elif isinstance(b, ThinkingBlock):
                if m.role != "assistant":
                    raise ValueError(f"messages.{i}.content.{j}: a thinking block belongs to an assistant message")
                thoughts.append(b.thinking)
            elif isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise ValueError(f"messages.{i}.content.{j}: a tool_use block belongs to an assistant message")
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            else:  # a tool's result: a tool message, in the order of the blocks, before the user's text
                if m.role != "user":
                    raise ValueError(f"messages.{i}.content.{j}: a tool_result block belongs to a user message")
                content = b.content if isinstance(b.content, str) else _texts(b.content or [])
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
                origins.append(f"messages.{i}.content.{j}")
        if m.role == "assistant":
            out = {"role": "assistant", "content": _texts(texts)}
            if calls:
                out["tool_calls"] = calls
            if thoughts:
                out["reasoning_content"] = "\n\n".join(thoughts)
            messages.append(out)
            origins.append(f"messages.{i}")
        elif texts or not m.content:
            messages.append({"role": "user", "content": _texts(texts)})
            origins.append(f"messages.{i}")
    body: dict = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "temperature": req.temperature,
                  "stream": req.stream}
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.top_k is not None:
        body["top_k"] = req.top_k
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice.name: a tool choice of type tool names the tool")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": req.output_config.format.schema_}}
    variables = {}
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        variables = {v: req.thinking.type == "enabled" for v in THINKING_VARIABLES if v in template_variables}
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None and EFFORT_VARIABLE in template_variables:
        variables[EFFORT_VARIABLE] = effort if effort in ("low", "medium", "high") else "high"
    return dialect.pass_on(req, body, variables), origins


RENAMED = ((r"^stop\b", "stop_sequences"), (r"^tool_choice\.function\.name", "tool_choice.name"),
           (r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"), (r"^tools\.(\d+)\.function\.", r"tools.\1."),
           (r"^response_format", "output_config.format"))
"""Chat request fields and the Anthropic fields they come from (:func:`asked_fields`)."""


def asked_fields(text: str, origins: list[str]) -> str:
    """An error message about the chat request :func:`to_chat` made, its leading field named as
    the Anthropic request has it (``messages[2].role`` → ``messages.1.content.0.role`` where the
    third chat message is the first block of the second; ``stop`` → ``stop_sequences``)."""
    return dialect.asked_fields(text, origins, RENAMED)


def stop_reason(finish: str | None, calls: int, stop_sequence: str | None) -> str:
    """Anthropic's ``stop_reason`` of a decode that ended with the chat endpoint's ``finish`` having
    completed ``calls`` tool calls, ``stop_sequence`` the request's stop sequence it met (if any);
    ``finish`` ``"context"``: the context was full before ``max_tokens``."""
    if finish == "context":
        return "model_context_window_exceeded"
    if finish == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def new_id() -> str:
    """A message's id."""
    return "msg_" + uuid.uuid4().hex[:24]


def _input(arguments: str) -> dict | None:
    """A call's arguments as ``tool_use``'s ``input`` (None: not a JSON object, as a call the token
    limit cut leaves them)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def omits_thinking(req: MessagesRequest | None) -> bool:
    """Whether ``req`` asks its thinking blocks given without their text (``display: omitted``)."""
    return req is not None and req.thinking is not None and req.thinking.display == "omitted"


def _usage(usage: dict, output_tokens: int) -> dict:
    """Anthropic's usage of the chat's ``usage`` (``prompt_tokens``, ``cached_tokens``): the prompt's
    tokens the KV cache kept from the request before as ``cache_read_input_tokens``, the others as
    ``input_tokens`` (their sum the prompt), as llama.cpp's server reports them."""
    cached = usage.get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "output_tokens": output_tokens}


def answer(mid: str, model: str, chat_message: dict, finish: str | None, stop_sequence: str | None,
           usage: dict, asked: MessagesRequest | None = None) -> dict:
    """The Anthropic ``Message`` of a chat completion's ``chat_message`` (its ``reasoning_content``,
    ``content``, ``tool_calls``), ``finish`` reason and ``usage``, for the request ``asked``
    (``display: omitted``: a thinking block without its text). A call whose arguments are not a
    JSON object (the token limit cut them) is given as text, as it was written."""
    omit_thinking = omits_thinking(asked)
    blocks = []
    if chat_message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": "" if omit_thinking else chat_message["reasoning_content"],
                       "signature": ""})
    text = chat_message.get("content") or ""
    calls = []
    for call in chat_message.get("tool_calls") or []:
        value = _input(call["function"]["arguments"])
        if value is None:
            text += call["function"]["arguments"]
        else:
            calls.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": value})
    if text:
        blocks.append({"type": "text", "text": text})
    reason = stop_reason(finish, len(calls), stop_sequence)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks + calls,
            "stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
            "usage": _usage(usage, usage["completion_tokens"])}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"  # ASCII: a lone surrogate stays an escape


class EventStream:
    """A streamed chat completion's chunks (their ``delta``s) as Anthropic's server-sent events:
    ``message_start``, each block's start, deltas and stop, then ``message_delta`` and
    ``message_stop``. A block stops before the next starts; the indices count the blocks. For
    ``asked`` with ``display: omitted``, a thinking block's text is not sent. ``reasoning``: the
    thinking so far."""

    def __init__(self, mid: str, model: str, prompt: dict, asked: MessagesRequest | None = None):
        """``prompt``: the chat's usage of the prompt (``prompt_tokens``, ``cached_tokens``)."""
        self.mid, self.model, self.prompt, self.omit_thinking = mid, model, prompt, omits_thinking(asked)
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.calls = 0
        self.reasoning = ""

    def start(self) -> str:
        return sse("message_start", {"type": "message_start", "message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": _usage(self.prompt, 0)}})

    def _close(self) -> str:
        out = ""
        if self.open == "thinking":
            out += sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "signature_delta", "signature": ""}})
        if self.open is not None:
            out += sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.open = None
        return out

    def _begin(self, block: dict) -> str:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block})

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: dict) -> str:
        """The events of one chunk's ``delta`` (its thinking, then its text, then its calls)."""
        out = ""
        if delta.get("reasoning_content"):
            self.reasoning += delta["reasoning_content"]
            if self.open != "thinking":
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                out += self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            if self.open != "text":
                out += self._begin({"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a new call
                self.calls += 1
                out += self._begin({"type": "tool_use", "id": call["id"], "name": function.get("name", ""),
                                    "input": {}})
            if function.get("arguments"):
                out += self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        return out

    def finish(self, finish: str | None, stop_sequence: str | None, usage: dict) -> str:
        """The last events: the open block's stop, the stop reason and the output's tokens (the
        chat's ``usage``)."""
        reason = stop_reason(finish, self.calls, stop_sequence)
        return self._close() + sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason,
                                               "stop_sequence": stop_sequence if reason == "stop_sequence" else None},
            "usage": _usage(usage, usage["completion_tokens"])}) + \
            sse("message_stop", {"type": "message_stop"})

    def error(self, status: int, message_: str) -> str:
        """The event that ends a stream which failed after it began (the server stopping)."""
        return sse("error", error_body(status, message_))


def counted(input_tokens: int) -> dict:
    """``count_tokens``' answer."""
    return {"input_tokens": input_tokens}


def error_body(status: int, message_: str, type_: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    """Anthropic's error object for an HTTP ``status`` (its type by the status; it has no field for
    the chat error's ``type_``, ``param`` or ``code``)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message_}}
