"""``expertcache.llama.toolcalls``: calls in the Hermes format read back into OpenAI's ``tool_calls``.
Reference cases, and the property that a stream fed the text in any pieces gives what the whole
text gives, nothing the model wrote dropped (docs/serve.md, "Tool calls"). The server's use of it is
tested in tests/test_serve.py with a GGUF whose template teaches the format."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.llama.toolcalls import HERMES, HermesStream, call_format, parse_hermes

NAMES = ("get_weather", "f")


def block(name, args, pad="\n"):
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args})}{pad}</tool_call>"


def test_reference_cases():
    content, calls = parse_hermes(block("get_weather", {"city": "Paris"}), NAMES)
    assert content is None and len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_")
    text = "<think>\nok\n</think>\n\n" + block("f", {}) + "\n" + block("get_weather", {"days": 2})
    content, calls = parse_hermes(text, NAMES)
    assert content == "<think>\nok\n</think>\n\n\n" and [c["function"]["name"] for c in calls] == ["f", "get_weather"]
    for bad in [block("nope", {}), "<tool_call>{not json}</tool_call>", block("f", [1]),
                '<tool_call>{"name": "f"}</tool_call>', "<tool_call>" + '{"name": "f", "arguments": {}}']:
        assert parse_hermes("a " + bad, NAMES) == ("a " + bad, []), bad  # the text stays, word for word
    assert parse_hermes("plain <tool_ answer <", NAMES) == ("plain <tool_ answer <", [])


def test_the_format_is_told_by_the_template():
    assert call_format("... <tool_call>\n{\"name\": ...} ...") == HERMES
    assert call_format("<tool_call>{{ name }}<arg_key>k</arg_key>") is None  # GLM-4.5: not JSON
    assert call_format(None) is None and call_format("{{ messages }}") is None


PARTS = st.sampled_from(["hello ", "<", "<tool", "<tool_call>", "</tool_call>", "\n", block("f", {"a": 1}),
                         block("get_weather", {"city": "é"}), block("nope", {}), "<tool_call>{x}", "}", "</tool_",
                         "call>", " <think>", "tool_call"])


def reference(text: str) -> tuple[str, list[dict]]:
    """An independent reading by regular expression: each ``<tool_call>...</tool_call>`` (the first
    close after an open) whose inside is a valid call is a call; everything else is content."""
    import re

    content, calls, last = [], [], 0
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name") in NAMES and isinstance(obj.get("arguments"), dict):
            content.append(text[last:m.start()])
            calls.append({"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)})
            last = m.end()
    content.append(text[last:])
    return "".join(content), calls


@settings(max_examples=400, deadline=None)
@given(st.lists(PARTS, max_size=8), st.data())
def test_any_split_of_the_text_gives_what_an_independent_reading_gives(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6), label="cuts"))
    stream, events = HermesStream(NAMES), []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        events += stream.feed(text[a:b])
    events += stream.finish()
    want_content, want_calls = reference(text)
    assert "".join(x for k, x in events if k == "content") == want_content  # nothing dropped, nothing added
    assert [x["function"] for k, x in events if k == "call"] == want_calls
    whole_content, whole_calls = parse_hermes(text, NAMES)
    assert [c["function"] for c in whole_calls] == want_calls
    assert whole_content == (None if want_calls and not want_content.strip() else want_content)
