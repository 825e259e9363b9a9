"""Tool calls written in a model's own format, read back into OpenAI's ``tool_calls`` (docs/serve.md,
"Tool calls"): the Hermes format, which Qwen3-MoE, Qwen3-Next and many other models are trained on
and whose chat templates teach it::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that holds ``<tool_call>`` (and not GLM-4.5's ``<arg_key>``, whose calls are not
JSON) is taken to speak it (:func:`call_format`), as llama.cpp's server detects it.

Invariants (``tests/test_toolcalls.py``):

* **A call is reported only when its block is complete and valid**: the JSON parses to an object
  with a ``name`` among the request's tools and an object of ``arguments``; otherwise the block's text
  stays content, word for word (nothing the model wrote is dropped).
* **Streamed and whole agree**: :class:`HermesStream` fed the text in any pieces gives the content
  and calls :func:`parse_hermes` gives for the whole text; content that could begin ``<tool_call>``
  is held back until it cannot, a block until its ``</tool_call>``.
"""

from __future__ import annotations

import json
import uuid

from .._text import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES, HARMONY = "hermes", "harmony"
MARKERS = {HERMES: (OPEN, CLOSE)}
"""The tags each call format is read by (gpt-oss's: :data:`~.reasoning.MARKERS`)."""


def call_format(template: str | None) -> str | None:
    """``"hermes"`` where the chat ``template`` teaches the Hermes format (module docstring),
    ``"harmony"`` where it teaches gpt-oss's calls (a message ``to=functions.NAME`` on its channels:
    :class:`~.reasoning.HarmonyStream`); None."""
    if template and OPEN in template and "<arg_key>" not in template:
        return HERMES
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


def _call(block: str, names: set[str]) -> dict | None:
    """The OpenAI tool call a block's inner text holds, or None where it is not a valid one."""
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("arguments"), dict)):  # an object, not its text
        return None
    return function_call(obj.get("name"), obj["arguments"], names)


class HermesStream:
    """Text in, in pieces; out, content pieces and complete calls (:meth:`feed`, :meth:`finish`:
    lists of ``("content", text)`` and ``("call", call)``). Per piece the work is bounded by the
    piece and the open block, not by the text so far."""

    def __init__(self, names):
        self.names = set(names)
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
                call = _call(block.strip(), self.names)
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


def parse_hermes(text: str, names) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole text: the valid blocks as calls, the rest as content (None
    where only whitespace is left once calls were found)."""
    stream = HermesStream(names)
    events = stream.feed(text) + stream.finish()
    content = "".join(x for kind, x in events if kind == "content")
    calls = [x for kind, x in events if kind == "call"]
    if calls and not content.strip():
        content = None
    return content, calls
