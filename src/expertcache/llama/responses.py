"""OpenAI's Responses API over the server's chat path (``POST /v1/responses``,
``POST /v1/responses/input_tokens``): a request's ``input`` items are turned into the chat request
the chat endpoint takes (:func:`to_chat`), decoded by the same code, and answered as a ``response``
of output items (:func:`answer`, :class:`EventStream`), as vLLM serves it. Stateless: nothing is
stored, so ``previous_response_id`` and conversations are refused and the answer says
``"store": false``.

A dialect of the server (:data:`~.server.DIALECTS`), as :mod:`.anthropic` is.

Invariants:

* **The chat endpoint's decode.** What a ``/v1/responses`` request generates is what the equivalent
  ``/v1/chat/completions`` request generates, token for token (``tests/test_serve.py``).
* **Items in the order the text has them** when streamed (a ``reasoning`` item, a ``message`` item,
  ``function_call`` items), each ``output_item.added``, its deltas and ``output_item.done`` before
  the next; ``response.completed`` (or ``response.incomplete``) carries the whole response, whose
  items are the streamed ones, ids and all. Every event has the next ``sequence_number``.
* **Nothing that would change the result is ignored**: hosted tools, input images and files, item
  types this server cannot show the model and the stateful options (:data:`UNSERVED`) are a 400
  naming the field; what changes nothing here (``store``, ``metadata``, ``user``,
  ``prompt_cache_key``, ``service_tier``, ``text.verbosity``) is taken and dropped.
* **Errors are OpenAI's shape**, as the chat endpoint's, the field named as the request has it.
* **Usage**: ``input_tokens`` the prompt's, ``cached_tokens`` those of them the KV cache kept from
  the request before (not evaluated again), ``output_tokens`` the sampled ones,
  ``reasoning_tokens`` the reasoning text's tokens as the tokenizer reads it again (the sampled
  tokens' split between reasoning and answer is not kept).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from . import dialect
from .dialect import EFFORT_VARIABLE, EXTENSIONS, THINKING_VARIABLES

UNSERVED = ("previous_response_id", "conversation", "prompt", "max_tool_calls", "top_logprobs", "context_management",
            "background")
"""Top-level fields that would change the answer and are not served (nothing is stored; no hosted
prompt; no per-token log-probabilities here): refused when set (``background: false`` and
``truncation: "disabled"`` are what is served anyway)."""
INCLUDABLE = ("reasoning.encrypted_content",)
"""``include`` values taken: there is no encrypted reasoning to give (``encrypted_content`` stays
null), and clients that keep nothing on the server ask it every time."""


_Part = dialect.Part


class _Text(_Part):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Part):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Text]


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    call_id: dialect.CallId
    name: dialect.FunctionName
    arguments: str


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: dialect.CallId
    output: str | list[_Text]


class _Summary(_Part):
    type: Literal["summary_text"]
    text: str


class _ReasoningText(_Part):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Part):
    type: Literal["reasoning"]
    summary: list[_Summary] = []
    content: list[_ReasoningText] | None = None
    encrypted_content: str | None = None


ITEMS = {None: MessageItem, "message": MessageItem, "function_call": FunctionCallItem,
         "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
"""The input items served, by ``type`` (a message may leave its type out)."""


class FunctionTool(_Part):
    type: Literal["function"]  # hosted tools (web search, file search, code interpreter, ...) are not served
    name: dialect.ToolName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the grammar holds a forced call to its parameters either way


class NamedFunction(_Part):
    type: Literal["function"]
    name: str


class _Format(_Part):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Part):
    format: _Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint no template here reads


class Reasoning(_Part):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the reasoning's own text is given
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(dialect.Passed):
    """``POST /v1/responses``' body (OpenAI's ``ResponseCreateParams``, as far as it is served)."""

    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    metadata: dict | None = None
    top_k: object = None  # the chat endpoint's, passed on as dialect.EXTENSIONS are


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``' body: a response request, counted."""


Request, CountRequest = ResponsesRequest, InputTokensRequest


def _texts(parts) -> str | list[dict]:
    return parts if isinstance(parts, str) else [{"type": "text", "text": p.text} for p in parts]


def _item(i: int, obj: dict):
    """Input item ``i`` read by its type's model; a ``ValueError`` naming ``input.I`` otherwise."""
    if not isinstance(obj, dict):
        raise ValueError(f"input.{i}: expected an item (an object)")
    kind = obj.get("type")
    model = ITEMS.get(kind) if isinstance(kind, str) or kind is None else None
    if model is None:
        raise ValueError(f"input.{i}.type: {str(kind)[:40]!r} items are not served (served: message, function_call, "
                         "function_call_output, reasoning)")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()) if "[" not in str(x))
        raise ValueError(f"input.{i}{'.' + loc if loc else ''}: {err.get('msg', 'invalid')}") from None


def to_chat(req: ResponsesRequest, template_variables: frozenset = frozenset()) -> tuple[dict, list[str]]:
    """The chat-completions request that asks what ``req`` asks, and where each of its messages
    comes from (``instructions``, ``input.I``). A reasoning item's text goes to the assistant turn
    that follows it (its ``reasoning_content``; where another item follows it, it is left out: it
    has no turn in the template); function calls join the assistant message before them. ``template_variables``: what the chat template reads (``reasoning.effort`` sets gpt-oss's
    ``reasoning_effort``, ``none`` the thinking switches off). A ``ValueError`` naming the field."""
    for name in UNSERVED:
        value = req.asked(name)
        if value is not None and not (name == "background" and value is False):
            raise ValueError(f"{name}: not served by this server (it stores nothing and keeps no state between "
                             "requests)" if name in ("previous_response_id", "conversation") else
                             f"{name}: not served by this server")
    if req.truncation == "auto":
        raise ValueError("truncation: auto is not served (an input longer than the context is a 400)")
    for j, value in enumerate(req.include or []):
        if value not in INCLUDABLE:
            raise ValueError(f"include.{j}: {value[:60]!r} is not served")
    messages: list[dict] = []
    origins: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    thought: list[str] = []  # reasoning waiting for the assistant turn it belongs to
    open_turn = False  # the last chat message is an assistant turn that calls may join
    for i, obj in enumerate(items):
        item = _item(i, obj)
        if isinstance(item, ReasoningItem):
            thought.append("\n\n".join(c.text for c in item.content) if item.content else
                           "\n\n".join(s.text for s in item.summary))
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if open_turn and not thought:
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _texts(item.output)})
        else:
            messages.append({"role": item.role, "content": _texts(item.content)})
        if messages[-1]["role"] == "assistant" and thought:
            messages[-1]["reasoning_content"] = "\n\n".join(t for t in thought if t)
        thought = []  # reasoning no assistant output followed (a turn the limit cut) has no turn to go to
        open_turn = messages[-1]["role"] == "assistant"
        origins.append(f"input.{i}" if not isinstance(req.input, str) else "input")
    body: dict = {"model": req.model, "messages": messages, "stream": req.stream}
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ValueError("text.format.schema: a json_schema format gives its schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "output",
                                                                          "schema": fmt.schema_}}
    variables = {}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and EFFORT_VARIABLE in template_variables:
        variables[EFFORT_VARIABLE] = {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)
    if effort == "none":
        variables.update({v: False for v in THINKING_VARIABLES if v in template_variables})
    return dialect.pass_on(req, body, variables, ("top_k",) + EXTENSIONS), origins


RENAMED = ((r"^max_tokens\b", "max_output_tokens"), (r"^response_format", "text.format"),
           (r"^tool_choice\.function\.name", "tool_choice.name"), (r"^tools\.(\d+)\.function\.", r"tools.\1."),
           (r"^messages$", "input"))
"""Chat request fields and the fields of a response request they come from (:func:`asked_fields`)."""


def asked_fields(text: str, origins: list[str]) -> str:
    """An error message (or its ``param``) about the chat request :func:`to_chat` made, its leading
    field named as the response request has it (``messages[2].role`` → ``input.1.role``;
    ``max_tokens`` → ``max_output_tokens``; the param ``messages`` → ``input``)."""
    return dialect.asked_fields(text, origins, RENAMED)


def new_id() -> str:
    """A response's id."""
    return "resp_" + uuid.uuid4().hex[:24]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def counted(input_tokens: int) -> dict:
    """``input_tokens``' answer."""
    return {"object": "response.input_tokens", "input_tokens": input_tokens}


def error_body(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object, the chat endpoint's shape and fields (``param`` named as the response
    request has it: :func:`asked_fields`)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def _envelope(rid: str, model: str, created: float, asked: ResponsesRequest | None, status: str, output: list,
              usage: dict | None, finish: str | None) -> dict:
    """A ``response`` object: ``status`` ``in_progress``, ``completed`` or ``incomplete`` (the token
    limit or the context ended it), the request's settings as it gave them."""
    asked = asked or ResponsesRequest(input="-")
    fmt = asked.text.format.model_dump(by_alias=True, exclude_none=True) if asked.text and asked.text.format else \
        {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "completed_at": time.time() if status != "in_progress" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": asked.instructions, "max_output_tokens": asked.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": asked.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": asked.reasoning.effort if asked.reasoning else None, "summary": None},
            "store": False, "temperature": 1.0 if asked.temperature is None else asked.temperature,
            "text": {"format": fmt}, "tool_choice": asked.tool_choice.model_dump() if isinstance(
                asked.tool_choice, BaseModel) else asked.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in asked.tools or []],
            "top_p": 1.0 if asked.top_p is None else asked.top_p, "truncation": "disabled",
            "metadata": asked.metadata or {}, "usage": _usage(usage) if usage is not None else None}


def _status(finish: str | None) -> str:
    return "incomplete" if finish in ("length", "context") else "completed"


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": "completed"}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call: dict, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _call_status(arguments: str, finish: str | None) -> str:
    """A call's ``status``: ``incomplete`` where the token limit cut its arguments (no JSON object)."""
    try:
        whole = isinstance(json.loads(arguments), dict)
    except (ValueError, RecursionError):
        whole = False
    return "completed" if whole or finish not in ("length", "context") else "incomplete"


def answer(rid: str, model: str, chat_message: dict, finish: str | None, stop_sequence: str | None, usage: dict,
           asked: ResponsesRequest | None = None) -> dict:
    """The ``response`` of a chat completion's ``chat_message`` (its ``reasoning_content``,
    ``content``, ``tool_calls``), ``finish`` reason and ``usage`` (with ``cached_tokens`` and
    ``reasoning_tokens``): a reasoning item, a message item, a function call item per call."""
    output = []
    if chat_message.get("reasoning_content"):
        output.append(_reasoning_item(_item_id("rs"), chat_message["reasoning_content"]))
    if chat_message.get("content"):  # incomplete where the limit cut it, not a call after it
        cut = _status(finish) if not chat_message.get("tool_calls") else "completed"
        output.append(_message_item(_item_id("msg"), chat_message["content"], cut))
    for call in chat_message.get("tool_calls") or []:
        output.append(_call_item(_item_id("fc"), call, _call_status(call["function"]["arguments"], finish)))
    return _envelope(rid, model, time.time(), asked, _status(finish), output, usage, finish)


class EventStream:
    """A streamed chat completion's chunks (their ``delta``s) as the Responses API's server-sent
    events: ``response.created``, ``response.in_progress``, each output item added, its deltas
    (``reasoning_text``, ``output_text``, ``function_call_arguments``) and done, then
    ``response.completed`` (or ``response.incomplete``) with the whole response. ``reasoning``: the
    reasoning text so far."""

    def __init__(self, rid: str, model: str, prompt: dict, asked: ResponsesRequest | None = None):
        self.rid, self.model, self.asked = rid, model, asked
        self.created = time.time()
        self.sequence = 0
        self.output: list[dict] = []  # the items done
        self.item: dict | None = None  # the item open
        self.reasoning = ""

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"  # ASCII: a lone surrogate stays an escape

    def start(self) -> str:
        head = _envelope(self.rid, self.model, self.created, self.asked, "in_progress", [], None, None)
        return self._event("response.created", response=head) + self._event("response.in_progress", response=head)

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _close(self, finish: str | None = None) -> str:
        item, out = self.item, ""
        if item is None:
            return ""
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out += self._event("response.reasoning_text.done", **self._where(), content_index=0, text=text)
            out += self._event("response.content_part.done", **self._where(), content_index=0, part=item["content"][0])
        elif item["type"] == "message":
            item["status"] = _status(finish) if finish is not None else "completed"
            part = item["content"][0]
            out += self._event("response.output_text.done", **self._where(), content_index=0, text=part["text"],
                               logprobs=[])
            out += self._event("response.content_part.done", **self._where(), content_index=0, part=part)
        else:
            item["status"] = _call_status(item["arguments"], finish) if finish is not None else "completed"
            out += self._event("response.function_call_arguments.done", **self._where(), arguments=item["arguments"],
                               name=item["name"])
        out += self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.item = None
        return out

    def _open(self, item: dict) -> str:
        out = self._close()
        self.item = item
        added = {**item, "status": "in_progress"}
        if item["type"] == "reasoning":
            added["content"], part = [], {"type": "reasoning_text", "text": ""}
        elif item["type"] == "message":
            added["content"], part = [], {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            added["arguments"], part = "", None
        out += self._event("response.output_item.added", output_index=len(self.output), item=added)
        if part is not None:
            out += self._event("response.content_part.added", **self._where(), content_index=0, part=part)
        return out

    def feed(self, delta: dict) -> str:
        """The events of one chunk's ``delta`` (its thinking, then its text, then its calls)."""
        out = ""
        if delta.get("reasoning_content"):
            text = delta["reasoning_content"]
            if self.item is None or self.item["type"] != "reasoning":
                out += self._open(_reasoning_item(_item_id("rs"), ""))
            self.item["content"][0]["text"] += text
            self.reasoning += text
            out += self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        if delta.get("content"):
            text = delta["content"]
            if self.item is None or self.item["type"] != "message":
                out += self._open(_message_item(_item_id("msg"), "", "in_progress"))
            self.item["content"][0]["text"] += text
            out += self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a new call
                out += self._open(_call_item(_item_id("fc"), {"id": call["id"], "function": {
                    "name": function.get("name", ""), "arguments": ""}}, "in_progress"))
            if function.get("arguments"):
                self.item["arguments"] += function["arguments"]
                out += self._event("response.function_call_arguments.delta", **self._where(),
                                   delta=function["arguments"])
        return out

    def finish(self, finish: str | None, stop_sequence: str | None, usage: dict) -> str:
        """The last events: the open item done, then the whole response (the chat's ``usage``, with
        ``cached_tokens`` and ``reasoning_tokens``)."""
        out = self._close(finish)
        status = _status(finish)
        whole = _envelope(self.rid, self.model, self.created, self.asked, status, self.output, usage, finish)
        return out + self._event("response.completed" if status == "completed" else "response.incomplete",
                                 response=whole)

    def error(self, status: int, message: str) -> str:
        """The event that ends a stream which failed after it began (the server stopping)."""
        return self._event("error", code="server_error" if status >= 500 else None, message=message, param=None)
