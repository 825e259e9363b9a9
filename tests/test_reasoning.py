"""A reasoning model's <think> block read out of its text (expertcache.llama.reasoning): the whole
text split as an independent regular expression splits it, and the streamed split equal to the
whole one for the text cut into any pieces."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.llama.reasoning import ThinkStream, opens_thinking, split_reasoning, think_format
from expertcache.llama.toolcalls import DSV4, ENDS_THINKING, KIMI, parse_tagged
from test_toolcalls import streamed

SPELLED = {"deepseek": ("<think>", "</think>"), "gemma4": ("<|channel>thought", "<channel|>"),
           "kimi-k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>"), "minimax-m3": ("<mm:think>", "</mm:think>")}
"""Each format's tags, as its models write them."""
K3_SECTIONS = ("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>")
"""Kimi K3's answer section and message end: the first two end a thinking block never closed (the
second where a forced call closes the answer section its prompt opened), all are taken out of the
content."""
OUT = {"kimi-k3": K3_SECTIONS, "minimax-m3": ("</mm:think>",)}
"""Per format, the tags taken out of the content (MiniMax-M3 begins a turn without thinking with a
bare close)."""


def reference(text: str, opened: bool, fmt: str = "deepseek", ends=()) -> tuple[str | None, str]:
    """The module docstring's rule, written as regular expressions over the whole text; Gemma 4's
    blocks anywhere after the first (a blank line between the texts of two), a lone close dropped;
    ``ends``: tags that end the first block where they begin, kept in the content."""
    o, c = (re.escape(tag) for tag in SPELLED[fmt])
    if opened and not text.lstrip().startswith(SPELLED[fmt][0]):  # an open tag written again is dropped
        text = SPELLED[fmt][0] + text
    if fmt == "kimi-k3":
        ends = (*ends, *K3_SECTIONS[:2])
    end = "".join("|(?=" + re.escape(e) + ")" for e in ends)
    m = re.fullmatch(r"\s*" + o + "(.*?)(?:" + c + end + ")(.*)", text, re.S)
    if m:
        parts, rest, reasoned = [m.group(1).strip()], m.group(2).lstrip(), True
    elif re.match(r"\s*" + o, text):  # never closed: all of it reasoning
        return text.lstrip()[len(SPELLED[fmt][0]):].strip(), ""
    else:
        parts, rest, reasoned = [], text, False
    if fmt in OUT:  # its sections out of the content, read once left to right (a special token each)
        rest = re.sub("|".join(map(re.escape, OUT[fmt])), "", rest)
    if fmt != "gemma4":
        return (parts[0] if reasoned else None), rest
    pieces = re.split("(" + o + ".*?" + c + "|" + o + ".*$|" + c + ")", rest, flags=re.S)
    content = "".join(pieces[0::2])
    for sep in pieces[1::2]:
        inner = re.fullmatch(o + "(.*?)(?:" + c + ")?", sep, re.S)
        if inner and inner.group(1).strip():
            parts.append(inner.group(1).strip())
            reasoned = True
    return ("\n\n".join(p for p in parts if p) if reasoned else None), content


def test_reference_cases():
    assert split_reasoning("<think>\nThe user asks.\n</think>\n\nParis.") == ("The user asks.", "Paris.")
    assert split_reasoning("  Paris, <think>no</think>") == (None, "  Paris, <think>no</think>")  # word for word
    assert split_reasoning("I think.\n</think>\n\nParis.", opened=True) == ("I think.", "Paris.")
    assert split_reasoning("\n<think>I think.</think>Paris.", opened=True) == ("I think.", "Paris.")  # opened again
    assert split_reasoning("I <think>.</think>Paris.", opened=True) == ("I <think>.", "Paris.")  # not at the start
    assert split_reasoning("<think>cut off by max_toke") == ("cut off by max_toke", "")
    assert split_reasoning("<think></think>Paris") == ("", "Paris")
    assert split_reasoning("<thi") == (None, "<thi")
    assert split_reasoning("") == (None, "") and split_reasoning("", opened=True) == ("", "")
    assert split_reasoning("<think>a</think>b<think>c</think>") == ("a", "b<think>c</think>")
    assert think_format("{{ '<think>' }}x{{ '</think>' }}") == "deepseek"
    assert think_format("<tool_call>") is None and think_format(None) is None
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("<think>\n\n</think>\n\n")
    # Gemma 4's: the same block between its own tags; its prompt opens and closes an empty one
    assert split_reasoning("<|channel>thought\nI'm\nthinking<channel|>Hello", fmt="gemma4") == ("I'm\nthinking", "Hello")
    assert split_reasoning("<|channel>thought<channel|>Hi", fmt="gemma4") == ("", "Hi")
    assert split_reasoning("<think>a</think>b", fmt="gemma4") == (None, "<think>a</think>b")
    # Gemma 4 may end an answer with an empty block or a lone close tag (llama.cpp's tests): read out
    assert split_reasoning("<|channel>thought\n<channel|>Hello, world!<|channel>thought\n<channel|><channel|>",
                           fmt="gemma4") == ("", "Hello, world!")
    assert split_reasoning("Hi<|channel>thought\nx<channel|> there<|channel>thought y", fmt="gemma4") == \
        ("x\n\ny", "Hi there")
    assert think_format("{{- '<|channel>thought\\n' + t + '\\n<channel|>' -}}") == "gemma4"
    assert not opens_thinking("<|turn>model\n<|channel>thought\n<channel|>", "gemma4")
    assert opens_thinking("<|turn>model\n<|channel>thought\n", "gemma4")


PIECES = {"deepseek": ["<think>", "</think>", "<", "</", "<th", "ink>", "k>", "/think"],
          "kimi-k3": [*SPELLED["kimi-k3"], *K3_SECTIONS, "<|open|>", "<|close|>", "<|sep|>", "think", "response",
                      "message", "<|open|>resp", "onse<|sep|>", "<|clo", "se|>message<|sep|>"],
          "minimax-m3": ["<mm:think>", "</mm:think>", "</mm:", "think>", "<", "</", "<think>", "</think>"],
          "gemma4": ["<|channel>thought", "<|channel>", "thought", "<channel|>", "<|chan", "nel|>", "<", "<|", "|>"]}
DSV4_ENDS = ENDS_THINKING[DSV4]
ENDS_PIECES = [*DSV4_ENDS, "<｜DSML｜", "tool_calls>", " calls>", "<｜", "</｜DSML｜tool_calls>"]


def test_a_call_block_ends_a_block_never_closed():
    # llama.cpp's DeepSeek-V4 case: the model calls without closing its thinking
    text = ("Let me check the time\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter "
            "name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    reasoning, content = split_reasoning(text, True, "deepseek", DSV4_ENDS)
    assert reasoning == "Let me check the time" and content == text[text.index("<｜DSML｜tool_calls>"):]
    assert parse_tagged(content, DSV4, [("get_time", {"type": "object", "properties": {"city": {"type": "string"}}})]
                        )[1][0]["function"] == {"name": "get_time", "arguments": '{"city": "Tokyo"}'}
    assert split_reasoning(text, True) == (text, "")  # without tools offered: all reasoning, as before
    assert split_reasoning("<think>a</think>b<｜DSML｜tool_calls>", ends=DSV4_ENDS) == ("a", "b<｜DSML｜tool_calls>")
    assert split_reasoning("<think>a<|tool_call_begin|>x", ends=ENDS_THINKING[KIMI]) == ("a", "<|tool_call_begin|>x")


def test_kimi_k3_reference_cases():
    """llama.cpp's tests of Kimi K3's parser: the thinking the prompt opened, the answer in its
    section, a turn cut off while thinking, prose that names the sections."""
    k3 = "kimi-k3"
    assert think_format("{{- '<|open|>' + t + '<|sep|>' -}}{{ '<|close|>' }}{{ '<|end_of_msg|>' }}<think></think>") == k3
    assert split_reasoning("I'm thinking about this<|close|>think<|sep|><|open|>response<|sep|>Hello, world!\nWhat's "
                           "up?<|close|>response<|sep|><|close|>message<|sep|>", True, k3) == \
        ("I'm thinking about this", "Hello, world!\nWhat's up?")
    assert split_reasoning("I was still thinking when the budget ran out", True, k3) == \
        ("I was still thinking when the budget ran out", "")
    assert split_reasoning("Use the response tag, then message the handler.", False, k3) == \
        (None, "Use the response tag, then message the handler.")
    assert split_reasoning("Hi<|close|>response<|sep|><|close|>message<|sep|>", False, k3) == (None, "Hi")
    assert split_reasoning("no close<|open|>response<|sep|>Hi", True, k3) == ("no close", "Hi")  # llama.cpp's too
    assert opens_thinking('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', k3)
    # a section's mark is one token: taking one out of the text makes no other (streamed, the same)
    joined = "<|open|>resp<|open|>response<|sep|>onse<|sep|>"
    assert split_reasoning(joined, False, k3) == (None, "<|open|>response<|sep|>")
    assert "".join(x for _, x in streamed(ThinkStream(False, k3), joined, [13])) == "<|open|>response<|sep|>"


def test_minimax_m3_reference_cases():
    """llama.cpp's tests of MiniMax-M3's thinking: a turn without it begins with a bare close."""
    m3 = "minimax-m3"
    assert think_format("{{ '<mm:think>' }}{{ reasoning }}{{ '</mm:think>' }}") == m3
    assert split_reasoning("</mm:think>Hello, world!\nWhat's up?", False, m3) == (None, "Hello, world!\nWhat's up?")
    assert split_reasoning("<mm:think>Thinking about it</mm:think>Let me call the function.", False, m3) == \
        ("Thinking about it", "Let me call the function.")
    assert split_reasoning("<mm:think></mm:think>Hi", False, m3) == ("", "Hi")
    assert split_reasoning("<think>a</think>b", False, m3) == (None, "<think>a</think>b")


@pytest.mark.parametrize("fmt,ends", [(f, ()) for f in sorted(SPELLED)] + [("deepseek", DSV4_ENDS)])
@settings(max_examples=400, deadline=None)
@given(data=st.data(), opened=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_whole_agrees_with_the_reference_and_any_pieces_with_the_whole(fmt, ends, data, opened, cuts):
    parts = data.draw(st.lists(st.sampled_from(PIECES[fmt] + [" ", "\n", "\t", "a", "b c", "é", "\u00a0", "</tool_call>",
                                                              "x\n\n"] + (ENDS_PIECES if ends else [])),
                               max_size=14), label="parts")
    text = "".join(parts)
    whole = split_reasoning(text, opened, fmt, ends)
    assert whole == reference(text, opened, fmt, ends), (text, opened)
    bounds = sorted({min(c, len(text)) for c in cuts})
    out = streamed(ThinkStream(opened, fmt, ends), text, bounds)
    assert all(x for _, x in out)  # no empty part is reported
    reasoning = "".join(x for k, x in out if k == "reasoning")
    content = "".join(x for k, x in out if k == "content")
    assert (reasoning, content) == (whole[0] or "", whole[1]), (text, bounds)


def test_what_is_held_back_is_bounded_by_a_tag_and_white_space():
    stream = ThinkStream(opened=True)
    for _ in range(1000):
        assert stream.feed("word ") == [("reasoning", "word")] or stream.pending == " "
        assert len(stream.pending) <= len("</think>")


def harmony_reference(text: str, names=None) -> tuple[str | None, str, list]:
    """gpt-oss's harmony text split by its messages (``<|start|>``), their headers and their ends
    (``<|end|>``), as HarmonyStream's docstring states the rule; calls as (name, arguments)."""
    if not text.startswith(("<|channel|>", " to=", "to=")):
        return None, text, []
    reasoning, content, calls, began = [], [], [], False
    for i, msg in enumerate(text.split("<|start|>")):
        raw = msg if i == 0 else "<|start|>" + msg
        head, sep, body = msg.partition("<|message|>")
        if not sep:  # never closed: as written
            content.append(raw)
            continue
        opening = raw[:len(raw) - len(body)]
        header = head.rsplit("<|channel|>", 1)[1] if "<|channel|>" in head else ""
        words = re.split(r"\s|<\|constrain\|>", header)
        words = [w for w in words if w]
        recipient = [w[3:] for w in re.split(r"\s|<\|channel\|>|<\|constrain\|>", head) if w.startswith("to=")]
        first, _, after = body.partition("<|end|>")
        after = after.replace("<|end|>", "")
        kind = None
        if recipient:
            name = recipient[0][len("functions."):]
            if names is not None and recipient[0].startswith("functions.") and name in names:
                try:
                    args = json.loads(first)
                except ValueError:
                    args = None
                if isinstance(args, dict):
                    calls.append((name, json.dumps(args, ensure_ascii=False)))
                else:
                    content.append(opening + first)
                content.append(after)
                continue
        elif words:
            kind = {"analysis": "reasoning", "final": "content", "commentary": "content"}.get(words[0])
        if kind is None:  # the opening as written, the body without its <|end|> markers
            content.append(opening + body.replace("<|end|>", ""))
        elif kind == "reasoning":
            reasoning.append(("\n" if began else "") + first)
            began = True
            content.append(after)
        else:
            content.append(first + after)
    return ("".join(reasoning) if began else None), "".join(content), calls


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
    from expertcache.llama.reasoning import read_harmony
    from expertcache.llama.toolcalls import call_format

    for text in (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',  # gpt-oss's order
                 '<|channel|>analysis<|message|>Weather?<|end|><|start|>assistant<|channel|>commentary '
                 'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'):
        reasoning, content, (c,) = read_harmony(text, ["get_weather"])
        assert content is None and (c["function"]["name"], json.loads(c["function"]["arguments"])) == \
            ("get_weather", {"city": "Paris"})
        assert read_harmony(text, ["other"])[2] == [] and text.split("<|start|>")[-1] in read_harmony(text, ["other"])[1]
    bad = '<|channel|>commentary to=functions.get_weather<|message|>{"city": '  # cut off: as written
    assert read_harmony(bad, ["get_weather"]) == (None, bad, [])
    assert call_format("<|channel|>x<|message|>{{ 'to=functions.' }}") == "harmony" and call_format("<|channel|>") is None


HARMONY_PIECES = st.lists(st.sampled_from(["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|en", "assistant", "analysis",
                                           "final", "commentary", " to=functions.f", "<|constrain|>", "json", " ",
                                           "<|", "|>", "<|chan", "nel|>", "text", "\n", "é"]), max_size=16)


@st.composite
def harmony_messages(draw) -> str:
    """Messages as gpt-oss writes them (a channel, maybe a recipient and a constraint, a body), the
    bodies drawn from the pieces above (so holding partial markers)."""
    out = []
    for i in range(draw(st.integers(1, 4))):
        to = draw(st.sampled_from(["", "", "", " to=functions.get_weather", " to=functions.nope", " to=browser.search"]))
        before = draw(st.booleans())  # the recipient before the channel (in the role) or after it
        head = (to if before else "") + "<|channel|>" + draw(st.sampled_from(
            ["analysis"] * 3 + ["final"] * 3 + ["commentary", "other", ""])) + ("" if before else to)
        head += draw(st.sampled_from(["", " <|constrain|>json", "<|constrain|>json", " json"]))
        start = "" if i == 0 else "<|start|>" + draw(st.sampled_from(["assistant", ""]))
        body = draw(st.sampled_from(['{"city": "Paris"}', '{"city": 1, "x": [1, 2]}', "[1]", "{", ""]))
        out.append(start + head + "<|message|>" + draw(st.sampled_from([body, body, ""]))
                   + ("".join(draw(HARMONY_PIECES.map(lambda p: p[:3]))) if draw(st.booleans()) else "")
                   + draw(st.sampled_from(["<|end|>", "<|end|>", ""])))
    return "".join(out)


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(HARMONY_PIECES.map("".join), HARMONY_PIECES.map(lambda p: "<|channel|>" + "".join(p)),
                      harmony_messages()), cuts=st.lists(st.integers(0, 300), max_size=8), with_tools=st.booleans())
def test_harmony_whole_agrees_with_the_reference_and_any_pieces_with_the_whole(text, cuts, with_tools):
    from expertcache.llama.reasoning import HarmonyStream, read_harmony, split_harmony

    names = {"get_weather"} if with_tools else None
    reasoning, content, calls = read_harmony(text, names)
    got = (reasoning, content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    want = harmony_reference(text, names)  # the whole's content None where only white space is beside calls
    assert got == (want[0], None if want[2] and not want[1].strip() else want[1], want[2]), text
    if not with_tools:
        assert split_harmony(text) == (reasoning, content)
    bounds = sorted({min(c, len(text)) for c in cuts})
    out = streamed(HarmonyStream(names), text, bounds)
    assert all(x for _, x in out)
    assert ("".join(x for k, x in out if k == "reasoning"), "".join(x for k, x in out if k == "content"),
            [(x["function"]["name"], x["function"]["arguments"]) for k, x in out if k == "call"]) == \
        (want[0] or "", want[1], want[2]), (text, bounds)  # streamed: as written, white space and all
