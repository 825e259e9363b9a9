"""A reasoning model's thinking, read out of its text into OpenAI-style ``reasoning_content`` (docs/serve.md,
"Reasoning"), as llama.cpp's server does with ``--reasoning-format deepseek``::

    <think>
    The user asks for ...
    </think>

    Paris.

Qwen3-MoE, Qwen3-Next, DeepSeek-R1 and GLM-4.5 write their thinking this way, and their chat
templates say so: a template holding both ``<think>`` and ``</think>`` is taken to teach it
(:func:`think_format`). Some templates open the block themselves (the prompt ends in ``<think>``:
DeepSeek-R1-0528, Qwen3's 2507 thinking models); the text then begins inside it (``opened``).

Invariants (``tests/test_reasoning.py``):

* **Nothing the model wrote is lost or moved between turns of its text**: a text that does not
  begin (after white space) with ``<think>``, and was not opened by the prompt, is content word for
  word. Otherwise the block's inner text, stripped of white space at both ends, is the reasoning,
  and what follows ``</think>``, less its leading white space, is the content; a block never closed
  (the decode hit ``max_tokens``) is all reasoning.
* **Streamed and whole agree**: :class:`ThinkStream` fed the text in any pieces gives the
  reasoning and content :func:`split_reasoning` gives for the whole text (and an independent
  regular expression does, in the tests); a piece that could begin a tag, and white space the
  whole text would strip, are held back until they are known.
"""

from __future__ import annotations

from .._text import held_back

OPEN, CLOSE = "<think>", "</think>"
DEEPSEEK = "deepseek"
REASONING_FORMATS = ("auto", "deepseek", "none")
"""A request's or the server's ``reasoning_format``: ``auto`` and ``deepseek`` read the thinking out
where the template teaches it, ``none`` leaves it in the content (llama.cpp's server's names)."""


def think_format(template: str | None) -> str | None:
    """``"deepseek"`` where the chat ``template`` teaches ``<think>`` blocks (module docstring); None."""
    if template and OPEN in template and CLOSE in template:
        return DEEPSEEK
    return None


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` (its last tokens' text, special tokens spelled) has
    opened a ``<think>`` block the model's text continues."""
    return prompt_tail.rstrip().endswith(OPEN)


class ThinkStream:
    """Text in, in pieces; out, ``("reasoning", text)`` and ``("content", text)`` parts (:meth:`feed`,
    :meth:`finish`). Per piece the work is bounded by the piece and what is held back (a partial tag
    and white space), not by the text so far."""

    def __init__(self, opened: bool = False):
        self.state = "inside" if opened else "start"  # start -> inside -> after, or start -> plain
        self.pending = ""
        self.lead = True  # the part being written has not yet shown a character that is not white space
        self.reasoned = False  # a <think> block was read (opened or written)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.pending += piece
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(OPEN):
                    self.state, self.pending, self.lead = "inside", head[len(OPEN):], True
                    continue
                if OPEN.startswith(head):  # white space, or the start of the tag: not known yet
                    return out
                self.state = "plain"
            if self.state == "plain":
                if self.pending:
                    out.append(("content", self.pending))
                self.pending = ""
                return out
            if self.state == "inside":
                self.reasoned = True
                if self.lead:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return out
                    self.lead = False
                end = self.pending.find(CLOSE)
                if end >= 0:
                    text = self.pending[:end].rstrip()
                    if text:
                        out.append(("reasoning", text))
                    self.state, self.pending, self.lead = "after", self.pending[end + len(CLOSE):], True
                    continue
                keep = held_back(self.pending, [CLOSE])
                body = self.pending[:len(self.pending) - keep]
                text = body.rstrip()  # white space at the end is held: the block may close after it
                if text:
                    out.append(("reasoning", text))
                self.pending = body[len(text):] + self.pending[len(body):]
                return out
            # after the block: the content, its leading white space dropped
            if self.lead:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return out
                self.lead = False
            out.append(("content", self.pending))
            self.pending = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: white space or a partial tag before anything else (content, as
        written), a never-closed block's partial tag (reasoning), nothing after a block."""
        text, state = self.pending, self.state
        self.pending = ""
        if state in ("start", "plain"):
            return [("content", text)] if text else []
        if state == "inside":  # held: white space after what was given, then a partial tag
            text = text.rstrip()
            return [("reasoning", text)] if text else []
        return []


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole text (module docstring); reasoning None where the text
    holds no ``<think>`` block and the prompt opened none."""
    stream = ThinkStream(opened)
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(x for kind, x in parts if kind == "reasoning")
    content = "".join(x for kind, x in parts if kind == "content")
    return (reasoning if stream.reasoned else None), content
