"""A reasoning model's thinking, read out of its text into OpenAI-style ``reasoning_content`` (docs/serve.md,
"Reasoning"), as llama.cpp's server does with ``--reasoning-format deepseek``::

    <think>
    The user asks for ...
    </think>

    Paris.

Qwen3-MoE, Qwen3-Next, DeepSeek-R1 and GLM-4.5 write their thinking this way, and their chat
templates say so: a template holding both ``<think>`` and ``</think>`` is taken to teach it
(:func:`think_format`). Gemma 4 writes the same block between other tags,
``<|channel>thought`` and ``<channel|>`` (:data:`TAGS`); its prompt opens and closes an empty one
unless ``enable_thinking`` is set, and its blocks may stand anywhere (:data:`REPEATS`). Kimi K3
thinks in a ``think`` section, then answers in a ``response`` section whose marks (:data:`DROPPED`)
are taken out of the content; MiniMax-M3 between ``<mm:think>`` and ``</mm:think>``, a turn without
thinking beginning with the bare close (taken out too). Some
templates open the block themselves (the prompt ends in ``<think>``: DeepSeek-R1-0528, Qwen3's 2507
thinking models); the text then begins inside it (``opened``), and an open tag the model writes
again at its start is dropped (a forced call's grammar lets a model open its block, where its prompt
may have: :func:`~.callgrammar.call_grammar`). gpt-oss writes its thinking in
harmony channels instead (:class:`HarmonyStream`), with the same two invariants below.

Invariants (``tests/test_reasoning.py``):

* **Nothing the model wrote is lost but the tags and the white space around them**: a text that
  does not begin (after white space) with ``<think>``, and was not opened by the prompt, is content
  word for word. Otherwise the block's inner text, stripped of white space at both ends, is the reasoning,
  and what follows ``</think>``, less its leading white space, is the content; a block never closed
  (the decode hit ``max_tokens``) is all reasoning, but where the request offers tools and the
  format's block of calls begins inside it (``ends``: DeepSeek's DSML calls, Kimi K2's: those
  models may start calling without closing the block, and llama.cpp reads it so), the block ends
  there and the calls begin the content. In :data:`REPEATS` formats every later block's
  inner text joins the reasoning (after a blank line) and a lone close tag is dropped; the content
  around them is kept as written.
* **Streamed and whole agree**: :class:`ThinkStream` fed the text in any pieces gives the
  reasoning and content :func:`split_reasoning` gives for the whole text (and an independent
  regular expression does, in the tests); a piece that could begin a tag, and white space the
  whole text would strip, are held back until they are known.
"""

from __future__ import annotations

import re

from .._text import held_back
from .toolcalls import (K3_CLOSE, K3_END, K3_OPEN, K3_SEP, KIMI_K3, MINIMAX_M3, function_call, k3_close, k3_open,
                        read_whole)

OPEN, CLOSE = "<think>", "</think>"
DEEPSEEK, GEMMA4, HARMONY = "deepseek", "gemma4", "harmony"
GEMMA4_CHANNEL, GEMMA4_END = "<|channel>", "<channel|>"
TAGS = {DEEPSEEK: (OPEN, CLOSE), GEMMA4: (GEMMA4_CHANNEL + "thought", GEMMA4_END),
        KIMI_K3: (k3_open("think"), k3_close("think")), MINIMAX_M3: ("<mm:think>", "</mm:think>")}
"""The tags around a thinking block, per format :class:`ThinkStream` reads."""
BREAKS = {KIMI_K3: (k3_open("response"), k3_close("response"))}
"""Tags that end a block never closed in every request (they stay in the text): Kimi K3's answer
section beginning (llama.cpp's parser ends the reasoning there), and its end (a forced call's
grammar may close the answer section the prompt opened: :data:`~.callgrammar.LEADS`)."""
DROPPED = {KIMI_K3: (k3_open("response"), k3_close("response"), k3_close("message")),
           MINIMAX_M3: (TAGS[MINIMAX_M3][1],)}
"""Tags taken out of the content wherever they stand: the sections Kimi K3 writes its answer in
(``<|open|>response<|sep|>`` ... ``<|close|>response<|sep|>``, then ``<|close|>message<|sep|>``; its
calls' section is :mod:`.toolcalls`'); the bare ``</mm:think>`` MiniMax-M3 begins a turn without
thinking with."""
REPEATS = frozenset({GEMMA4})
"""Formats whose text may hold more thinking blocks after the first, anywhere: Gemma 4 may end its
answer with an empty block or a lone close tag (llama.cpp's parser reads them out). Their text is
read as content and blocks: each block's inside goes to the reasoning (a blank line before a later
block's text where reasoning came before), a close tag with no block is dropped."""
CHANNEL, MESSAGE, START, END = "<|channel|>", "<|message|>", "<|start|>", "<|end|>"
"""gpt-oss's harmony markers that reach the text: the pinned llama.cpp renders these and
``<|constrain|>`` (``tests/test_serve.py`` checks it), and ends the decode at ``<|return|>`` and
``<|call|>``."""
MARKERS = {DEEPSEEK: (OPEN, CLOSE), GEMMA4: (GEMMA4_CHANNEL, GEMMA4_END), KIMI_K3: (K3_OPEN, K3_CLOSE, K3_SEP),
           MINIMAX_M3: TAGS[MINIMAX_M3],
           HARMONY: (CHANNEL, MESSAGE, START, END, "<|constrain|>")}
"""The tags each format is read by (:func:`~.completion.preserved_tokens`)."""
MAX_HEADER = 512
"""Characters a harmony header (``<|channel|>`` to ``<|message|>``) may take before the text is taken as plain."""


def think_format(template: str | None) -> str | None:
    """``"deepseek"`` where the chat ``template`` teaches ``<think>`` blocks, ``"gemma4"`` Gemma 4's,
    ``"kimi-k3"`` Kimi K3's, ``"minimax-m3"`` MiniMax-M3's (:data:`TAGS`), ``"harmony"`` where it
    teaches gpt-oss's channels (:class:`HarmonyStream`); None."""
    if template and all(mark in template for mark in (K3_OPEN, K3_CLOSE, K3_END)):
        return KIMI_K3
    if template and all(tag in template for tag in TAGS[MINIMAX_M3]):
        return MINIMAX_M3
    if template and OPEN in template and CLOSE in template:
        return DEEPSEEK
    if template and CHANNEL in template and MESSAGE in template:
        return HARMONY
    if template and all(tag in template for tag in MARKERS[GEMMA4]):
        return GEMMA4
    return None


def opens_thinking(prompt_tail: str, fmt: str = DEEPSEEK) -> bool:
    """Whether a prompt ending in ``prompt_tail`` (its last tokens' text, special tokens spelled) has
    opened a thinking block (``<think>``: format ``fmt``'s, :data:`TAGS`) the model's text continues."""
    return prompt_tail.rstrip().endswith(TAGS[fmt][0])


class ThinkStream:
    """Text in, in pieces; out, ``("reasoning", text)`` and ``("content", text)`` parts (:meth:`feed`,
    :meth:`finish`). Per piece the work is bounded by the piece and what is held back (a partial tag
    and white space), not by the text so far."""

    def __init__(self, opened: bool = False, fmt: str = DEEPSEEK, ends: tuple[str, ...] = ()):
        self.open, self.close = TAGS[fmt]
        self.ends = tuple(ends) + BREAKS.get(fmt, ())  # a block never closed ends where one begins (kept)
        self.dropped = Dropped(DROPPED.get(fmt, ()))
        self.repeats = fmt in REPEATS
        # start -> inside -> after, or start -> plain; :data:`REPEATS`: after or start -> content <-> inside
        self.state = "inside" if opened else "start"
        self.reopen = opened  # a block the prompt opened may begin with its open tag, written again: dropped
        self.pending = ""
        self.lead = True  # the part being written has not yet shown a character that is not white space
        self.reasoned = False  # a first block was read (opened or written), or reasoning text given
        self.later = False  # the block being read is not the text's first (REPEATS)
        self.said = False  # reasoning text was given
        self.blank = False  # a later block's text is due a blank line before it (reasoning text came before)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        return self.dropped.parts(self._feed(piece))

    def _feed(self, piece: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.pending += piece
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                opens = _opens(head, self.open)
                if opens is None:  # white space, or the start of the tag: not known yet
                    return out
                if opens:
                    self.state, self.pending, self.lead = "inside", head[len(self.open):], True
                    continue
                if self.repeats:
                    self.state = "content"
                    continue
                return _plain(self, out)
            if self.state == "content":  # REPEATS: content, blocks anywhere, a lone close tag dropped
                at = [i for i in (self.pending.find(self.open), self.pending.find(self.close)) if i >= 0]
                if not at:
                    keep = held_back(self.pending, [self.open, self.close])
                    if len(self.pending) > keep:
                        out.append(("content", self.pending[:len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep:]
                    return out
                i = min(at)
                if i:
                    out.append(("content", self.pending[:i]))
                if self.pending.startswith(self.close, i):
                    self.pending = self.pending[i + len(self.close):]
                else:
                    self.state, self.pending, self.lead = "inside", self.pending[i + len(self.open):], True
                    self.later, self.blank = True, self.said
                continue
            if self.state == "plain":
                return _plain(self, out)
            if self.state == "inside":
                self.reasoned = self.reasoned or not self.later
                if self.lead:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return out
                    if self.reopen:
                        opens = _opens(self.pending, self.open)
                        if opens is None:  # the start of the open tag: not known yet
                            return out
                        self.reopen = False
                        if opens:
                            self.pending = self.pending[len(self.open):]
                            continue
                    self.lead = False
                end, tag = min(((i, t) for t in (self.close, *self.ends) if (i := self.pending.find(t)) >= 0),
                               default=(-1, ""))
                if end >= 0:
                    self._reason(out, self.pending[:end].rstrip())
                    self.state = "content" if self.later else "after"
                    skip = len(self.close) if tag == self.close else 0  # an end begins the content
                    self.pending, self.lead = self.pending[end + skip:], True
                    continue
                keep = held_back(self.pending, [self.close, *self.ends])
                body = self.pending[:len(self.pending) - keep]
                text = body.rstrip()  # white space at the end is held: the block may close after it
                self._reason(out, text)
                self.pending = body[len(text):] + self.pending[len(body):]
                return out
            # after the first block: the content, its leading white space dropped
            if self.lead:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return out
                self.lead = False
            if self.repeats:
                self.state = "content"
                continue
            if self.pending:  # an empty piece gives no part
                out.append(("content", self.pending))
            self.pending = ""
            return out

    def _reason(self, out: list, text: str) -> None:
        """``text`` given as reasoning (none where it is empty), after a blank line where it begins a
        later block's and reasoning came before."""
        if text:
            out.append(("reasoning", "\n\n" + text if self.blank else text))
            self.reasoned, self.said, self.blank = True, True, False

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: white space or a partial tag before anything else, or in the
        content (:data:`REPEATS`): content, as written; a never-closed block's partial tag
        (reasoning); nothing after a block."""
        text, state = self.pending, self.state
        self.pending = ""
        out: list[tuple[str, str]] = []
        if state in ("start", "plain", "content") and text:
            out.append(("content", text))
        if state == "inside":  # held: white space after what was given, then a partial tag
            self._reason(out, text.rstrip())
        return self.dropped.parts(out, True)


class Dropped:
    """Content in pieces, out with every one of ``tags`` taken out, the text read once left to right
    (a tag is a special token of the model's vocabulary: taking one out never makes another, as the
    model's tokens cannot join); a piece that could begin one is held back until it cannot."""

    def __init__(self, tags=()):
        self.tags, self.pending = tuple(tags), ""
        self.found = re.compile("|".join(map(re.escape, self.tags))) if self.tags else None

    def parts(self, parts: list[tuple[str, str]], last: bool = False) -> list[tuple[str, str]]:
        """``parts`` with their content taken through (``last``: the end of the text, nothing held)."""
        if not self.tags:
            return parts
        out = []
        for kind, text in parts:
            if kind != "content":
                out.append((kind, text))
                continue
            pieces = self.found.split(self.pending + text)
            tail = pieces[-1]
            keep = held_back(tail, list(self.tags))
            text, self.pending = "".join(pieces[:-1]) + tail[:len(tail) - keep], tail[len(tail) - keep:]
            if text:
                out.append(("content", text))
        if last and self.pending:
            out.append(("content", self.pending))
            self.pending = ""
        return out


def _opens(head: str, marker: str) -> bool | None:
    """Whether a text beginning ``head`` opens with ``marker``; None while ``head`` is a prefix of it."""
    if head.startswith(marker):
        return True
    return None if marker.startswith(head) else False


def _plain(stream, out: list) -> list:
    """A text that did not open with the stream's marker: the rest of it is content, as written."""
    stream.state = "plain"
    if stream.pending:
        out.append(("content", stream.pending))
    stream.pending = ""
    return out


def split_reasoning(text: str, opened: bool = False, fmt: str = DEEPSEEK, ends: tuple[str, ...] = ()
                    ) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole text (module docstring); reasoning None where the text
    holds no thinking block (format ``fmt``'s: :data:`TAGS`) and the prompt opened none; ``ends``:
    :data:`~.toolcalls.ENDS_THINKING`'s, where the request offers tools."""
    stream = ThinkStream(opened, fmt, ends)
    reasoning, content, _ = read_whole(stream, text)  # no calls: the content is text
    return (reasoning if stream.reasoned else None), content


class HarmonyStream:
    """gpt-oss's harmony format, as its text reaches the server: messages
    ``[ to=RECIPIENT]<|channel|>NAME[ to=RECIPIENT][ [<|constrain|>]TYPE]<|message|>BODY<|end|>``,
    each after the first opened by ``<|start|>ROLE`` (the prompt opened the first:
    ``<|start|>assistant``); the channel's name is the header's first word (``<|constrain|>`` and
    white space separate words), a recipient a word ``to=...`` before the body.

    Out, as :class:`ThinkStream`'s, plus ``("call", call)``: the ``analysis`` channel's bodies are
    reasoning (a second one after a newline), the ``final`` channel's and a ``commentary`` body with
    no recipient are content; a body ends at ``<|end|>`` or the next ``<|start|>`` (or the text's
    end: ``<|call|>`` and ``<|return|>`` end the decode), and text after its ``<|end|>`` (none, as
    gpt-oss writes) is content, ``<|end|>`` markers left out. A message to ``functions.NAME``, with
    ``names`` given and NAME among them, is a tool call (:func:`~.toolcalls.function_call`) once its
    body is complete, if the body is a JSON object. Everything else stays content as written, header
    and all: such a message whose body is not a JSON object, a message to another recipient, a
    channel not named above, a message with no channel, a header longer than :data:`MAX_HEADER`, and
    a text that begins with neither ``<|channel|>`` nor a recipient."""

    def __init__(self, names=None):
        self.names = None if names is None else set(names)
        self.state = "start"  # start -> role -> header -> body -> role ..., or plain
        self.pending = ""
        self.kind: str | None = None  # where the body goes: "reasoning", "content", "call"
        self.reasoned = False  # a reasoning body has begun
        self.raw = ""  # the message's opening as written (for one kept as written)
        self.callee: str | None = None  # with kind "call": the function
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.pending += piece
        while True:
            if self.state == "start":
                opens = [_opens(self.pending, m) for m in (CHANNEL, " to=", "to=")]
                if any(opens):
                    self.state = "role"
                    continue
                if None in opens:
                    return out
                return _plain(self, out)
            if self.state == "plain":
                return _plain(self, out)
            if self.state in ("role", "header"):
                # role (after <|start|>): up to the header or the body; header: up to the body
                marks = (CHANNEL, MESSAGE, START) if self.state == "role" else (MESSAGE, START)
                at, mark = min(((self.pending.find(m), m) for m in marks if m in self.pending), default=(-1, None))
                if at < 0:
                    if len(self.pending) > MAX_HEADER:
                        self._as_written(out)
                        continue
                    return out
                if mark == START:  # a message that began before this one's body did: this one as written
                    out.append(("content", self.raw + self.pending[:at]))
                    self.raw, self.pending, self.state = START, self.pending[at + len(START):], "role"
                    continue
                self.raw += self.pending[:at]
                self.pending = self.pending[at:]
                if self.state == "role":
                    self.state = "header"
                    continue
                self.raw += MESSAGE
                self.pending = self.pending[len(MESSAGE):]
                self._open_body(out)
                continue
            # body: up to its <|end|> (what follows, content) or the next <|start|>
            end, mark = min(((self.pending.find(m), m) for m in (END, START) if m in self.pending),
                            default=(-1, None))
            if end >= 0:
                self._body(out, self.pending[:end], done=True)
                self.pending = self.pending[end + len(mark):]
                if mark == START:
                    self.raw, self.state = START, "role"
                else:  # after <|end|>: content (none, as gpt-oss writes)
                    self.kind = "content"
                continue
            keep = held_back(self.pending, [START, END])
            self._body(out, self.pending[:len(self.pending) - keep], done=False)
            self.pending = self.pending[len(self.pending) - keep:]
            return out

    def _open_body(self, out: list) -> None:
        """The header is complete (``self.raw`` holds the message's opening): where its body goes."""
        opening = self.raw.removesuffix(MESSAGE)
        header = opening.rsplit(CHANNEL, 1)[1] if CHANNEL in opening else ""
        words = header.replace("<|constrain|>", " ").split()
        recipient = next((w[3:] for w in opening.replace(START, " ").replace(CHANNEL, " ").replace(
                          "<|constrain|>", " ").split()
                          if w.startswith("to=")), None)
        kind = None
        if recipient is not None:
            name = recipient.removeprefix("functions.")
            if self.names is not None and recipient.startswith("functions.") and name in self.names:
                kind, self.callee, self.args = "call", name, ""
        elif words:
            kind = {"analysis": "reasoning", "final": "content", "commentary": "content"}.get(words[0])
        if kind is None:
            out.append(("content", self.raw))
            kind = "content"
        elif kind == "reasoning":
            if self.reasoned:
                out.append(("reasoning", "\n"))
            self.reasoned = True
        if kind != "call":
            self.raw = ""
        self.kind, self.state = kind, "body"

    def _body(self, out: list, text: str, done: bool) -> None:
        """A body's ``text``; ``done``: its end (a call is then read, or kept as written)."""
        if self.kind != "call":
            if text:
                out.append((self.kind, text))
            return
        self.args += text
        if done:
            call = function_call(self.callee, self.args, self.names)
            if call is None:
                out.append(("content", self.raw + self.args))
            else:
                self.calls += 1
                out.append(("call", call))
            self.raw, self.kind = "", "content"

    def _as_written(self, out: list) -> None:
        """A header that never closed: it and the rest are content, as written."""
        out.append(("content", self.raw + self.pending))
        self.raw, self.pending, self.state = "", "", "plain"

    def finish(self) -> list[tuple[str, object]]:
        """What is held at the end: a partial marker or header as content (as written), a body's
        partial marker in its body, a call's body read."""
        out: list[tuple[str, object]] = []
        if self.state == "body":
            self._body(out, self.pending, done=True)
        elif self.raw + self.pending:
            out.append(("content", self.raw + self.pending))
        self.raw = self.pending = ""
        self.state = "plain"
        return out


def read_harmony(text: str, names=None) -> tuple[str | None, str | None, list[dict]]:
    """``(reasoning, content, calls)`` of a whole harmony text (:class:`HarmonyStream` with the
    tools' ``names``): reasoning None where no ``analysis`` message began, content None where only
    white space is left beside calls."""
    stream = HarmonyStream(names)
    reasoning, content, calls = read_whole(stream, text)
    return (reasoning if stream.reasoned else None), content, calls


def split_harmony(text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole harmony text (:class:`HarmonyStream`); reasoning None
    where no ``analysis`` message began (no tools: every message to one is content)."""
    return read_harmony(text)[:2]
