"""Tool calls written in a model's own format, read back into OpenAI's ``tool_calls`` (docs/serve.md,
"Tool calls"). Two formats write each call in a ``<tool_call>`` block: the Hermes format, which
Qwen3-MoE, Qwen3-Next and many other models are trained on, a JSON object::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and GLM-4.5's (GLM-4.5, 4.6, 4.5-Air), the name, then each argument's key and value::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A chat template that holds ``<tool_call>`` is taken to teach GLM's where it holds ``<arg_key>`` too,
else Hermes' (:func:`call_format`), as llama.cpp's server detects them. (gpt-oss's calls are
messages on its channels: :class:`~.reasoning.HarmonyStream`.)

Invariants (``tests/test_toolcalls.py``):

* **A call is reported only when its block is complete and valid**: the JSON parses to an object
  with a ``name`` among the request's tools and an object of ``arguments`` (Hermes), or the name is
  among them and the rest is key-value pairs only, each key once (GLM: a value is the text as
  written where the tool's parameters type the key a string, else its JSON when it parses);
  otherwise the block's text stays content, word for word (nothing the model wrote is dropped).
* **Streamed and whole agree**: :class:`TaggedCalls` fed the text in any pieces gives the content
  and calls :func:`parse_tagged` gives for the whole text; content that could begin ``<tool_call>``
  is held back until it cannot, a block until its ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Callable

from .._text import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES, GLM, HARMONY = "hermes", "glm", "harmony"
MARKERS = {HERMES: (OPEN, CLOSE), GLM: (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")}
"""The tags each call format is read by (gpt-oss's: :data:`~.reasoning.MARKERS`)."""


def call_format(template: str | None) -> str | None:
    """``"hermes"`` or ``"glm"`` where the chat ``template`` teaches that format (module docstring),
    ``"harmony"`` where it teaches gpt-oss's calls (a message ``to=functions.NAME`` on its channels:
    :class:`~.reasoning.HarmonyStream`); None."""
    if template and OPEN in template:
        return GLM if "<arg_key>" in template else HERMES
    if template and "<|channel|>" in template and "<|message|>" in template and "to=" in template:
        return HARMONY
    return None


def function_call(name, arguments, names) -> dict | None:
    """The OpenAI tool call of ``name`` with ``arguments`` (an object, or its JSON text), or None
    where ``name`` is not among ``names`` or the arguments are not a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not (isinstance(name, str) and name in names and isinstance(arguments, dict)):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _hermes_call(block: str, names: set[str]) -> dict | None:
    """The OpenAI tool call a Hermes block's inner text holds, or None where it is not a valid one."""
    try:
        obj = json.loads(block.strip())
    except (ValueError, RecursionError):
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("arguments"), dict)):  # an object, not its text
        return None
    return function_call(obj.get("name"), obj["arguments"], names)


GLM_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_call(block: str, parameters: dict) -> dict | None:
    """The OpenAI tool call a GLM block's inner text holds (``parameters``: tool name -> its
    parameters' JSON schema, or None), or None where it is not a valid one (module docstring)."""
    at = block.find("<arg_key>")
    name, rest = (block, "") if at < 0 else (block[:at], block[at:])
    name = name.strip()
    if name not in parameters:
        return None
    types = {k: (v or {}).get("type") if isinstance(v, dict) else None
             for k, v in ((parameters[name] or {}).get("properties") or {}).items()}
    args, at = {}, 0
    while at < len(rest):
        m = GLM_ARGUMENT.match(rest, at)
        if m is None:
            break
        key, value = m.group(1).strip(), m.group(2)
        if key in args:
            return None
        if types.get(key) != "string":
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass  # not JSON: the text, as written
        args[key], at = value, m.end()
    if rest[at:].strip():
        return None
    return function_call(name, args, parameters)


def reader(fmt: str, tools) -> Callable[[str], dict | None]:
    """The block reader of call format ``fmt`` (:data:`HERMES`, :data:`GLM`) for ``tools``
    (``(name, parameters)`` pairs): a block's inner text -> its call, or None."""
    tools = dict(tools)
    if fmt == GLM:
        return lambda block: _glm_call(block, tools)
    return lambda block: _hermes_call(block, set(tools))


class TaggedCalls:
    """Text in, in pieces; out, content pieces and complete calls (:meth:`feed`, :meth:`finish`:
    lists of ``("content", text)`` and ``("call", call)``), each ``<tool_call>`` block read by
    ``read`` (:func:`reader`). Per piece the work is bounded by the piece and the open block, not by
    the text so far."""

    def __init__(self, read):
        self.read = read
        self.pending = ""  # content held back (it could begin OPEN), or an open block
        self.inside = False
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.pending += piece
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    return out
                block, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.inside = False
                call = self.read(block)
                if call is None:  # not a call after all: its text is content, as written
                    out.append(("content", OPEN + block + CLOSE))
                else:
                    self.calls += 1
                    out.append(("call", call))
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                if start:
                    out.append(("content", self.pending[:start]))
                self.pending = self.pending[start + len(OPEN):]
                self.inside = True
                continue
            keep = held_back(self.pending, [OPEN])
            text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            if text:
                out.append(("content", text))
            return out

    def finish(self) -> list[tuple[str, object]]:
        """What is left at the end: held-back content, or an unclosed block's text, as content."""
        text = (OPEN if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        return [("content", text)] if text else []


def parse_tagged(text: str, read) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole text: the blocks ``read`` makes calls of as calls, the rest as
    content (None where only whitespace is left once calls were found)."""
    stream = TaggedCalls(read)
    events = stream.feed(text) + stream.finish()
    content = "".join(x for kind, x in events if kind == "content")
    calls = [x for kind, x in events if kind == "call"]
    if calls and not content.strip():
        content = None
    return content, calls
