"""A reasoning model's <think> block read out of its text (expertcache.llama.reasoning): the whole
text split as an independent regular expression splits it, and the streamed split equal to the
whole one for the text cut into any pieces."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.llama.reasoning import ThinkStream, opens_thinking, split_reasoning, think_format

BLOCK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.S)


def reference(text: str, opened: bool) -> tuple[str | None, str]:
    """The module docstring's rule, written as a regular expression over the whole text."""
    if opened:
        text = "<think>" + text
    m = BLOCK.fullmatch(text)
    if m:
        return m.group(1).strip(), m.group(2).lstrip()
    if re.match(r"\s*<think>", text):  # never closed: all of it reasoning
        return text.lstrip()[len("<think>"):].strip(), ""
    return None, text


def test_reference_cases():
    assert split_reasoning("<think>\nThe user asks.\n</think>\n\nParis.") == ("The user asks.", "Paris.")
    assert split_reasoning("  Paris, <think>no</think>") == (None, "  Paris, <think>no</think>")  # word for word
    assert split_reasoning("I think.\n</think>\n\nParis.", opened=True) == ("I think.", "Paris.")
    assert split_reasoning("<think>cut off by max_toke") == ("cut off by max_toke", "")
    assert split_reasoning("<think></think>Paris") == ("", "Paris")
    assert split_reasoning("<thi") == (None, "<thi")
    assert split_reasoning("") == (None, "") and split_reasoning("", opened=True) == ("", "")
    assert split_reasoning("<think>a</think>b<think>c</think>") == ("a", "b<think>c</think>")
    assert think_format("{{ '<think>' }}x{{ '</think>' }}") == "deepseek"
    assert think_format("<tool_call>") is None and think_format(None) is None
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("<think>\n\n</think>\n\n")


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "k>", "/think", " ", "\n", "\t",
                                   "a", "b c", "é", "\u00a0", "</tool_call>", "x\n\n"]), max_size=14)


@settings(max_examples=400, deadline=None)
@given(parts=PIECES, opened=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_whole_agrees_with_the_reference_and_any_pieces_with_the_whole(parts, opened, cuts):
    text = "".join(parts)
    whole = split_reasoning(text, opened)
    assert whole == reference(text, opened), (text, opened)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = ThinkStream(opened)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out += stream.feed(text[a:b])
    out += stream.finish()
    assert all(x for _, x in out)  # no empty part is reported
    reasoning = "".join(x for k, x in out if k == "reasoning")
    content = "".join(x for k, x in out if k == "content")
    assert (reasoning, content) == (whole[0] or "", whole[1]), (text, bounds)


def test_what_is_held_back_is_bounded_by_a_tag_and_white_space():
    stream = ThinkStream(opened=True)
    for _ in range(1000):
        assert stream.feed("word ") == [("reasoning", "word")] or stream.pending == " "
        assert len(stream.pending) <= len("</think>")


def harmony_reference(text: str) -> tuple[str | None, str]:
    """gpt-oss's harmony text split by its messages (``<|start|>``), their headers and their ends
    (``<|end|>``), as HarmonyStream's docstring states the rule."""
    if not text.startswith("<|channel|>"):
        return None, text
    reasoning, content, began = [], [], False
    for i, msg in enumerate(text.split("<|start|>")):
        raw = msg if i == 0 else "<|start|>" + msg
        head, sep, body = msg.partition("<|message|>")
        if not sep:  # never closed: as written
            content.append(raw)
            continue
        at = head.find("<|channel|>")
        kind = None
        if at >= 0:
            words = [w for w in re.split(r"\s|<\|constrain\|>", head[at + len("<|channel|>"):]) if w]
            if words and not any(w.startswith("to=") for w in words):
                kind = {"analysis": "reasoning", "final": "content", "commentary": "content"}.get(words[0])
        if kind is None:  # the header as written, the body without its <|end|> markers
            content.append(raw[:len(raw) - len(body)] + body.replace("<|end|>", ""))
            continue
        first, _, after = body.partition("<|end|>")
        if kind == "reasoning":
            reasoning.append(("\n" if began else "") + first)
            began = True
        else:
            content.append(first)
        content.append(after.replace("<|end|>", ""))
    return ("".join(reasoning) if began else None), "".join(content)


def test_harmony_reference_cases():
    from expertcache.llama.reasoning import split_harmony

    text = ("<|channel|>analysis<|message|>User greets.<|start|>assistant<|channel|>final<|message|>Bonjour.")
    assert split_harmony(text) == ("User greets.", "Bonjour.")
    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}"
    assert split_harmony(call) == (None, call)  # a call, not read as one: as written
    assert split_harmony("Bonjour <|channel|>") == (None, "Bonjour <|channel|>")
    assert split_harmony("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>analysis<|message|>b") == \
        ("a\nb", "")
    assert split_harmony("<|channel|>analysis<|message|>Hi.<|end|><|start|>assistant<|channel|>final<|message|>Bye.") \
        == ("Hi.", "Bye.")  # as the pinned llama.cpp writes it
    assert think_format("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"


HARMONY_PIECES = st.lists(st.sampled_from(["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|en", "assistant", "analysis",
                                           "final", "commentary", " to=functions.f", "<|constrain|>", "json", " ",
                                           "<|", "|>", "<|chan", "nel|>", "text", "\n", "é"]), max_size=16)


@st.composite
def harmony_messages(draw) -> str:
    """Messages as gpt-oss writes them (a channel, maybe a recipient and a constraint, a body), the
    bodies drawn from the pieces above (so holding partial markers)."""
    out = []
    for i in range(draw(st.integers(1, 4))):
        head = "<|channel|>" + draw(st.sampled_from(["analysis"] * 3 + ["final"] * 3 + ["commentary", "other", ""]))
        head += draw(st.sampled_from(["", "", "", " to=functions.get_weather", " to=browser.search"]))
        head += draw(st.sampled_from(["", " <|constrain|>json", "<|constrain|>json"]))
        start = "" if i == 0 else "<|start|>" + draw(st.sampled_from(["assistant", ""]))
        out.append(start + head + "<|message|>" + "".join(draw(HARMONY_PIECES.map(lambda p: p[:4])))
                   + draw(st.sampled_from(["<|end|>", "<|end|>", ""])))
    return "".join(out)


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(HARMONY_PIECES.map("".join), HARMONY_PIECES.map(lambda p: "<|channel|>" + "".join(p)),
                      harmony_messages()), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_harmony_whole_agrees_with_the_reference_and_any_pieces_with_the_whole(text, cuts):
    from expertcache.llama.reasoning import HarmonyStream, split_harmony

    whole = split_harmony(text)
    assert whole == harmony_reference(text), text
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = HarmonyStream()
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out += stream.feed(text[a:b])
    out += stream.finish()
    assert all(x for _, x in out)
    assert ("".join(x for k, x in out if k == "reasoning"), "".join(x for k, x in out if k == "content")) == \
        (whole[0] or "", whole[1]), (text, bounds)
