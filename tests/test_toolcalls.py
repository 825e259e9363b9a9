"""``expertcache.llama.toolcalls``: calls in the Hermes and GLM-4.5 formats read back into OpenAI's ``tool_calls``.
Reference cases, and the property that a stream fed the text in any pieces gives what the whole
text gives, nothing the model wrote dropped (docs/serve.md, "Tool calls"). The server's use of it is
tested in tests/test_serve.py with a GGUF whose template teaches the format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.llama.toolcalls import DSV3, GLM, HERMES, TaggedCalls, call_format, parse_tagged

NAMES = ("get_weather", "f")
def parse_hermes(text, names):
    return parse_tagged(text, HERMES, [(n, None) for n in names])


def block(name, args, pad="\n"):
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args})}{pad}</tool_call>"


def streamed(stream, text: str, cuts: list[int]) -> list:
    """What ``stream`` gives for ``text`` fed in the pieces ``cuts`` (sorted offsets) make, then finished."""
    events = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        events += stream.feed(text[a:b])
    return events + stream.finish()


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
    assert call_format("<tool_call>{{ name }}<arg_key>k</arg_key>") == GLM  # GLM-4.5: not JSON
    assert call_format("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>'}}") == DSV3
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


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "tags": {"type": "array"}}}
GLM_TOOLS = [("get_weather", WEATHER), ("f", None)]


def glm_block(name, pairs, sep="\n"):
    return "<tool_call>" + name + sep + "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}"
                                               for k, v in pairs) + "</tool_call>"


def test_glm_reference_cases():
    def read(text):
        return parse_tagged(text, GLM, GLM_TOOLS)

    content, (call,) = read("Let me look." + glm_block("get_weather", [("city", "Paris"), ("days", "3")]))
    assert content == "Let me look." and json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    # a string parameter keeps its text as written (a number-looking city too); others are JSON where they parse
    (call,) = read(glm_block("get_weather", [("city", "1984"), ("tags", '["a", 1]'), ("x", "not json")]))[1]
    assert json.loads(call["function"]["arguments"]) == {"city": "1984", "tags": ["a", 1], "x": "not json"}
    assert json.loads(read(glm_block("f", [], sep=""))[1][0]["function"]["arguments"]) == {}
    for bad in (glm_block("nope", []), glm_block("get_weather", [("city", "a"), ("city", "b")]),
                "<tool_call>get_weather<arg_key>city</arg_key>stray</tool_call>",
                "<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</arg_value>junk</tool_call>"):
        assert read("a " + bad) == ("a " + bad, []), bad  # the text stays, word for word


GLM_PARTS = st.sampled_from(["ok ", "<", "<tool_call>", "</tool_call>", "\n", "<arg_key>", "</arg_key>", "<arg_value>",
                             "</arg_value>", glm_block("get_weather", [("city", "Paris")]),
                             glm_block("get_weather", [("days", "2"), ("city", "é")], sep=""), glm_block("f", []),
                             glm_block("nope", [("a", "1")]), "get_weather", "city", "2", "{"])


def glm_reference(text: str) -> tuple[str, list]:
    """An independent reading of GLM blocks by regular expression (the name, then whole key-value
    pairs only, each key once; a value typed string kept, else JSON where it parses)."""
    import re

    content, calls, last = [], [], 0
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S):
        inner = m.group(1)
        name = re.match(r"(.*?)(?=<arg_key>|$)", inner, re.S).group(1)
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", inner[len(name):], re.S)
        rest = re.sub(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", "", inner[len(name):], flags=re.S)
        keys = [k.strip() for k, _ in pairs]
        if name.strip() not in dict(GLM_TOOLS) or rest.strip() or len(set(keys)) != len(keys):
            continue
        args = {}
        for k, v in pairs:
            k = k.strip()
            if (WEATHER["properties"].get(k, {}) if name.strip() == "get_weather" else {}).get("type") == "string":
                args[k] = v
                continue
            try:
                args[k] = json.loads(v)
            except ValueError:
                args[k] = v
        content.append(text[last:m.start()])
        calls.append({"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)})
        last = m.end()
    content.append(text[last:])
    return "".join(content), calls


B, E, CB, CE, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name, args, v31=False):
    if v31:
        return f"{CB}{name}{SEP}{json.dumps(args)}{CE}"
    return f"{CB}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CE}"


def test_deepseek_reference_cases():
    for v31 in (False, True):
        text = "Checking." + B + ds_call("get_weather", {"city": "Paris"}, v31) + "\n" + ds_call("f", {}, v31) + E
        content, calls = parse_tagged(text, DSV3, [(n, None) for n in NAMES])
        assert content == "Checking." and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                           for c in calls] == [("get_weather", {"city": "Paris"}), ("f", {})]
    for bad in (B + ds_call("nope", {}) + E, B + ds_call("f", [1]) + E, B + "junk" + ds_call("f", {}) + E,
                B + CB + "f" + CE + E, B + ds_call("f", {}) + ds_call("nope", {}, True) + E, B + ds_call("f", {})):
        assert parse_tagged("a " + bad, DSV3, [(n, None) for n in NAMES]) == ("a " + bad, []), bad


DS_PARTS = st.sampled_from(["ok ", B, E, CB, CE, SEP, "function", "\n", "```json\n{}\n```", "<｜tool", "▁calls",
                            ds_call("f", {"a": 1}), ds_call("get_weather", {"city": "é"}, True), ds_call("nope", {}),
                            B + ds_call("f", {}) + E, "{}", " "])


def deepseek_reference(text: str) -> tuple[str, list]:
    """An independent reading of DeepSeek's call sections by regular expression."""
    import re

    content, calls, last = [], [], 0
    for m in re.finditer(re.escape(B) + "(.*?)" + re.escape(E), text, re.S):
        items = re.findall(re.escape(CB) + "(.*?)" + re.escape(CE), m.group(1), re.S)
        if not items or re.sub(re.escape(CB) + ".*?" + re.escape(CE), "", m.group(1), flags=re.S).strip():
            continue
        found = []
        for inner in items:
            v3 = re.fullmatch(r"\s*function\s*" + re.escape(SEP) + r"([^\n]*)\n\s*```json\n(.*)\n```\s*", inner, re.S)
            v31 = re.fullmatch("(.*?)" + re.escape(SEP) + "(.*)", inner, re.S)
            name, args = (v3.group(1), v3.group(2)) if v3 else (v31.group(1), v31.group(2)) if v31 and \
                v31.group(1).strip() != "function" else (None, None)
            try:
                args = json.loads(args) if args is not None else None
            except ValueError:
                args = None
            if name is None or name.strip() not in NAMES or not isinstance(args, dict):
                break
            found.append({"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)})
        else:
            content.append(text[last:m.start()])
            calls += found
            last = m.end()
    content.append(text[last:])
    return "".join(content), calls


CASES = {HERMES: (PARTS, [(n, None) for n in NAMES], reference), GLM: (GLM_PARTS, GLM_TOOLS, glm_reference),
         DSV3: (DS_PARTS, [(n, None) for n in NAMES], deepseek_reference)}
"""Per format: the pieces its texts are drawn from, the tools, an independent reading."""


@pytest.mark.parametrize("fmt", CASES)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_split_of_the_text_gives_what_an_independent_reading_gives(fmt, data):
    pieces, tools, independent = CASES[fmt]
    text = "".join(data.draw(st.lists(pieces, max_size=8), label="parts"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6), label="cuts"))
    events = streamed(TaggedCalls(fmt, tools), text, cuts)
    want_content, want_calls = independent(text)
    assert "".join(x for k, x in events if k == "content") == want_content  # nothing dropped, nothing added
    assert [x["function"] for k, x in events if k == "call"] == want_calls
    whole_content, whole_calls = parse_tagged(text, fmt, tools)
    assert [c["function"] for c in whole_calls] == want_calls
    assert whole_content == (None if want_calls and not want_content.strip() else want_content)
