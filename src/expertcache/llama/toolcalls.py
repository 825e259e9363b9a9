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

and DeepSeek's (V3, R1; V3.1 without ``function`` and the fence), a section of calls::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

A chat template that holds ``<tool_call>`` is taken to teach GLM's where it holds ``<arg_key>`` too,
else Hermes'; one that holds ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁sep｜>``, DeepSeek's
(:func:`call_format`), as llama.cpp's server detects them. (gpt-oss's calls are messages on its
channels: :class:`~.reasoning.HarmonyStream`.)

Invariants (``tests/test_toolcalls.py``):

* **A call is reported only when its block is complete and valid**: the JSON parses to an object
  with a ``name`` among the request's tools and an object of ``arguments`` (Hermes), or the name is
  among them and the rest is key-value pairs only, each key once (GLM: a value is the text as
  written where the tool's parameters type the key a string, else its JSON when it parses), or
  every call of the section is valid (DeepSeek); otherwise the block's text stays content, word
  for word (nothing the model wrote is dropped).
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
HERMES, GLM, DSV3, HARMONY = "hermes", "glm", "deepseek-v3", "harmony"
CALLS_OPEN, CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_OPEN, CALL_CLOSE, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TAGS = {HERMES: (OPEN, CLOSE), GLM: (OPEN, CLOSE), DSV3: (CALLS_OPEN, CALLS_CLOSE)}
"""The tags around a format's block of calls."""
MARKERS = {HERMES: (OPEN, CLOSE), GLM: (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
           DSV3: (CALLS_OPEN, CALLS_CLOSE, CALL_OPEN, CALL_CLOSE, CALL_SEP)}
"""The tags each call format is read by (gpt-oss's: :data:`~.reasoning.MARKERS`)."""


def call_format(template: str | None) -> str | None:
    """``"hermes"``, ``"glm"`` or ``"deepseek-v3"`` where the chat ``template`` teaches that format (module docstring),
    ``"harmony"`` where it teaches gpt-oss's calls (a message ``to=functions.NAME`` on its channels:
    :class:`~.reasoning.HarmonyStream`); None."""
    if template and OPEN in template:
        return GLM if "<arg_key>" in template else HERMES
    if template and CALLS_OPEN in template and CALL_SEP in template:
        return DSV3
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


def _hermes_call(block: str, names: set[str]) -> list[dict] | None:
    """The OpenAI tool call a Hermes block's inner text holds, or None where it is not a valid one."""
    try:
        obj = json.loads(block.strip())
    except (ValueError, RecursionError):
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("arguments"), dict)):  # an object, not its text
        return None
    call = function_call(obj.get("name"), obj["arguments"], names)
    return None if call is None else [call]


DSV3_FENCED = re.compile(r"\s*```json\n(.*)\n```\s*", re.S)


def _deepseek_calls(block: str, names: set[str]) -> list[dict] | None:
    """The calls a DeepSeek block (between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``)
    holds, each ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` with only white space between them;
    inside one, V3's and R1's ``function<｜tool▁sep｜>NAME`` and its arguments in a fenced json block,
    or V3.1's ``NAME<｜tool▁sep｜>ARGUMENTS``. None where any is not a valid call."""
    calls, rest = [], block
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(CALL_OPEN) or CALL_CLOSE not in rest:
            return None
        inner, rest = rest[len(CALL_OPEN):].split(CALL_CLOSE, 1)
        kind, sep, tail = inner.partition(CALL_SEP)
        if not sep:
            return None
        if kind.strip() == "function":  # V3, R1
            name, _, fenced = tail.partition("\n")
            m = DSV3_FENCED.fullmatch(fenced)
            call = function_call(name.strip(), m.group(1), names) if m else None
        else:  # V3.1
            call = function_call(kind.strip(), tail, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


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
    call = function_call(name, args, parameters)
    return None if call is None else [call]


def reader(fmt: str, tools) -> Callable[[str], list[dict] | None]:
    """The block reader of call format ``fmt`` (:data:`HERMES`, :data:`GLM`, :data:`DSV3`) for
    ``tools`` (``(name, parameters)`` pairs): a block's inner text -> its calls, or None."""
    tools = dict(tools)
    if fmt == GLM:
        return lambda block: _glm_call(block, tools)
    if fmt == DSV3:
        return lambda block: _deepseek_calls(block, set(tools))
    return lambda block: _hermes_call(block, set(tools))


class TaggedCalls:
    """Text in, in pieces; out, content pieces and complete calls (:meth:`feed`, :meth:`finish`:
    lists of ``("content", text)`` and ``("call", call)``) of call format ``fmt`` for ``tools``
    (:func:`reader`): each block between the format's tags (:data:`TAGS`) read. Per piece the work is
    bounded by the piece and the open block, not by the text so far."""

    def __init__(self, fmt: str, tools):
        self.read = reader(fmt, tools)
        self.open, self.close = TAGS[fmt]
        self.pending = ""  # content held back (it could begin the open tag), or an open block
        self.inside = False
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.pending += piece
        while True:
            if self.inside:
                end = self.pending.find(self.close)
                if end < 0:
                    return out
                block, self.pending = self.pending[:end], self.pending[end + len(self.close):]
                self.inside = False
                calls = self.read(block)
                if calls is None:  # not a call after all: its text is content, as written
                    out.append(("content", self.open + block + self.close))
                else:
                    self.calls += len(calls)
                    out += [("call", call) for call in calls]
                continue
            start = self.pending.find(self.open)
            if start >= 0:
                if start:
                    out.append(("content", self.pending[:start]))
                self.pending = self.pending[start + len(self.open):]
                self.inside = True
                continue
            keep = held_back(self.pending, [self.open])
            text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            if text:
                out.append(("content", text))
            return out

    def finish(self) -> list[tuple[str, object]]:
        """What is left at the end: held-back content, or an unclosed block's text, as content."""
        text = (self.open if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        return [("content", text)] if text else []


def read_whole(stream, text: str) -> tuple[str, str | None, list[dict]]:
    """``(reasoning, content, calls)`` of a whole text read by ``stream`` (a :class:`TaggedCalls`, or
    a :mod:`.reasoning` stream): its parts joined by kind, the content None where only white space is
    left beside calls."""
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(x for kind, x in parts if kind == "reasoning")
    content = "".join(x for kind, x in parts if kind == "content")
    calls = [x for kind, x in parts if kind == "call"]
    return reasoning, (None if calls and not content.strip() else content), calls


def parse_tagged(text: str, fmt: str, tools) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole text (:class:`TaggedCalls`): the valid blocks as calls, the
    rest as content (None where only whitespace is left once calls were found)."""
    _, content, calls = read_whole(TaggedCalls(fmt, tools), text)
    return content, calls
