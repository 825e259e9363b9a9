"""``expertcache.llama.toolcalls``: calls in the Hermes, GLM-4.5, Qwen3-Coder, MiniMax-M2, DeepSeek, Kimi K2,
Mistral, LFM2 and Gemma 4 formats read back into OpenAI's ``tool_calls``.
Reference cases, and the property that a stream fed the text in any pieces gives what the whole
text gives, nothing the model wrote dropped (docs/serve.md, "Tool calls"). The server's use of it is
tested in tests/test_serve.py with a GGUF whose template teaches the format."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.llama.toolcalls import (ALTERNATIVES, DSML, DSV3, DSV4, GEMMA4, GLM, HERMES, KIMI, KIMI_K3, LFM2, MINIMAX,
                                         MINIMAX_M3,
                                         MISTRAL, QWEN_XML, READERS, TAGS, TaggedCalls, call_format,
                                         gemma4_tool_responses, parse_tagged, results_in_call_order)

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
    # Qwen3-Coder's and Qwen3.5's templates: <tool_call> around <function=...> and <parameter=...>
    assert call_format("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k + '>\\n' }}") \
        == QWEN_XML
    # MiniMax-M2's (it writes <think> too) and Kimi K2's
    assert call_format("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}<invoke name=\"...\"><think>") == MINIMAX
    assert call_format("<|tool_calls_section_begin|>{%- for tc in m.tool_calls -%}<|tool_call_begin|>") == KIMI
    assert call_format('{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}') == MISTRAL
    assert call_format('{{- "<|tool_call_start|>[" + (tool_calls | join(", ")) + "]<|tool_call_end|>" -}}') == LFM2
    # DeepSeek-V3.2's spells its tags through a variable
    assert call_format('{%- set dsml_token = "｜DSML｜" -%}<{{ dsml_token }}function_calls>') == DSML
    # DeepSeek-V4's renames the block (llama.cpp's test: no "function_calls" in the template)
    assert call_format('{%- set dsml_token = "｜DSML｜" -%}<{{ dsml_token }}tool_calls>{{ m.tool_calls }}') == DSV4
    assert call_format("{{- '<|tool_call>call:' + function['name'] + '{' -}}") == GEMMA4
    # formats not read here are not read as another's (MiniMax-M3's holds <tool_call>), and are named
    m3 = "{{- ']<]minimax[>[<tool_call>' -}}{{- ']<]minimax[>[<invoke name=\"' }}"
    assert call_format(m3) == MINIMAX_M3 and call_format(m3.replace("<invoke name=", "")) == HERMES
    # Kimi K3's: its three markers (llama.cpp's test), whatever else the template holds
    k3 = "{{ '<|open|>' }}call tool=\"{{ n }}\"<|sep|>{{ '<|close|>' }}<|end_of_msg|><tool_call>"
    assert call_format(k3) == KIMI_K3 and call_format(k3.replace("<|end_of_msg|>", "")) == HERMES
    assert call_format(None) is None and call_format("{{ messages }}") is None
    assert set(READERS) == set(TAGS)  # every tagged format has its reader


PARTS = st.sampled_from(["hello ", "<", "<tool", "<tool_call>", "</tool_call>", "\n", block("f", {"a": 1}),
                         block("get_weather", {"city": "é"}), block("nope", {}), "<tool_call>{x}", "}", "</tool_",
                         "call>", " <think>", "tool_call"])


def blockwise(text: str, pattern: str, calls_of) -> tuple[str, list[dict]]:
    """``text`` read block by block: each match of ``pattern`` (group 1: the block's inside) whose
    ``calls_of(inside)`` is a list is those calls, everything else content."""
    import re

    content, calls, last = [], [], 0
    for m in re.finditer(pattern, text, re.S):
        found = calls_of(m.group(1))
        if found is not None:
            content.append(text[last:m.start()])
            calls += found
            last = m.end()
    content.append(text[last:])
    return "".join(content), calls


def typed(name: str, key: str, value: str):
    """A value written as text, as the GLM and XML formats' readers type it: kept where the tool's
    parameters (:data:`WEATHER` for get_weather) type the key a string, else JSON where it parses."""
    if (WEATHER["properties"].get(key, {}) if name == "get_weather" else {}).get("type") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def reference(text: str) -> tuple[str, list[dict]]:
    """An independent reading by regular expression: each ``<tool_call>...</tool_call>`` (the first
    close after an open) whose inside is a valid call is a call; everything else is content."""
    def calls_of(inside):
        try:
            obj = json.loads(inside)
        except ValueError:
            return None
        if isinstance(obj, dict) and obj.get("name") in NAMES and isinstance(obj.get("arguments"), dict):
            return [{"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}]
        return None
    return blockwise(text, r"<tool_call>(.*?)</tool_call>", calls_of)


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

    def calls_of(inner):
        name = re.match(r"(.*?)(?=<arg_key>|$)", inner, re.S).group(1)
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", inner[len(name):], re.S)
        rest = re.sub(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", "", inner[len(name):], flags=re.S)
        keys = [k.strip() for k, _ in pairs]
        if name.strip() not in dict(GLM_TOOLS) or rest.strip() or len(set(keys)) != len(keys):
            return None
        args = {k.strip(): typed(name.strip(), k.strip(), v) for k, v in pairs}
        return [{"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)}]
    return blockwise(text, r"<tool_call>(.*?)</tool_call>", calls_of)


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

    def calls_of(section):
        items = re.findall(re.escape(CB) + "(.*?)" + re.escape(CE), section, re.S)
        if not items or re.sub(re.escape(CB) + ".*?" + re.escape(CE), "", section, flags=re.S).strip():
            return None
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
                return None
            found.append({"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)})
        return found
    return blockwise(text, re.escape(B) + "(.*?)" + re.escape(E), calls_of)


def qwen_block(calls, frame="\n"):
    """A Qwen3-Coder block of ``calls`` (``(name, [(key, value), ...])``), as its template writes one."""
    return "<tool_call>\n" + "".join(f"<function={name}>\n" + "".join(f"<parameter={k}>{frame}{v}{frame}</parameter>\n"
                                                                       for k, v in pairs) + "</function>\n"
                                     for name, pairs in calls) + "</tool_call>"


def minimax_block(calls):
    return "<minimax:tool_call>\n" + "".join(f'<invoke name="{name}">\n' + "".join(
        f'<parameter name="{k}">{v}</parameter>\n' for k, v in pairs) + "</invoke>\n" for name, pairs in calls) + \
        "</minimax:tool_call>"


DM = "｜DSML｜"


def dsml_block(calls, block="function_calls", space=""):
    """A DeepSeek-V3.2 block of ``calls`` (``(name, [(key, value), ...])``), each value marked a string
    where it is one (typed as GLM's), as its template marks them; V4's block is ``tool_calls``, V4.1's
    `` calls`` with a space before each keyword."""
    def mark(name, k, v):
        return "true" if isinstance(typed(name, k, v), str) else "false"
    return f"<{DM}{block}>\n" + "".join(f'<{DM}{space}invoke name="{name}">\n' + "".join(
        f'<{DM}{space}parameter name="{k}" string="{mark(name, k, v)}">{v}</{DM}{space}parameter>\n' for k, v in pairs)
        + f"</{DM}{space}invoke>\n" for name, pairs in calls) + f"</{DM}{block}>"


def test_deepseek_v4_reference_cases():
    """V4's blocks (``tool_calls``) and V4.1's (`` calls``, spaced keywords) are read for a V4 template,
    in either spelling of the block and of the keywords, as llama.cpp accepts them; neither for V3.2's,
    nor V3.2's block for V4's; a run of results goes in call order."""
    calls = [("get_weather", [("city", "Paris"), ("days", "2")]), ("f", [])]
    want = [("get_weather", {"city": "Paris", "days": 2}), ("f", {})]
    for block, space in (("tool_calls", ""), (" calls", " "), ("tool_calls", " "), (" calls", "")):
        text = dsml_block(calls, block, space)
        content, got = parse_tagged("Sure. " + text, DSV4, GLM_TOOLS)
        assert content == "Sure. " and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] \
            == want, text
        assert parse_tagged(text, DSML, GLM_TOOLS) == (text, [])
    assert parse_tagged(dsml_block(calls), DSV4, GLM_TOOLS)[1] == []
    ask = {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}, {"id": "c"}]}
    msgs = [{"role": "tool", "tool_call_id": "x"}, ask, {"role": "tool", "tool_call_id": "c"},
            {"role": "tool", "tool_call_id": "x"}, {"role": "user", "content": "u"}, {"role": "tool", "tool_call_id": "a"},
            {"role": "assistant", "content": "ok"}, {"role": "tool", "tool_call_id": "b"}, {"role": "tool", "tool_call_id": "a"}]
    assert [m.get("tool_call_id", m.get("content")) for m in results_in_call_order(msgs)] == \
        ["x", None, "x", "a", "u", "c", "ok", "a", "b"]


def test_xml_reference_cases():
    for fmt, make in ((QWEN_XML, qwen_block), (MINIMAX, minimax_block), (DSML, dsml_block)):
        def read(text):
            return parse_tagged(text, fmt, GLM_TOOLS)

        content, (call,) = read("Let me look.\n\n" + make([("get_weather", [("city", "Paris"), ("days", "3")])]))
        assert content == "Let me look.\n\n" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
        # a string keeps its text, one framing newline less at each end (inner lines and spaces kept);
        # others are JSON where they parse
        (call,) = read(make([("get_weather", [("city", "\n 1984\n"), ("tags", '["a", 1]'), ("x", "no json")])]))[1]
        assert json.loads(call["function"]["arguments"]) == \
            {"city": ("\n 1984\n" if fmt == QWEN_XML else " 1984"), "tags": ["a", 1], "x": "no json"}
        content, calls = read(make([("f", []), ("get_weather", [("city", "a")])]) + " done")
        assert content == " done" and [c["function"]["name"] for c in calls] == ["f", "get_weather"]
        for bad in (make([("nope", [])]), make([("get_weather", [("city", "a"), ("city", "b")])]),
                    make([("f", []), ("nope", [])]), make([("f", [])]).replace("</", "<", 1)):
            assert read("a " + bad) == ("a " + bad, []), bad  # the text stays, word for word
    assert parse_tagged(qwen_block([("f", [])]).replace("<function=f>", "<function=f>junk"), QWEN_XML, GLM_TOOLS)[1] == []
    assert parse_tagged('<minimax:tool_call><invoke name="f">x</invoke></minimax:tool_call>', MINIMAX, GLM_TOOLS)[1] == []
    assert parse_tagged(qwen_block([("f", [("a<b", "1")])]), QWEN_XML, GLM_TOOLS)[1] == []  # a key holds no tag
    # DSML's mark, not the schema, says what is a string: a city marked false is JSON, days marked true text
    (call,) = parse_tagged(dsml_block([("get_weather", [("city", "1984")])]).replace('string="false"', 'string="true"')
                           .replace('"city" string="true"', '"city" string="false"') + dsml_block(
        [("get_weather", [("days", "x")])]), DSML, GLM_TOOLS)[1][:1]
    assert json.loads(call["function"]["arguments"]) == {"city": 1984}
    assert parse_tagged(dsml_block([("f", [("a", "1")])]).replace('string="false"', 'string="maybe"'), DSML,
                        GLM_TOOLS)[1] == []


KB, KE, KCB, KCE, KARG = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", \
    "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def kimi_call(name, args, index=0):
    return f"{KCB}functions.{name}:{index}{KARG}{json.dumps(args)}{KCE}"


def test_kimi_reference_cases():
    text = "Checking." + KB + kimi_call("get_weather", {"city": "Paris"}) + "\n" + kimi_call("f", {}, 1) + KE
    content, calls = parse_tagged(text, KIMI, [(n, None) for n in NAMES])
    assert content == "Checking." and [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                                       for c in calls] == [("functions.get_weather:0", "get_weather", {"city": "Paris"}),
                                                           ("functions.f:1", "f", {})]
    for bad in (KB + kimi_call("nope", {}) + KE, KB + kimi_call("f", [1]) + KE, KB + "x" + kimi_call("f", {}) + KE,
                KB + f"{KCB}f:0{KARG}{{}}{KCE}" + KE, KB + f"{KCB}functions.f{KARG}{{}}{KCE}" + KE,
                KB + f"{KCB}functions.f:0{{}}{KCE}" + KE, KB + kimi_call("f", {})):
        assert parse_tagged("a " + bad, KIMI, [(n, None) for n in NAMES]) == ("a " + bad, []), bad


def xml_reference(fmt):
    """An independent reading of Qwen3-Coder's, MiniMax's or DeepSeek-V3.2's (DSML) blocks by regular
    expression (whole calls only, with only white space around them; a key without ``<``; each key
    once; DSML's string mark true or false; a value one framing newline less at each end, typed as
    GLM's, or by DSML's mark)."""
    import re

    opener, closer = TAGS[fmt]
    if fmt == QWEN_XML:
        call_re = r"\s*<function=([^>]*)>((?:\s*<parameter=[^<>]*>(?:(?!</parameter>).)*</parameter>)*)\s*</function>"
        param_re = r"\s*<parameter=([^<>]*)>()((?:(?!</parameter>).)*)</parameter>"
    elif fmt == MINIMAX:
        call_re = (r'\s*<invoke name="((?:(?!">).)*)">((?:\s*<parameter name="(?:(?!">)[^<])*">(?:(?!</parameter>).)*'
                   r'</parameter>)*)\s*</invoke>')
        param_re = r'\s*<parameter name="((?:(?!">)[^<])*)">()((?:(?!</parameter>).)*)</parameter>'
    else:  # DSML, V3.2's and V4's
        param_re = (r'\s*<ⓜparameter name="((?:(?!" string=")[^<])*)" string="((?:(?!">).)*)">((?:(?!</ⓜparameter>).)*)'
                    r'</ⓜparameter>').replace("ⓜ", DM)
        call_re = (r'\s*<ⓜinvoke name="((?:(?!">).)*)">((?:' + param_re.replace("(", "(?:").replace("(?:?", "(?")
                   + r')*)\s*</ⓜinvoke>').replace("ⓜ", DM)

    def calls_of(inner):
        if not re.fullmatch(f"(?:{call_re})+\\s*", inner, re.S):
            return None
        found = []
        for c in re.finditer(call_re, inner, re.S):
            name = c.group(1).strip()
            triples = [(k.strip(), mark, re.sub(r"\n\Z", "", re.sub(r"\A\n", "", v)))
                       for k, mark, v in re.findall(param_re, c.group(2), re.S)]
            if name not in dict(GLM_TOOLS) or len({k for k, _, _ in triples}) != len(triples) or \
                    any(mark not in ("", "true", "false") for _, mark, _ in triples):
                return None
            found.append({"name": name, "arguments": json.dumps(
                {k: (v if mark == "true" else typed("", k, v) if mark == "false" else typed(name, k, v))
                 for k, mark, v in triples}, ensure_ascii=False)})
        return found
    return lambda text: blockwise(text, re.escape(opener) + "(.*?)" + re.escape(closer), calls_of)


def k3_block(calls) -> str:
    """Kimi K3's section of ``calls`` (``(name, [(key, type, value)])``), as its template writes it."""
    return "<|open|>tools<|sep|>" + "".join(
        f'<|open|>call tool="{name}" index="{i + 1}"<|sep|>' + "".join(
            f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
        + "<|close|>call<|sep|>" for i, (name, args) in enumerate(calls)) + "<|close|>tools<|sep|>"


def k3_reference(text):
    """An independent reading of Kimi K3's sections by regular expression: whole calls only, white
    space around them; each key once; a value typed as GLM's where the tool types the key, else by
    its section's ``type`` (``string``: the text; else JSON where it parses)."""
    import re

    arg = (r'<\|open\|>argument key="([^"<]*)"(?: type="([^"<]*)")?[^<]*?<\|sep\|>((?:(?!<\|close\|>argument'
           r'<\|sep\|>).)*)<\|close\|>argument<\|sep\|>')
    call = (r'<\|open\|>call tool="([^"<]*)"[^<]*?<\|sep\|>((?:\s*' + re.sub(r"\((?!\?)", "(?:", arg) +
            r')*)\s*<\|close\|>call<\|sep\|>')

    def calls_of(inner):
        if not re.fullmatch(r"(?:\s*" + call + r")+\s*", inner, re.S):
            return None
        found = []
        for c in re.finditer(call, inner, re.S):
            name = c.group(1).replace("&quot;", '"').replace("&amp;", "&")
            args = [(k.replace("&quot;", '"').replace("&amp;", "&"), t, v) for k, t, v in re.findall(arg, c.group(2), re.S)]
            if name not in dict(GLM_TOOLS) or len({k for k, _, _ in args}) != len(args):
                return None
            schema = WEATHER["properties"] if name == "get_weather" else {}
            found.append({"name": name, "arguments": json.dumps(
                {k: typed(name, k, v) if k in schema else v if t == "string" else typed("", k, v) for k, t, v in args},
                ensure_ascii=False)})
        return found
    return blockwise(text, r"<\|open\|>tools<\|sep\|>(.*?)<\|close\|>tools<\|sep\|>", calls_of)


K3_PARTS = st.sampled_from(["ok ", "<", "<|open|>", "<|close|>", "<|sep|>", "<|open|>tools<|sep|>",
                            "<|close|>tools<|sep|>", '<|open|>call tool="', '" index="1"', "<|close|>call<|sep|>",
                            '<|open|>argument key="', '" type="', "string", "number", "<|close|>argument<|sep|>",
                            "get_weather", "f", "city", "days", "2", '"', "\n", "&quot;", " ",
                            k3_block([("get_weather", [("city", "string", "Paris")])]),
                            k3_block([("get_weather", [("days", "number", "2"), ("city", "string", "\né")]), ("f", [])]),
                            k3_block([("f", [("n", "number", "[1, 2]"), ("s", "string", "12")])]),
                            k3_block([("get_weather", [("city", "string", "a"), ("city", "string", "b")])])])


def test_kimi_k3_reference_cases():
    """llama.cpp's tests of Kimi K3's calls, and the typing of a value."""
    tools = [("special_function", {"type": "object", "properties": {"arg1": {"type": "integer"}}}),
             ("python", {"type": "object", "properties": {"code": {"type": "string"}}}), ("f", None)]
    content, (call,) = parse_tagged("On it." + k3_block([("special_function", [("arg1", "number", "1")])]), KIMI_K3, tools)
    assert content == "On it." and call["function"] == {"name": "special_function", "arguments": '{"arg1": 1}'}
    _, (call,) = parse_tagged(k3_block([("python", [("code", "string", "print('hey')")])]), KIMI_K3, tools)
    assert json.loads(call["function"]["arguments"]) == {"code": "print('hey')"}  # a string's text as written
    _, calls = parse_tagged(k3_block([("f", [("a", "string", "12"), ("b", "number", "12")]), ("f", [])]), KIMI_K3, tools)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": "12", "b": 12}, {}]  # untyped: its type
    bad = k3_block([("nope", [])])
    assert parse_tagged(bad, KIMI_K3, tools) == (bad, [])


NS = "]<]minimax[>["


def m3_block(calls) -> str:
    """MiniMax-M3's block of ``calls`` (``(name, body)``), as its template writes it."""
    return f"{NS}<tool_call>\n" + "".join(f'{NS}<invoke name="{n}">{body}{NS}</invoke>\n' for n, body in calls) + \
        f"{NS}</tool_call>"


def m3(key: str, value: str) -> str:
    """A MiniMax-M3 element."""
    return f"{NS}<{key}>{value}{NS}</{key}>"


def test_minimax_m3_reference_cases():
    """llama.cpp's tests of MiniMax-M3's calls (the schema decides: a text where it may be one, the
    alternatives in order, objects and arrays as elements, other values JSON of their type), and
    what is refused."""
    tools = [("get_time", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
             ("special_function", {"type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]}),
             ("nested_args", {"type": "object", "properties": {
                 "tags": {"type": "array", "items": {"type": "string"}},
                 "entries": {"type": "array", "items": {"type": "object", "properties": {
                     "id": {"type": "integer"}, "label": {"type": "string"}}}}}}),
             ("union_args", {"type": "object", "properties": {"label": {"anyOf": [
                 {"type": "string"}, {"type": "object", "properties": {"text": {"type": "string"}}}]}}}),
             ("complex", {"type": "object", "properties": {"number": {"type": "object", "properties": {
                 "real": {"type": "number"}, "imaginary": {"type": "number"}}}}}),
             ("lim", {"type": "object", "properties": {"limit": {"oneOf": [
                 {"type": "integer"}, {"type": "object", "properties": {"max": {"type": "integer"}}}]},
                 "enabled": {"type": "boolean"}}}),
             ("empty_args", {"type": "object", "properties": {}}), ("free", None)]

    def read(text):
        content, calls = parse_tagged(text, MINIMAX_M3, tools)
        return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]

    assert read(m3_block([("get_time", m3("city", "Tokyo"))])) == (None, [("get_time", {"city": "Tokyo"})])
    assert read("Let me call the function." + m3_block([("special_function", m3("arg1", "1"))])) == \
        ("Let me call the function.", [("special_function", {"arg1": 1})])
    assert read(m3_block([("nested_args", m3("tags", m3("item", "alpha") + m3("item", "beta")) + m3(
        "entries", m3("item", m3("id", "1") + m3("label", "one"))))]))[1] == \
        [("nested_args", {"tags": ["alpha", "beta"], "entries": [{"id": 1, "label": "one"}]})]
    # a union with a string alternative is a string, even when the value looks structured
    assert read(m3_block([("union_args", m3("label", m3("text", "hi")))]))[1] == \
        [("union_args", {"label": m3("text", "hi")})]
    assert read(m3_block([("complex", m3("number", m3("real", "1.5") + m3("imaginary", "-2.5")))]))[1] == \
        [("complex", {"number": {"real": 1.5, "imaginary": -2.5}})]
    assert read(m3_block([("lim", m3("limit", "5") + m3("enabled", "true")), ("lim", m3("limit", m3("max", "10")))]))[1] \
        == [("lim", {"limit": 5, "enabled": True}), ("lim", {"limit": {"max": 10}})]
    assert read(m3_block([("empty_args", "")]))[1] == [("empty_args", {})]
    assert read(m3_block([("free", m3("a", " 1 2 ") + m3("b", "x"))]))[1] == [("free", {"a": " 1 2 ", "b": "x"})]
    for odd in ({"type": {"x": 1}}, {"type": [{"x": 1}]}, {"type": "float"}):  # a client's schema naming no type
        content, calls = parse_tagged(m3_block([("odd", m3("a", "1"))]), MINIMAX_M3,
                                      [("odd", {"type": "object", "properties": {"a": odd}})])
        assert calls == [] and content == m3_block([("odd", m3("a", "1"))])
    for bad in ([("special_function", m3("arg1", "1.5"))], [("special_function", "")],  # not an integer; required
                [("special_function", m3("arg1", "NaN"))], [("get_time", m3("city", "a") + m3("city", "b"))],
                [("get_time", m3("town", "a"))], [("nope", "")], [("get_time", m3("city", "a") + "x")]):
        assert read(m3_block(bad)) == (m3_block(bad), [])


def test_minimax_m3_alternatives_are_bounded():
    """A schema of nested alternatives, each of which reads the whole inside before it fails, would
    take 2^depth tries: the reading stops at its bound (not a call), and the same nesting whose first
    alternative fits is read."""
    def nested(depth, required):
        if depth == 0:
            return {"type": "integer"}
        inner = nested(depth - 1, required)
        return {"anyOf": [{"type": "object", "properties": {"a": inner}, "required": [r]} for r in required]}

    body = m3("v", f"{NS}<a>" * 40 + "1" + f"{NS}</a>" * 40)
    hostile = [("f", {"type": "object", "properties": {"v": nested(40, ["b", "c"])}})]
    assert parse_tagged(m3_block([("f", body)]), MINIMAX_M3, hostile)[1] == []
    fits = [("f", {"type": "object", "properties": {"v": nested(40, ["a", "b"])}})]
    (call,) = parse_tagged(m3_block([("f", body)]), MINIMAX_M3, fits)[1]
    assert call["function"]["arguments"].startswith('{"v": {"a": {"a": ')
    deep = m3("v", f"{NS}<a>" * 70 + "1" + f"{NS}</a>" * 70)  # past M3_DEPTH elements: not a call
    assert parse_tagged(m3_block([("f", deep)]), MINIMAX_M3, [("f", {"type": "object", "properties": {
        "v": nested(70, ["a"])}})])[1] == []


def m3_reference(text):
    """An independent reading of MiniMax-M3's blocks for :data:`GLM_TOOLS`' get_weather (``city`` a
    text, ``days`` an integer; each once) and ``f`` (any key, a text), by regular expression."""
    import re

    ns = re.escape(NS)
    invoke = re.compile(r"\s*" + ns + r'<invoke name="(get_weather|f)">(.*?)' + ns + r"</invoke>", re.S)
    member = re.compile(r"\s*" + ns + r"<([^<>/\s]+)>(.*?)" + ns + r"</\1>", re.S)

    def calls_of(inner):
        found, at = [], 0
        while m := invoke.match(inner, at):
            args, rest = {}, m.group(2)
            while a := member.match(rest):
                key, value, rest = a.group(1), a.group(2), rest[a.end():]
                if key in args or (m.group(1) == "get_weather" and key not in ("city", "days")):
                    return None
                if m.group(1) == "get_weather" and key == "days":
                    if not re.fullmatch(r"[ \t\n\r]*-?(?:0|[1-9][0-9]*)[ \t\n\r]*", value):
                        return None
                    value = int(value)
                args[key] = value
            if rest.strip():
                return None
            found.append({"name": m.group(1), "arguments": json.dumps(args, ensure_ascii=False)})
            at = m.end()
        return found if found and not inner[at:].strip() else None
    return blockwise(text, ns + r"<tool_call>(.*?)" + ns + r"</tool_call>", calls_of)


M3_PARTS = st.sampled_from(["ok ", "<", NS, f"{NS}<tool_call>", f"{NS}</tool_call>", f'{NS}<invoke name="', '">',
                            f"{NS}</invoke>", f"{NS}<city>", f"{NS}</city>", f"{NS}<days>", f"{NS}</days>",
                            "get_weather", "f", "2", "x", "\n", " ",
                            m3_block([("get_weather", m3("city", "Paris"))]),
                            m3_block([("get_weather", m3("days", "2") + m3("city", "\né")), ("f", "")]),
                            m3_block([("f", m3("a", "1") + m3("b", "<b>"))]),
                            m3_block([("get_weather", m3("days", "2.5"))])])


QWEN_PARTS = st.sampled_from(["ok ", "<", "<tool_call>", "</tool_call>", "\n", "<function=", "</function>",
                              "<parameter=", "</parameter>", ">", "get_weather", "city", "2", "[1]", " ",
                              qwen_block([("get_weather", [("city", "Paris")])]),
                              qwen_block([("get_weather", [("days", "2"), ("city", "é")]), ("f", [])], frame=""),
                              qwen_block([("nope", [("a", "1")])]), "<function=f>\n</function>",
                              qwen_block([("get_weather", [("city", "\n\nx\n\n")])])])
MINIMAX_PARTS = st.sampled_from(["ok ", "<", "<minimax:tool_call>", "</minimax:tool_call>", "\n", '<invoke name="',
                                 "</invoke>", '<parameter name="', "</parameter>", '">', "get_weather", "city", "2",
                                 minimax_block([("get_weather", [("city", "Paris")])]),
                                 minimax_block([("get_weather", [("days", "2"), ("city", "\né\n")]), ("f", [])]),
                                 minimax_block([("nope", [("a", "1")])]), '<invoke name="f"></invoke>'])
DSML_PARTS = st.sampled_from(["ok ", "<", f"<{DM}function_calls>", f"</{DM}function_calls>", "\n", f'<{DM}invoke name="',
                              f"</{DM}invoke>", f'<{DM}parameter name="', '" string="', "true", "false", '">',
                              f"</{DM}parameter>", "get_weather", "city", "2",
                              dsml_block([("get_weather", [("city", "Paris")])]),
                              dsml_block([("get_weather", [("days", "2"), ("city", "\né\n")]), ("f", [])]),
                              dsml_block([("nope", [("a", "1")])]), f'<{DM}invoke name="f"></{DM}invoke>'])
DSV4_PARTS = st.sampled_from(["ok ", "<", f"<{DM}tool_calls>", f"</{DM}tool_calls>", "\n", f'<{DM}invoke name="',
                              f"</{DM}invoke>", f'<{DM}parameter name="', '" string="', "true", "false", '">',
                              f"</{DM}parameter>", "get_weather", "city", "2", f"<{DM}function_calls>",
                              dsml_block([("get_weather", [("city", "Paris")])], "tool_calls"),
                              dsml_block([("get_weather", [("days", "2"), ("city", "\né\n")]), ("f", [])], "tool_calls"),
                              dsml_block([("nope", [("a", "1")])], "tool_calls")])
KIMI_PARTS = st.sampled_from(["ok ", KB, KE, KCB, KCE, KARG, "functions.", "f", ":0", "\n", "{}", "<|tool", " ",
                              kimi_call("f", {"a": 1}), kimi_call("get_weather", {"city": "é"}, 7), kimi_call("nope", {}),
                              KB + kimi_call("f", {}) + KE])


def kimi_reference(text: str) -> tuple[str, list]:
    """An independent reading of Kimi K2's call sections by regular expression (the id kept)."""
    import re

    item = re.escape(KCB) + "((?:(?!" + re.escape(KCE) + ").)*)" + re.escape(KCE)

    def calls_of(section):
        if not re.fullmatch(f"(?:\\s*{item})+\\s*", section, re.S):
            return None
        found = []
        for inner in re.findall(item, section, re.S):
            parts = re.fullmatch("((?:(?!" + re.escape(KARG) + ").)*)" + re.escape(KARG) + "(.*)", inner, re.S)
            ident = re.fullmatch(r"\s*functions\.(.+):[0-9]+\s*", parts.group(1), re.S) if parts else None
            try:
                args = json.loads(parts.group(2)) if ident else None
            except ValueError:
                args = None
            if ident is None or ident.group(1) not in NAMES or not isinstance(args, dict):
                return None
            found.append({"name": ident.group(1), "arguments": json.dumps(args, ensure_ascii=False)})
        return found
    return blockwise(text, re.escape(KB) + "(.*?)" + re.escape(KE), calls_of)


MC = "[TOOL_CALLS]"


def mistral_array(calls, ident=None):
    return MC + " " + json.dumps([{"name": n, "arguments": a, **({"id": ident} if ident else {})} for n, a in calls])


def test_mistral_reference_cases():
    tools = [(n, None) for n in NAMES]
    content, calls = parse_tagged("Sure." + mistral_array([("get_weather", {"city": "Paris"}), ("f", {})]), MISTRAL,
                                  tools)
    assert content == "Sure." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris"}), ("f", {})]
    # Mistral's templates take ids of 9 letters and digits only: a model's own such id is kept, else one is made
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert parse_tagged(mistral_array([("f", {})], "a1B2c3D4e"), MISTRAL, tools)[1][0]["id"] == "a1B2c3D4e"
    assert parse_tagged(mistral_array([("f", {})], "call_0"), MISTRAL, tools)[1][0]["id"] != "call_0"
    content, calls = parse_tagged(MC + 'get_weather[ARGS]{"city": "P"}' + MC + "f[ARGS]{}", MISTRAL, tools)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "f"]
    for bad in (mistral_array([("nope", {})]), mistral_array([("f", {}), ("nope", {})]), MC + "[]", MC,
                mistral_array([("f", {})]) + " and more", MC + 'f{"a": 1}', MC + "f[ARGS][1]", MC + MC):
        assert parse_tagged("a " + bad, MISTRAL, tools) == ("a " + bad, []), bad


MISTRAL_PARTS = st.sampled_from(["ok ", MC, " ", "[", "]", "[ARGS]", "get_weather", "f", "{}", '{"city": "é"}', ",",
                                 mistral_array([("f", {"a": 1})]), mistral_array([("get_weather", {"city": "é"}),
                                                                                  ("f", {})]),
                                 mistral_array([("nope", {})]), MC + "f[ARGS]{}", '[{"name": "f", "arguments": {}}]'])


def mistral_reference(text: str) -> tuple[str, list]:
    """An independent reading of Mistral's calls: everything after the first ``[TOOL_CALLS]`` is the
    block, a JSON array of calls or ``NAME[ARGS]ARGUMENTS`` pieces split by ``[TOOL_CALLS]``."""
    import re

    m = re.search(re.escape(MC) + "(.*)", text, re.S)
    if m is None:
        return text, []
    try:
        items = json.loads(m.group(1))
    except ValueError:
        items = None
    if isinstance(items, list):
        pairs = [(x.get("name"), x.get("arguments")) for x in items if isinstance(x, dict)]
        if len(pairs) != len(items):
            pairs = [(None, None)]
    else:
        pieces = [re.fullmatch(r"(.*?)\[ARGS\](.*)", piece, re.S) for piece in re.split(re.escape(MC), m.group(1))]
        pairs = []
        for piece in pieces:
            try:
                pairs.append((piece.group(1).strip(), json.loads(piece.group(2))) if piece else (None, None))
            except ValueError:
                pairs.append((None, None))
    if not pairs or any(name not in NAMES or not isinstance(args, dict) for name, args in pairs):
        return text, []
    return text[:m.start()], [{"name": n, "arguments": json.dumps(a, ensure_ascii=False)} for n, a in pairs]


LS, LE = "<|tool_call_start|>", "<|tool_call_end|>"


def test_lfm2_reference_cases():
    def read(inner, tools=GLM_TOOLS):
        return parse_tagged("Checking. " + LS + inner + LE, LFM2, tools)

    content, calls = read("[get_weather(city='Paris', days=2, tags=(1, 'a')), f()]")
    assert content == "Checking. " and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris", "days": 2, "tags": [1, "a"]}), ("f", {})]
    # LFM2's template writes a mapping as JSON (true, null): read as JSON
    (call,) = read('[f(o={"a": true, "b": null}, n=-1.5, s="x")]')[1]
    assert json.loads(call["function"]["arguments"]) == {"o": {"a": True, "b": None}, "n": -1.5, "s": "x"}
    assert [c["function"]["name"] for c in read('[{"name": "f", "arguments": {}}]')[1]] == ["f"]  # its JSON mode
    # read by Python's parser, never run: nothing but literals; the text stays, word for word
    for bad in ("[f(1)]", "[f(**k)]", "[os.system('ls')]", "[f(a=__import__('os'))]", "[f(a=1, a=2)]", "[f(a={1})]",
                "[f(a=1e999)]", "[f(a={1: 2})]", "[f(a=b'x')]", "f()", "[]", "[nope()]", "[f(), 2]", "[f()][0]",
                "[f(a=1+2)]", "[f(" + "[" * 200 + "]" * 200 + ")]", "[f(a=" + "(" * 5000 + ")]"):
        assert read(bad) == ("Checking. " + LS + bad + LE, []), bad


LFM2_PARTS = st.sampled_from(["ok ", LS, LE, "[", "]", ", ", "f(", "get_weather(", ")", "city='Paris'", "days=2",
                              "tags=(1, 'é')", 'o={"a": true}', "x=null", "2", "nope(", "=", LS + "[f()]" + LE,
                              LS + "[get_weather(city='x'), f(a=[1])]" + LE, LS + '[{"name": "f", "arguments": {}}]' + LE])


class _Recorded(tuple):
    """A call the reference's evaluation recorded: (name, keyword arguments)."""


def lfm2_reference(text: str) -> tuple[str, list]:
    """An independent reading of LFM2's blocks: the inside evaluated by Python with nothing in scope
    but the tools (each recording its call) and JSON's true, false and null, a JSON array of calls
    tried first; valid when it is a list of recorded calls whose arguments JSON holds."""
    def recorder(name):
        return lambda *args, **kw: _Recorded((name, kw)) if not args else None

    def calls_of(inner):
        try:
            items = json.loads(inner)
        except ValueError:
            items = None
        if isinstance(items, list):
            if items and all(isinstance(x, dict) and x.get("name") in dict(GLM_TOOLS) and
                             isinstance(x.get("arguments"), dict) for x in items):
                return [{"name": x["name"], "arguments": json.dumps(x["arguments"], ensure_ascii=False)} for x in items]
            return None
        scope = {name: recorder(name) for name, _ in GLM_TOOLS} | {"true": True, "false": False, "null": None}
        try:
            value = eval(inner.strip(), {"__builtins__": {}}, scope)  # the test's own pieces, nothing in scope
        except Exception:
            return None
        if not (isinstance(value, list) and value and all(isinstance(x, _Recorded) for x in value)):
            return None
        def text_keys(x):
            return all(isinstance(k, str) and text_keys(v) for k, v in x.items()) if isinstance(x, dict) else \
                all(text_keys(v) for v in x) if isinstance(x, (list, tuple)) else True

        out = []
        for name, kw in value:
            if not text_keys(kw):
                return None
            try:
                out.append({"name": name, "arguments": json.dumps(json.loads(json.dumps(kw, allow_nan=False)),
                                                                  ensure_ascii=False)})
            except (TypeError, ValueError):
                return None
        return out
    import re
    return blockwise(text, re.escape(LS) + "(.*?)" + re.escape(LE), calls_of)


GS, GE, GQ = "<|tool_call>", "<tool_call|>", '<|"|>'


def test_auto_without_a_format_read_lists_those_read():
    """``auto`` on a template that teaches no format read here is a 400 that lists the formats read."""
    from types import SimpleNamespace

    pytest.importorskip("fastapi")
    from expertcache.llama.server import ApiError, tool_plan

    body = SimpleNamespace(tools=[SimpleNamespace(function=SimpleNamespace(name="f"))], tool_choice="auto")
    with pytest.raises(ApiError) as exc:
        tool_plan(body, None)
    said = str(exc.value)
    assert "teaches no tool-call format this server reads" in said, said
    assert all(who in said for who in ("Gemma 4's", "M3's", "K3's", "DeepSeek's")), said


def test_a_forced_call_is_written_in_the_format_where_its_grammar_holds_the_tools():
    """``required`` and a named call: in the template's format where :mod:`~expertcache.llama.callgrammar`
    writes it and its grammar holds the tools' parameters; else the arguments alone for one tool,
    and a 400 saying why among several (gpt-oss's only where its channels are read)."""
    from types import SimpleNamespace

    pytest.importorskip("fastapi")
    from expertcache.llama.callgrammar import FORMS
    from expertcache.llama.server import ApiError, tool_plan

    def tool(name, props):
        return SimpleNamespace(function=SimpleNamespace(name=name, parameters={"type": "object", "properties": props}))

    plain, patterned = tool("f", {"a": {"type": "string"}}), tool("g", {"a": {"type": "string", "pattern": "^x$"}})
    plan = tool_plan(SimpleNamespace(tools=[plain, plain], tool_choice="required"), "glm")
    assert plan.parsed and plan.form == "glm" and plan.forced == [plain, plain]
    with pytest.raises(ApiError, match="cannot be held by a grammar"):
        tool_plan(SimpleNamespace(tools=[plain, patterned], tool_choice="required"), "glm")
    plan = tool_plan(SimpleNamespace(tools=[patterned], tool_choice="required"), "glm")
    assert plan.arguments_of is patterned and plan.form is None and not plan.forced
    assert tool_plan(SimpleNamespace(tools=[patterned], tool_choice="required"), "hermes").form == "hermes"
    without = tuple(f for f in FORMS if f != "harmony")
    assert tool_plan(SimpleNamespace(tools=[plain], tool_choice="required"), "harmony", without).arguments_of is plain
    with pytest.raises(ApiError, match="does not force a call"):
        tool_plan(SimpleNamespace(tools=[plain, plain], tool_choice="required"), "harmony", without)
    assert tool_plan(SimpleNamespace(tools=[plain, plain], tool_choice="required"), "kimi-k3").form == "kimi-k3"
    with pytest.raises(ApiError, match="cannot be held by a grammar"):
        tool_plan(SimpleNamespace(tools=[plain, patterned], tool_choice="required"), "kimi-k3")
    assert tool_plan(SimpleNamespace(tools=[plain, patterned], tool_choice="required"), "lfm2").form == "lfm2"
    with pytest.raises(ApiError, match="not a Python name"):  # LFM2's calls are Python's
        tool_plan(SimpleNamespace(tools=[plain, tool("get-time", {})], tool_choice="required"), "lfm2")


def test_gemma4_reference_cases():
    """Gemma 4's calls, as llama.cpp's tests write them: each value type, nested, several calls."""
    def read(text, tools=GLM_TOOLS):
        content, calls = parse_tagged(text, GEMMA4, tools)
        return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]

    assert read(f"{GS}call:get_weather{{city:{GQ}San Francisco{GQ}}}{GE}") == \
        (None, [("get_weather", {"city": "San Francisco"})])
    assert read(f"Hello, world!\nWhat's up?{GS}call:f{{}}{GE}") == ("Hello, world!\nWhat's up?", [("f", {})])
    args = (f"{{n:42,m:-7,x:3.14,e:1.5e10,t:true,u:false,z:null,todos:[{GQ}buy milk{GQ},{GQ}walk dog{GQ}],"
            f"config:{{theme:{GQ}dark{GQ},count:3,empty:{{}}}},none:[],{GQ}3{GQ}:{GQ}a \"raw\" \\ text,\n{GQ}}}")
    assert read(f"{GS}call:f{args}{GE}{GS}call:get_weather{{days: 2}}{GE}")[1] == [
        ("f", {"n": 42, "m": -7, "x": 3.14, "e": 1.5e10, "t": True, "u": False, "z": None,
               "todos": ["buy milk", "walk dog"], "config": {"theme": "dark", "count": 3, "empty": {}}, "none": [],
               "3": 'a "raw" \\ text,\n'}),
        ("get_weather", {"days": 2})]
    # not a call: the text stays, word for word (a bare word, a key twice, a text never closed, a trailing
    # comma, a number JSON cannot hold, JSON's quotes, no name, another name, anything after the object)
    for bad in ("call:f{a:x}", "call:f{a:1,a:2}", f"call:f{{a:{GQ}x}}", "call:f{a:1,}", "call:f{a:[1,]}",
                "call:f{a:1e999}", 'call:f{"a":1}', "call:f{a:01}", "call:{}", "call:nope{}", "call:f{}x",
                "call:f{a:1} {}", "call:f[1]", "f{}", "call:f{a:" + "[" * 70 + "]" * 70 + "}", "call:f {}"):
        assert read(GS + bad + GE) == (GS + bad + GE, []), bad


def test_gemma4_results_go_on_the_call_for_its_first_templates():
    """An assistant message's calls, the tool messages after it and the content-only assistant message
    after those become one message with ``tool_responses`` (names by the calls' order, content as JSON
    where it parses), as llama.cpp's server gives Gemma 4's first templates; other messages as they are."""
    call = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "c0", "content": '{"temp": 15}'},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "[1"},
            {"role": "assistant", "content": "It is 15."}, {"role": "user", "content": "thanks"}]
    assert gemma4_tool_responses(msgs) == [
        msgs[0], {"role": "assistant", "tool_calls": [call, call], "content": "It is 15.", "tool_responses": [
            {"name": "get_weather", "response": {"temp": 15}}, {"name": "get_weather", "response": "sunny"},
            {"name": "c2", "response": "[1"}]}, msgs[-1]]
    assert gemma4_tool_responses(msgs[:2]) == [msgs[0], {"role": "assistant", "tool_calls": [call, call]}]


GEMMA4_PARTS = st.sampled_from(["ok ", GS, GE, GQ, "call:", "f", "get_weather", "{", "}", "[", "]", ",", ":", " ",
                                "\n", "city", "days:2", "x:", "1", "-0.5e3", "true", "null", "nope", "é", '"', "<",
                                "{ ", " }", ", ", ": ", f"{GS}call:f{{}}{GE}", f"{GS}call:f{{ x :\n[ 1 , {{ }} ] }}{GE}",
                                f"{GS}call:get_weather{{city:{GQ}a, b{GQ},days:[1,{{}}]}}{GE}"])


def gemma4_reference(text: str) -> tuple[str, list]:
    """An independent reading of Gemma 4's blocks: the inside ``call:NAME{...}`` cut into tokens by one
    regular expression, translated to JSON text (a marked text a JSON string, a word before a colon a
    key), parsed by ``json`` with no key twice and finite numbers only."""
    import math
    import re

    token = re.compile(r'<\|"\|>(.*?)<\|"\|>|([{}\[\],:])|([ \t\n\r]+)|([^ \t\n\r:{}\[\],"<]+)', re.S)
    scalar = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null")

    def no_twice(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("a key twice")
        return dict(pairs)

    def finite(s):
        if not math.isfinite(float(s)):
            raise ValueError("not finite")
        return float(s)

    def calls_of(inside):
        m = re.fullmatch(r"\s*call:([^{]*)(\{.*)", inside, re.S)
        if m is None or m.group(1) not in dict(GLM_TOOLS):
            return None
        args = m.group(2).rstrip()
        toks, at = [], 0
        while at < len(args):
            t = token.match(args, at)
            if t is None:
                return None
            toks.append(t)
            at = t.end()
        out = []
        for i, t in enumerate(toks):
            after = next((u for u in toks[i + 1:] if u.group(3) is None), None)
            keyed = after is not None and after.group(2) == ":"
            if t.group(4) is not None:
                if not keyed and not scalar.fullmatch(t.group(4)):
                    return None
                out.append(json.dumps(t.group(4)) if keyed else t.group(4))
            elif t.group(2) is None and t.group(3) is None:
                out.append(json.dumps(t.group(1)))
            else:
                out.append(t.group())
        try:
            value = json.loads("".join(out), object_pairs_hook=no_twice, parse_float=finite)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        return [{"name": m.group(1), "arguments": json.dumps(value, ensure_ascii=False)}]
    return blockwise(text, re.escape(GS) + "(.*?)" + re.escape(GE), calls_of)


CASES = {HERMES: (PARTS, [(n, None) for n in NAMES], reference), GLM: (GLM_PARTS, GLM_TOOLS, glm_reference),
         DSV3: (DS_PARTS, [(n, None) for n in NAMES], deepseek_reference),
         QWEN_XML: (QWEN_PARTS, GLM_TOOLS, xml_reference(QWEN_XML)), MINIMAX: (MINIMAX_PARTS, GLM_TOOLS,
                                                                               xml_reference(MINIMAX)),
         DSML: (DSML_PARTS, GLM_TOOLS, xml_reference(DSML)), DSV4: (DSV4_PARTS, GLM_TOOLS, xml_reference(DSV4)),
         KIMI: (KIMI_PARTS, [(n, None) for n in NAMES], kimi_reference), KIMI_K3: (K3_PARTS, GLM_TOOLS, k3_reference),
         MINIMAX_M3: (M3_PARTS, GLM_TOOLS, m3_reference),
         MISTRAL: (MISTRAL_PARTS, [(n, None) for n in NAMES], mistral_reference),
         LFM2: (LFM2_PARTS, GLM_TOOLS, lfm2_reference), GEMMA4: (GEMMA4_PARTS, GLM_TOOLS, gemma4_reference)}
"""Per format: the pieces its texts are drawn from, the tools, an independent reading."""
ENDINGS = {MISTRAL: st.sampled_from(["", "", mistral_array([("f", {})]), mistral_array([("get_weather", {"days": 2})]),
                                     MC + "f[ARGS]{}" + MC + 'get_weather[ARGS]{"city": "x"}'])}
"""Per format whose calls run to the end of the text: what a text may end with, so that a third of
them end in a block of valid calls."""


@pytest.mark.parametrize("fmt", CASES)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_split_of_the_text_gives_what_an_independent_reading_gives(fmt, data):
    pieces, tools, independent = CASES[fmt]
    text = "".join(data.draw(st.lists(pieces, max_size=8), label="parts")) + data.draw(ENDINGS.get(fmt, st.just("")))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6), label="cuts"))
    events = streamed(TaggedCalls(fmt, tools), text, cuts)
    want_content, want_calls = independent(text)
    assert "".join(x for k, x in events if k == "content") == want_content  # nothing dropped, nothing added
    assert [x["function"] for k, x in events if k == "call"] == want_calls
    whole_content, whole_calls = parse_tagged(text, fmt, tools)
    assert [c["function"] for c in whole_calls] == want_calls
    assert whole_content == (None if want_calls and not want_content.strip() else want_content)


MARKS = sorted({m for fmt in TAGS for m in TAGS[fmt] if m} | {m for pairs in ALTERNATIVES.values() for p in pairs
                                                             for m in p} | {"<function=", "<parameter=", "[ARGS]", "<arg_key>",
                                                              '" string="', '">', "functions.f:0", "\n", GQ, "call:f{"})


@pytest.mark.parametrize("fmt", sorted(TAGS))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_text_is_read_without_an_error_and_nothing_is_lost_but_calls(fmt, data):
    """Every reader on any text (any characters, any of every format's tags among them), in any
    pieces: no exception, and the content with the calls' blocks is the text (a reader that reads
    no call gives the text back word for word)."""
    text = "".join(data.draw(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(MARKS)), max_size=12)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    events = streamed(TaggedCalls(fmt, GLM_TOOLS), text, cuts)
    content = "".join(x for k, x in events if k == "content")
    if not any(k == "call" for k, _ in events):
        assert content == text
    else:
        assert len(content) < len(text)
