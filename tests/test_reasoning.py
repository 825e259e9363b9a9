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
