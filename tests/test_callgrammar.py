"""``expertcache.llama.callgrammar`` (docs/serve.md, "Tool calls"): a forced call's grammar in the
model's own format. Two independent sides must agree: what llama.cpp's grammar sampler lets the
model write (small-moe sampled hot, many seeds) is read back by the format's reader
(:mod:`expertcache.llama.toolcalls`, gpt-oss's :class:`~expertcache.llama.reasoning.HarmonyStream`)
as one call to one of the tools, its arguments valid under the tool's parameters (checked here by
a small validator of the keywords used). The text rule (:func:`~expertcache.llama.callgrammar.until`)
is checked against the plain predicate by a small interpreter of the rules it writes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import small_moe_gguf

pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")
from expertcache.llama.callgrammar import (  # noqa: E402
    FORMS, MAX_TEXT_REPEAT, SPELLINGS, Thinking, call_grammar, call_grammar_text, literal, until, writes)
from expertcache.llama.reasoning import read_harmony, split_reasoning  # noqa: E402
from expertcache.llama.toolcalls import (  # noqa: E402
    DSML, DSV3, DSV4, ENDS_THINKING, GEMMA4, GLM, HARMONY, HERMES, KIMI, KIMI_K3, LFM2, MINIMAX, MINIMAX_M3, MISTRAL,
    QWEN_XML, parse_tagged)

TOOLS = [
    ("get_weather", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["C", "F"]},
        "hourly": {"type": "boolean"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "zone": {"type": ["string", "null"]}},
        "required": ["city", "units"]}),
    ("get_time", {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]},
                                                   "code": {"type": "string", "minLength": 2, "maxLength": 4}},
                  "required": ["zone", "code"]}),
    ("write", {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
    ("ping", None),
]
"""Tools whose parameters hold each kind of value a keyed format writes: texts raw (bounded, an
enum, unbounded), JSON of other types (an integer, a boolean, an object, an array, a type list),
optional members, and a tool with no parameters."""

TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None), "object": dict,
         "array": list}


def valid(value, schema) -> bool:
    """``value`` keeps to ``schema`` (the keywords :data:`TOOLS` uses)."""
    if schema is None:
        schema = {"type": "object", "properties": {}}
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(isinstance(value, TYPES[k]) and not (k in ("integer", "number") and isinstance(value, bool))
                   for k in kinds):
            return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30):
        return False
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", 1 << 30) or not all(valid(v, schema.get("items", {})) for v in value):
            return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if not set(schema.get("required", [])) <= set(value) or not set(value) <= set(props):
            return False
        return all(valid(v, props[k]) for k, v in value.items())
    return True


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """small-moe, converted: a model to sample under the grammars."""
    import llama_cpp

    return llama_cpp.Llama(str(small_moe_gguf(tmp_path_factory, "callgrammar")), n_ctx=1024, verbose=False)


def read(fmt: str, text: str, tools) -> tuple[str | None, list[dict]]:
    """The content and calls of ``text`` as the server reads a format's calls (Kimi K3's: its answer
    section's tags taken out of the content first, by its reasoning reader)."""
    if fmt == HARMONY:
        _, content, calls = read_harmony(text, [name for name, _ in tools])
        return content, calls
    if fmt == KIMI_K3:
        reasoning, text = split_reasoning(text, False, fmt, ENDS_THINKING[fmt])
        assert reasoning is None, text
    return parse_tagged(text, fmt, tools)


SAMPLED = [t for t in TOOLS if t[0] != "write"]
"""The tools sampled: a text written raw without a bound is seldom closed by a random model (it
must write the close, letter by letter); :func:`test_llama_cpp_takes_exactly_the_calls_the_reader_reads`
holds it to its grammar."""


@pytest.mark.parametrize("fmt", FORMS)
def test_what_the_grammar_lets_through_is_read_back_as_a_valid_call(small, fmt):
    """Sampled hot under each format's grammar, every text the grammar completed is one call to one
    of the tools, nothing else, its arguments valid under the tool's parameters; each tool forced
    alone (a named call) is called, two of them forced among all (``required``), and every spelling
    of the format written (seeds on until each has, at most 16)."""
    import json

    schemas, texts = dict(TOOLS), []
    for tools in [SAMPLED] + [[t] for t in SAMPLED]:
        assert writes(fmt, tools)
        grammar = call_grammar(fmt, tools, small._model.vocab)
        called = set()
        for seed in range(16):
            out = small.create_completion("Weather in Paris?", grammar=grammar, temperature=1.0, seed=seed,
                                          max_tokens=400)["choices"][0]
            if out["finish_reason"] != "stop":  # cut by max_tokens: no call yet
                continue
            content, calls = read(fmt, out["text"], tools)
            assert content is None and len(calls) == 1, out["text"]
            name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
            assert valid(args, schemas[name]), (out["text"], args)
            called.add(name)
            texts.append(split_reasoning(out["text"], False, KIMI_K3)[1] if fmt == KIMI_K3 else out["text"])
            if len(called) == min(len(tools), 2):
                break
        assert len(called) == min(len(tools), 2), (called, tools)
    for spelling in SPELLINGS.get(fmt, ()):  # DeepSeek-V4's and V4.1's both
        assert any(t.startswith(spelling[0]) for t in texts), (spelling[0], texts)


@pytest.mark.parametrize("fmt", [f for f in FORMS if f != HARMONY])
def test_what_a_parallel_grammar_lets_through_is_read_back_as_valid_calls(small, fmt):
    """With ``parallel``, sampled hot (the end of the turn favoured, so that a random model ends
    some), every text the grammar completed is one call or more, each to one of the tools, its
    arguments valid under the tool's parameters, nothing else. (Whether a second call is reached here
    depends on the random model: :func:`test_a_parallel_grammar_takes_the_calls_of_a_turn_as_its_template_writes_them`
    holds every format's to the text its template writes.)"""
    import json

    schemas = dict(TOOLS)
    grammar = call_grammar(fmt, SAMPLED, small._model.vocab, parallel=True)
    completed = 0
    for seed in range(8):
        out = small.create_completion("Weather in Paris?", grammar=grammar, temperature=1.0, seed=seed, max_tokens=300,
                                      logit_bias={small.token_eos(): 6.0})["choices"][0]
        if out["finish_reason"] != "stop":  # cut by max_tokens
            continue
        content, calls = read(fmt, out["text"], SAMPLED)
        assert content is None and calls, out["text"]
        for call in calls:
            assert valid(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]]), out["text"]
        completed += 1
    assert completed


TURN = [("get_time", '"zone": "UTC", "code": "ab"'), ("ping", "")]
"""The two calls of :data:`PARALLEL`'s turns, the first's arguments as JSON's members."""
PARALLEL = {
    HERMES: '<tool_call>\n{"name": "get_time", "arguments": {%s}}\n</tool_call>\n<tool_call>\n{"name": "ping", '
            '"arguments": {%s}}\n</tool_call>',
    GLM: "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n<arg_key>code</arg_key>\n"
         "<arg_value>ab</arg_value>\n</tool_call>\n<tool_call>ping\n</tool_call>",
    QWEN_XML: "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n<parameter=code>\nab\n"
              "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>",
    MINIMAX: '<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="zone">UTC</parameter>\n<parameter '
             'name="code">ab</parameter>\n</invoke>\n<invoke name="ping">\n</invoke>\n</minimax:tool_call>',
    DSML: '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">UTC'
          '</｜DSML｜parameter>\n<｜DSML｜parameter name="code" string="true">ab</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
          '<｜DSML｜invoke name="ping">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    DSV3: '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{%s}\n```'
          '<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ping\n```json\n{%s}\n```<｜tool▁call▁end｜>'
          '<｜tool▁calls▁end｜>',
    KIMI: "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{%s}"
          "<|tool_call_end|><|tool_call_begin|>functions.ping:1<|tool_call_argument_begin|>{%s}<|tool_call_end|>"
          "<|tool_calls_section_end|>",
    MISTRAL: '[TOOL_CALLS] [{"name": "get_time", "arguments": {%s}}, {"name": "ping", "arguments": {%s}}]',
    "mistral-later": "[TOOL_CALLS]get_time[ARGS]{%s}[TOOL_CALLS]ping[ARGS]{%s}",
    GEMMA4: '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>,code:<|"|>ab<|"|>}<tool_call|><|tool_call>call:ping{}'
            '<tool_call|>',
    MINIMAX_M3: ']<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="get_time">]<]minimax[>[<zone>UTC]<]minimax[>['
                '</zone>]<]minimax[>[<code>ab]<]minimax[>[</code>]<]minimax[>[</invoke>\n]<]minimax[>[<invoke name="ping">'
                ']<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>',
    LFM2: '<|tool_call_start|>[get_time(zone="UTC", code="ab"), ping()]<|tool_call_end|>',
    KIMI_K3: '<|open|>tools<|sep|><|open|>call tool="get_time" index="1"<|sep|><|open|>argument key="zone" '
             'type="string"<|sep|>UTC<|close|>argument<|sep|><|open|>argument key="code" type="string"<|sep|>ab'
             '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="ping" index="2"<|sep|><|close|>call<|sep|>'
             '<|close|>tools<|sep|>',
}
"""A turn of two calls (get_time, then ping) as each format's template writes it (the fixtures of
``tests/test_serve.py`` rendered with them; Mistral's later spelling as its tokenizers write it)."""
PARALLEL[DSV4] = PARALLEL[DSML].replace("function_calls", "tool_calls")


@pytest.mark.parametrize("spelling", sorted(PARALLEL))
def test_a_parallel_grammar_takes_the_calls_of_a_turn_as_its_template_writes_them(small, spelling):
    """A turn of two calls, as the format's template writes it: taken by the grammar of one call or
    more (``parallel``), refused by the grammar of one, read back as the two calls. Kimi K3's calls
    are numbered from 1 (a second call numbered 1 is refused)."""
    import json

    fmt = MISTRAL if spelling == "mistral-later" else spelling
    tools = [t for t in TOOLS if t[0] in ("get_time", "ping")]
    text = PARALLEL[spelling] % tuple(args for _, args in TURN) if "%s" in PARALLEL[spelling] else PARALLEL[spelling]
    assert grammar_accepts(small, call_grammar_text(fmt, tools, parallel=True), text), text
    assert not grammar_accepts(small, call_grammar_text(fmt, tools), text)
    content, calls = read(fmt, text, tools)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(name, json.loads("{%s}" % args)) for name, args in TURN]
    if fmt == KIMI_K3:
        third = '<|open|>call tool="ping" index="3"<|sep|><|close|>call<|sep|>'
        assert grammar_accepts(small, call_grammar_text(fmt, tools, True), text.replace(
            "<|close|>tools", third + "<|close|>tools"))
        assert not grammar_accepts(small, call_grammar_text(fmt, tools, True), text.replace('index="2"', 'index="1"'))


def test_gpt_oss_writes_one_call_either_way():
    """gpt-oss's call ends the decode (``<|call|>``): its grammar is of one call with ``parallel`` too."""
    assert call_grammar_text(HARMONY, TOOLS[1:], parallel=True) == call_grammar_text(HARMONY, TOOLS[1:])


def test_each_tool_is_forced_alone_and_the_reader_needs_the_tools_keys():
    """A named call's grammar names that tool only; a text value's closes and framing per format."""
    for fmt in FORMS[1:]:
        text = call_grammar_text(fmt, TOOLS[1:2])
        assert "get_time" in text and "get_weather" not in text and "ping" not in text
    qwen = call_grammar_text(QWEN_XML, TOOLS[:1])
    assert '"<parameter=city>\\n" [^\\x3C]{0,12} "\\n</parameter>\\n"' in qwen  # framed: new lines allowed inside
    minimax = call_grammar_text(MINIMAX, TOOLS[:1])
    assert '"<parameter name=\\"city\\">" [^\\x3C\\x0A]{0,12} "</parameter>\\n"' in minimax  # unframed: none
    glm = call_grammar_text(GLM, TOOLS[:1])
    assert '"<arg_key>units</arg_key>\\n<arg_value>" ("C" | "F") "</arg_value>\\n"' in glm
    assert '("<arg_key>days</arg_key>\\n<arg_value>" json-' in glm  # optional, JSON
    dsml = call_grammar_text(DSML, TOOLS[:1])
    assert 'string=\\"false\\">" json-' in dsml and 'name=\\"city\\" string=\\"true\\">" [^\\x3C\\x0A]{0,12}' in dsml


def test_writes_reference_cases():
    """Where a grammar can hold the tools: JSON-argument formats wherever the schema is one a
    ``response_format`` may give; keyed formats (and Gemma 4's, MiniMax-M3's) not for a text with a pattern or a
    format, a length over the bound, an enum text holding its close, a key or name a reader cuts,
    parameters that are not an object of named properties."""
    def one(props, name="f"):
        return [(name, {"type": "object", "properties": props})]

    pattern = one({"a": {"type": "string", "pattern": "^x$"}})
    assert not writes(GLM, pattern) and not writes(DSML, pattern)
    assert all(writes(fmt, pattern) for fmt in FORMS if fmt not in SPELLINGS and fmt not in (GEMMA4, MINIMAX_M3))
    assert not writes(GEMMA4, pattern) and not writes(MINIMAX_M3, pattern)
    assert not writes(QWEN_XML, one({"a": {"type": "string", "format": "date"}}))
    assert writes(QWEN_XML, one({"a": {"type": "string", "maxLength": MAX_TEXT_REPEAT}}))
    assert not writes(QWEN_XML, one({"a": {"type": "string", "maxLength": MAX_TEXT_REPEAT + 1}}))
    assert not writes(QWEN_XML, one({"a": {"type": "string", "enum": ["x</parameter>"]}}))
    assert not writes(GLM, one({"a": {"type": "string", "enum": ["x</tool_call>"]}}))
    assert writes(GLM, one({"a": {"type": "string", "enum": ["x</parameter>", "y"]}}))
    assert not writes(QWEN_XML, one({"a": {"type": "string", "enum": ["\ny"]}}))  # as a response_format's: refused
    assert not writes(GLM, one({"a": {"type": "string", "enum": ["x"], "minLength": 3}}))  # a keyword not held
    assert not writes(QWEN_XML, one({"a<b": {"type": "integer"}}))
    assert not writes(MINIMAX, one({'a"': {"type": "integer"}}))
    assert not writes(DSML, one({" a": {"type": "integer"}}))
    assert not writes(DSV4, [("f", {"anyOf": [{"type": "object"}]})])
    assert not writes(DSV4, [("f", {"type": "object", "properties": {"a": {}}, "required": ["b"]})])
    assert writes(DSV4, [("f", {"type": "object"})]) and writes(DSV4, [("f", None)])
    assert writes(LFM2, one({})) and not writes(None, one({}))
    assert writes(LFM2, one({"city": {"type": "string", "pattern": "^x$"}, "days": {"type": "integer"}}))
    for props, name in (({"a-b": {}}, "f"), ({"class": {}}, "f"), ({"a": {}}, "get-time"), ({"a": {}}, "None")):
        assert not writes(LFM2, one(props, name)), (props, name)  # not Python names
    for bounds in ({"minLength": -1}, {"minLength": 3, "maxLength": 2}, {"maxLength": 2.5}, {"maxLength": True}):
        assert not writes(GLM, one({"a": {"type": "string", **bounds}})), bounds


def test_a_keyword_the_grammar_would_not_hold_is_refused_and_literals_are_written_as_they_are(small):
    """A text value's schema goes through the same check as a ``response_format``'s (a keyword beside
    an ``enum`` is refused, not ignored; so is a key with a control character); an enum text that
    spells a rule's name is written as it is."""
    from expertcache.llama.constraints import ConstraintError

    with pytest.raises(ConstraintError, match="minLength"):
        call_grammar(GLM, [("f", {"type": "object", "properties": {"a": {"type": "string", "enum": ["x"],
                                                                          "minLength": 3}}})], small._model.vocab)
    with pytest.raises(ConstraintError, match="control character"):
        call_grammar(GLM, [("f", {"type": "object", "properties": {"b\x08c": {"type": "integer"}}})],
                     small._model.vocab)
    tools = [("f", {"type": "object", "properties": {"a": {"type": "string", "enum": ["text-0", "json-0"]}},
                    "required": ["a"]})]
    grammar = call_grammar_text(GLM, tools)
    for value, want in (("text-0", True), ("json-0", True), ("x", False), ("", False)):
        text = f"<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"
        assert grammar_accepts(small, grammar, text) == want, value
    assert literal('a"b\\c\nd\x08\x7f｜') == '"a\\"b\\\\c\\nd\\x08\\x7F｜"'


def accepts(rules: list[str], start: str, text: str) -> bool:
    """Whether ``until``'s rules (each alternative ``""``, another rule, or one literal or character
    class then one rule) read ``text`` whole from rule ``start``: an interpreter of that subset of GBNF."""
    table, moves = {}, {}
    for line in rules:
        name, body = line.split(" ::= ")
        table[name], moves[name] = [], []
        for alt in body.split(" | "):
            if alt == '""':
                table[name].append(None)
                continue
            if " " not in alt:
                moves[name].append(alt)
                continue
            head, nxt = alt.rsplit(" ", 1)
            if head.startswith('"'):
                table[name].append((("lit", __import__("json").loads(head)), nxt))
            else:
                chars = re.sub(r"\\x([0-9A-F]{2})|\\u([0-9A-F]{4})", lambda m: chr(int(m.group(1) or m.group(2), 16)),
                               head[2:-1])
                table[name].append((("not", chars), nxt))
    def closure(states: set) -> set:
        todo, seen = list(states), set(states)
        while todo:
            for nxt in moves[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    states = closure({start})
    for c in text:
        after = set()
        for s in states:
            for alt in table[s]:
                if alt is None:
                    continue
                (kind, chars), nxt = alt
                if (kind == "lit" and chars == c) or (kind == "not" and c not in chars):
                    after.add(nxt)
        states = closure(after)
    return any(None in table[s] for s in states)


CLOSES = [("</parameter>", "</tool_call>"), ("</arg_value>", "</tool_call>"), ("</｜DSML｜parameter>",),
          ("</｜DSML｜ parameter>", "</｜DSML｜ calls>"), ("<|end|>", "<|start|>"),
          ("]<]minimax[>[</text>", "]<]minimax[>[</tool_call>"), ("abab", "aab", "b<")]
"""Closes of every kind the formats have, and ones that overlap themselves and each other (an
ending of one begins it again, or begins another), as MiniMax-M3's namespace token does."""


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(CLOSES), st.booleans(), st.data())
def test_the_text_rule_reads_exactly_the_texts_without_a_close(closes, edges, data):
    """:func:`until`'s rules read a text exactly when it holds none of the closes (and, with
    ``edges``, neither begins nor ends with a new line), over texts built of the closes' pieces."""
    alphabet = sorted(set("".join(closes)) | {"\n", "x", "<"})
    pieces = st.one_of(st.sampled_from(alphabet), st.sampled_from(list(closes)),
                       st.sampled_from([c[:i] for c in closes for i in range(1, len(c))]))
    text = "".join(data.draw(st.lists(pieces, max_size=12)))
    rules = until("t", closes, edges)
    want = not any(c in text for c in closes) and not (edges and (text[:1] == "\n" or text[-1:] == "\n"))
    assert accepts(rules, "t", text) == want, (text, closes, edges)


def test_the_text_rule_reference_cases():
    rules = until("t", ("</parameter>", "</tool_call>"), False)
    for text, want in [("", True), ("a < b", True), ("</param", True), ("</parameter>", False),
                       ("x</tool_call>y", False), ("<</parameter>", False), ("</tool_</parameter>", False),
                       ("</</", True), ("\n", True)]:
        assert accepts(rules, "t", text) == want, text
    rules = until("t", ("</parameter>",), True)
    for text, want in [("", True), ("\n", False), ("a\n", False), ("\na", False), ("a\nb", True), ("<\n<", True)]:
        assert accepts(rules, "t", text) == want, text


def grammar_accepts(llm, grammar: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets ``text`` through whole and then lets the decode end:
    each of its tokens offered alone to the sampler (a token it refuses gets ``-inf``), then
    accepted, and at the end the end-of-sequence token."""
    import ctypes
    import math

    import llama_cpp

    vocab = llm._model.vocab
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    assert sampler
    try:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True) + [llama_cpp.llama_vocab_eos(vocab)]
        for i, token in enumerate(ids):
            data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(llama_cpp.llama_token_data_array(data, 1, -1, False)))
            if math.isinf(data[0].logit):
                return False
            if i < len(ids) - 1:
                llama_cpp.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama_cpp.llama_sampler_free(sampler)


WRITTEN = {
    GLM: ["<tool_call>{name}\n{args}</tool_call>", "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"],
    QWEN_XML: ["<tool_call>\n<function={name}>\n{args}</function>\n</tool_call>",
               "<parameter={key}>\n{value}\n</parameter>\n"],
    MINIMAX: ['<minimax:tool_call>\n<invoke name="{name}">\n{args}</invoke>\n</minimax:tool_call>',
              '<parameter name="{key}">{value}</parameter>\n'],
    DSML: ['<｜DSML｜function_calls>\n<｜DSML｜invoke name="{name}">\n{args}</｜DSML｜invoke>\n</｜DSML｜function_calls>',
           '<｜DSML｜parameter name="{key}" string="{text}">{value}</｜DSML｜parameter>\n'],
    DSV4: ['<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n{args}</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
           '<｜DSML｜parameter name="{key}" string="{text}">{value}</｜DSML｜parameter>\n'],
    "deepseek-v4.1": ['<｜DSML｜ calls>\n<｜DSML｜ invoke name="{name}">\n{args}</｜DSML｜ invoke>\n</｜DSML｜ calls>',
                      '<｜DSML｜ parameter name="{key}" string="{text}">{value}</｜DSML｜ parameter>\n'],
    KIMI_K3: ['<|open|>tools<|sep|><|open|>call tool="{name}" index="1"<|sep|>{args}<|close|>call<|sep|><|close|>tools<|sep|>',
              '<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'],
}
"""A keyed call as each format's template writes it (DeepSeek-V4.1's: V4's format, its other spelling)."""


def written(fmt: str, name: str, args: list[tuple[str, str]]) -> str:
    """The call of ``name`` with ``args`` (key, value as written: a text, or JSON) in ``fmt`` (Kimi
    K3's ``type``: ``string`` for a key the tool types a text, else the value's kind)."""
    call, arg = WRITTEN[fmt]
    texts = {key for key, schema in (dict(TOOLS).get(name) or {}).get("properties", {}).items()
             if schema.get("type") == "string"}
    body = "".join(arg.format(key=k, value=v, text="true" if k in texts else "false",
                              kind="string" if k in texts else kind_of(v)) for k, v in args)
    return call.format(name=name, args=body)


def kind_of(value: str) -> str:
    """Kimi K3's ``type`` of a value written as JSON: its JSON kind (``number`` where it is no JSON)."""
    import json

    try:
        v = json.loads(value)
    except ValueError:
        return "number"
    kinds = ((bool, "boolean"), (type(None), "null"), (list, "array"), (dict, "object"), (str, "string"))
    return next((kind for t, kind in kinds if isinstance(v, t)), "number")


TEXTS = st.lists(st.one_of(st.sampled_from(list("ab<>/\n ｜")), st.sampled_from(
    ["</parameter>", "</tool_call>", "</arg_value>", "</｜DSML｜parameter>", "</｜DSML｜ parameter>",
     "</minimax:tool_call>", "</｜DSML｜function_calls>", "</｜DSML｜tool_calls>", "</｜DSML｜ calls>", "</param",
     "</function>", "<parameter=", "</｜DSML｜", "<|close|>argument<|sep|>", "<|close|>tools<|sep|>", "<|close|>",
     "<|sep|>"])), max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(WRITTEN)), TEXTS)
def test_llama_cpp_takes_exactly_the_calls_the_reader_reads(small, spelling, text):
    """A text value written raw, any text at all: llama.cpp's grammar sampler takes the call exactly
    when the format's reader reads it back as that call with that very text (neither holds a close,
    nor, unframed, a new line at an end, which the reader would take off)."""
    import json

    fmt = DSV4 if spelling == "deepseek-v4.1" else spelling
    tools = [t for t in TOOLS if t[0] == "write"]
    call = written(spelling, "write", [("text", text)])
    _, calls = parse_tagged(call, fmt, tools)
    read_back = len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"text": text}
    assert grammar_accepts(small, call_grammar_text(fmt, tools), call) == read_back, (spelling, text, calls)


GEMMA4_TEXTS = st.lists(st.one_of(st.sampled_from(list('ab<>|"/:{},\n ')), st.sampled_from(
    ['<|"|>', "<tool_call|>", "<|tool_call>", '<|"', "<tool_call", "|>"])), max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(GEMMA4_TEXTS)
def test_llama_cpp_takes_exactly_the_gemma4_texts_the_reader_reads(small, text):
    """Gemma 4's text written raw between its marks, any text at all: taken exactly when its reader
    reads the call back with that very text (it holds neither the mark nor the block's close)."""
    import json

    tools = [t for t in TOOLS if t[0] == "write"]
    call = '<|tool_call>call:write{text:<|"|>' + text + '<|"|>}<tool_call|>'
    _, calls = parse_tagged(call, GEMMA4, tools)
    read_back = len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"text": text}
    assert grammar_accepts(small, call_grammar_text(GEMMA4, tools), call) == read_back, (text, calls)


M3_TEXTS = st.lists(st.one_of(st.sampled_from(list("ab<>[]/\n ")), st.sampled_from(
    ["]<]minimax[>[", "]<]minimax[>[</text>", "]<]minimax[>[</tool_call>", "]<]mini", "</text>", "]<]"])),
    max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(M3_TEXTS)
def test_llama_cpp_takes_exactly_the_minimax_m3_texts_the_reader_reads(small, text):
    """MiniMax-M3's text written raw in its element, any text at all: taken exactly when its reader
    reads the call back with that very text (it holds neither its element's close nor the block's)."""
    import json

    tools = [t for t in TOOLS if t[0] == "write"]
    ns = "]<]minimax[>["
    call = f'{ns}<tool_call>\n{ns}<invoke name="write">{ns}<text>{text}{ns}</text>{ns}</invoke>\n{ns}</tool_call>'
    _, calls = parse_tagged(call, MINIMAX_M3, tools)
    read_back = len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"text": text}
    assert grammar_accepts(small, call_grammar_text(MINIMAX_M3, tools), call) == read_back, (text, calls)


def test_llama_cpp_holds_a_minimax_m3_call_to_the_parameters(small):
    """MiniMax-M3's elements under llama.cpp's grammar sampler: required members first, nested
    elements, ``<item>`` elements within the count, JSON for the other types, texts raw."""
    ns = "]<]minimax[>["
    weather = call_grammar_text(MINIMAX_M3, [TOOLS[0]])

    def ok(members: str) -> bool:
        return grammar_accepts(small, weather, f'{ns}<tool_call>\n{ns}<invoke name="get_weather">{members}'
                                               f'{ns}</invoke>\n{ns}</tool_call>')

    def el(key: str, value: str) -> str:
        return f"{ns}<{key}>{value}{ns}</{key}>"

    assert ok(el("city", "Paris") + el("units", "C"))
    assert ok(el("city", "") + el("units", "F") + el("days", "3") + el("hourly", "true") + el("where", el("lat", "1.5"))
              + el("tags", el("item", "ab") + el("item", "c")) + el("zone", "UTC"))
    assert not ok(el("units", "C") + el("city", "Paris"))  # required first, in the schema's order
    assert not ok(el("city", "Paris"))
    assert not ok(el("city", "Paris") + el("units", '"C"'))
    assert not ok(el("city", "Paris") + el("units", "C") + el("days", "three"))
    assert not ok(el("city", "Paris") + el("units", "C") + el("tags", el("item", "a") * 3))
    assert not ok(el("city", "x" * 13) + el("units", "C"))
    assert not ok(el("city", "Paris") + el("units", "C") + el("extra", "1"))


def test_llama_cpp_holds_a_gemma4_call_to_the_parameters(small):
    """Gemma 4's syntax under llama.cpp's grammar sampler: members required first then the others
    each maybe, nested objects and arrays, numbers as JSON writes them; what breaks the schema or the
    syntax (a missing member, a bare text, a number too long, white space, too many items) is not taken."""
    weather = call_grammar_text(GEMMA4, [TOOLS[0]])
    q = '<|"|>'

    def ok(args: str) -> bool:
        return grammar_accepts(small, weather, "<|tool_call>call:get_weather{" + args + "}<tool_call|>")

    assert ok(f"city:{q}Paris{q},units:{q}C{q}")
    assert ok(f"city:{q}{q},units:{q}F{q},days:-3,hourly:false,where:{{lat:1.5e-3}},tags:[{q}ab{q},{q}c{q}],"
              f"zone:null")
    assert ok(f"city:{q}Paris{q},units:{q}C{q},tags:[],zone:{q}UTC{q}")
    assert not ok(f"units:{q}C{q},city:{q}Paris{q}")  # required first, in the schema's order
    assert not ok(f"city:{q}Paris{q}")
    assert not ok(f"city:Paris,units:{q}C{q}")
    assert not ok(f"city:{q}Paris{q}, units:{q}C{q}")
    assert not ok(f"city:{q}Paris{q},units:{q}K{q}")
    assert not ok(f"city:{q}Paris{q},units:{q}C{q},days:1.5")
    assert not ok(f"city:{q}Paris{q},units:{q}C{q},days:01")
    assert not ok(f"city:{q}Paris{q},units:{q}C{q},tags:[{q}a{q},{q}b{q},{q}c{q}]")
    assert not ok(f"city:{q}Paris{q},units:{q}C{q},where:{{}}")
    assert not ok(f"city:{q}Paris{q},units:{q}C{q},days:{'9' * 17}")
    assert not ok(f"city:{q}Paris{q},units:{q}C{q},where:{{lat:1e999}}")  # infinite: the reader refuses it
    assert ok(f"city:{q}Paris{q},units:{q}C{q},where:{{lat:1e99}}")
    write = call_grammar_text(GEMMA4, [TOOLS[-2]])
    for text, want in (("a < b", True), ('"|>', True), ("a<tool_call|>b", False), ('a<|"|>b', False)):
        call = "<|tool_call>call:write{text:" + q + text + q + "}<tool_call|>"
        assert grammar_accepts(small, write, call) == want == bool(parse_tagged(call, GEMMA4, [TOOLS[-2]])[1]), text
    ping = call_grammar_text(GEMMA4, [TOOLS[-1]])
    assert grammar_accepts(small, ping, "<|tool_call>call:ping{}<tool_call|>")
    spaced = [("f", {"type": "object", "properties": {"a b": {"type": "integer"}}, "required": ["a b"]})]
    text = '<|tool_call>call:f{<|"|>a b<|"|>:1}<tool_call|>'  # a key the reader does not take bare: marked
    assert grammar_accepts(small, call_grammar_text(GEMMA4, spaced), text)
    assert parse_tagged(text, GEMMA4, spaced)[1][0]["function"]["arguments"] == '{"a b": 1}'
    assert not writes(GEMMA4, [("f", {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}})])
    assert not writes(GEMMA4, [("f", {"type": "object", "properties": {"a": {}}})])
    assert not writes(GEMMA4, [("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}})])
    optional = call_grammar_text(GEMMA4, [("f", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}})])
    for args, want in (("", True), ("a:1", True), ("b:2", True), ("a:1,b:2", True), ("b:2,a:1", False),
                       (",b:2", False), ("a:1,", False)):
        assert grammar_accepts(small, optional, "<|tool_call>call:f{" + args + "}<tool_call|>") == want, args


def test_llama_cpp_holds_a_keyed_call_to_the_parameters(small):
    """Reference cases under llama.cpp's grammar sampler: a call with its required members and any
    of the optional ones in the schema's order, each value of its type, is taken; a missing
    required member, a value out of its enum or its length bounds, an unknown key, JSON for a text
    (where the reader takes the text as written) or a text for an integer, are not."""
    get_time = [TOOLS[1]]
    weather = [TOOLS[0]]
    for spelling in WRITTEN:
        fmt = DSV4 if spelling == "deepseek-v4.1" else spelling
        def ok(name, args, tools):
            return grammar_accepts(small, call_grammar_text(fmt, tools), written(spelling, name, args))
        assert ok("get_time", [("zone", "UTC"), ("code", "ab")], get_time), spelling
        assert ok("get_time", [("zone", "CET"), ("code", "abcd")], get_time)
        assert not ok("get_time", [("zone", "GMT"), ("code", "ab")], get_time)
        assert not ok("get_time", [("zone", "UTC"), ("code", "a")], get_time)
        assert not ok("get_time", [("zone", "UTC"), ("code", "abcde")], get_time)
        assert not ok("get_time", [("zone", "UTC")], get_time)
        assert not ok("get_time", [("code", "ab"), ("zone", "UTC")], get_time)  # the schema's order
        assert not ok("get_time", [("zone", '"UTC"'), ("code", "ab")], get_time)
        assert not ok("get_times", [("zone", "UTC"), ("code", "ab")], get_time)
        assert ok("get_weather", [("city", "Paris"), ("days", "3"), ("units", "C"), ("hourly", "true"),
                                  ("where", '{"lat": 1.5}'), ("tags", '["a"]'), ("zone", "null")], weather)
        assert ok("get_weather", [("city", ""), ("units", "F")], weather)
        assert not ok("get_weather", [("city", "Paris"), ("days", "three"), ("units", "C")], weather)
        assert not ok("get_weather", [("city", "Paris"), ("units", "C"), ("extra", "1")], weather)
        assert not ok("get_weather", [("city", "Paris"), ("units", "C"), ("tags", '["a", "b", "c"]')], weather)
        write = [t for t in TOOLS if t[0] == "write"]
        assert ok("write", [("text", "if a < b: </param")], write)
        assert not ok("write", [("text", "a" + WRITTEN[spelling][1].split("{value}")[1].strip() + "b")], write)


def test_kimi_k3_reference_cases(small):
    """Kimi K3's forced call: its block after its answer section (both tags, the close alone, or
    neither), each read back as the call with the section's tags out of the content; a JSON value's
    ``type`` its kind (``number`` for an integer, not ``boolean``; a type list's kinds), a text's
    ``string``."""
    import json

    tools = [t for t in TOOLS if t[0] == "get_weather"]
    grammar = call_grammar_text(KIMI_K3, tools)
    call = written(KIMI_K3, "get_weather", [("city", "Paris"), ("days", "3"), ("units", "C")])
    for lead in ("", "<|close|>response<|sep|>", "<|open|>response<|sep|><|close|>response<|sep|>"):
        assert grammar_accepts(small, grammar, lead + call), lead
        content, (read_back,) = read(KIMI_K3, lead + call, tools)
        assert content is None and json.loads(read_back["function"]["arguments"]) == {"city": "Paris", "days": 3,
                                                                                      "units": "C"}
    assert not grammar_accepts(small, grammar, "<|close|>response<|sep|><|open|>response<|sep|>" + call)
    assert not grammar_accepts(small, grammar, call.replace('"days" type="number"', '"days" type="boolean"'))
    assert not grammar_accepts(small, grammar, call.replace('"city" type="string"', '"city" type="number"'))
    union = call_grammar_text(KIMI_K3, [("f", {"type": "object", "properties": {"a": {"type": ["array", "null"]}}})])
    for value, kind, taken in (("[1]", "array", True), ("null", "null", True), ("[1]", "number", False)):
        assert grammar_accepts(small, union, written(KIMI_K3, "f", [("a", value)]).replace(
            f'type="{kind_of(value)}"', f'type="{kind}"')) == taken, (value, kind)


def test_a_forced_call_may_follow_a_thinking_block(small):
    """With ``thinking``, the call may come after a block (its open tag maybe, any text without the
    close or an end tag, the close) and a little white space, or at once; nothing else before it."""
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    grammar = call_grammar(QWEN_XML, [TOOLS[-1]], small._model.vocab, Thinking("<think>", "</think>", ("<tool_call>",))
                           )._grammar
    for text, want in ((call, True), ("</think>" + call, True), ("</think>\n\n" + call, True),
                       ("I will ping.</think>\n" + call, True), ("<think>I will ping.\n</think>" + call, True),
                       ("<think></think>" + call, True), ("a < b </thin</think>" + call, True),
                       ("</think></think>" + call, False), ("</think>x" + call, False), ("x" + call, False),
                       ("I will <tool_call></think>" + call, False), ("<think><think></think>" + call, True),
                       ("<think>x" + call, False)):
        assert grammar_accepts(small, grammar, text) == want, text
    assert not grammar_accepts(small, call_grammar_text(QWEN_XML, [TOOLS[-1]]), "</think>" + call)


def test_a_forced_harmony_call_may_follow_analysis_and_preamble_messages(small):
    """gpt-oss's, as llama.cpp's grammar for ``required`` allows: any number of ``analysis`` and
    preamble (``commentary``, no recipient) messages, each framed whole, then the call, its recipient
    in the channel's header or the role's (as its template writes it), its content type
    ``<|constrain|>json``, ``json`` or none; read back as the reasoning, the preamble as content, and
    the call. Not: a message without its channel, one holding ``<|end|>``, a final message, a
    message to a recipient, text between messages."""
    import json

    from expertcache.llama.callgrammar import HARMONY_MESSAGES

    tools = [TOOLS[-1]]
    grammar = call_grammar(HARMONY, tools, small._model.vocab, HARMONY_MESSAGES)._grammar
    call = "<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}"
    calls = [call, " to=functions.ping<|channel|>commentary json<|message|>{}",
             "<|channel|>commentary to=functions.ping<|message|>{}", " to=functions.ping<|channel|>commentary<|message|>{}"]
    thought = "<|channel|>analysis<|message|>Ping it.<|end|><|start|>assistant"
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    for text, want in [(c, True) for c in calls] + [
            (thought + call, True), ("<|channel|>analysis<|message|><|end|><|start|>assistant" + call, True),
            (preamble + call, True), (thought + preamble + calls[1], True), (thought + thought + call, True),
            ("Ping it.<|end|><|start|>assistant" + call, False), (thought + "\n" + call, False),
            ("<|channel|>analysis<|message|>a<|end|>b<|end|><|start|>assistant" + call, False),
            ("<|channel|>final<|message|>Done.<|end|><|start|>assistant" + call, False),
            ("<|channel|>commentary to=functions.ping<|message|>{}<|end|><|start|>assistant" + call, False),
            (" to=functions.ping <|channel|>commentary json<|message|>{}", False)]:
        assert grammar_accepts(small, grammar, text) == want, text
    for text, reasoning, content in [(c, None, None) for c in calls] + [
            (thought + preamble + calls[1], "Ping it.", "Checking.")]:
        got, said, (read_back,) = read_harmony(text, ["ping"])
        assert (got, said, read_back["function"]["name"], json.loads(read_back["function"]["arguments"])) == \
            (reasoning, content, "ping", {}), text


def test_llama_cpp_takes_each_spelling_of_the_json_formats(small):
    """DeepSeek's V3 and V3.1 sections, Kimi K2's ids, Mistral's array and ``NAME[ARGS]``, gpt-oss's
    commentary message: each as its model writes it is taken, and read back as the call."""
    tools = [TOOLS[1]]
    args = '{"zone": "UTC", "code": "ab"}'
    cases = {
        "deepseek-v3": [f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{args}\n```"
                        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                        f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"
                        "<｜tool▁calls▁end｜>"],
        "kimi-k2": [f"<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:{i}<|tool_call_argument_begin|>"
                    f"{args}<|tool_call_end|><|tool_calls_section_end|>" for i in (0, 7, 12)],
        "mistral": [f'[TOOL_CALLS] [{{"name": "get_time", "arguments": {args}}}]', f"[TOOL_CALLS]get_time[ARGS]{args}"],
        "harmony": [f"<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{args}"],
    }
    for fmt, texts in cases.items():
        grammar = call_grammar_text(fmt, tools)
        for text in texts:
            assert grammar_accepts(small, grammar, text), text
            content, calls = read(fmt, text, tools)
            assert content is None and [c["function"]["name"] for c in calls] == ["get_time"], text
        assert not grammar_accepts(small, grammar, texts[0].replace('"UTC"', '"GMT"'))
    kimi = call_grammar_text("kimi-k2", tools)
    assert not grammar_accepts(small, kimi, cases["kimi-k2"][0].replace(":0<", ":01<"))  # an index as written
    assert not grammar_accepts(small, kimi, cases["kimi-k2"][0].replace(":0<", ":<"))


@settings(max_examples=40, deadline=None)
@given(text=st.text(st.sampled_from('ab/\\"\'\n\té€😀'), max_size=6),
       escapes=st.lists(st.sampled_from(['\\n', '\\"', '\\\\', '\\t', '\\u00e9', '\\ud83d\\ude00', '\\/', '\\b']),
                        max_size=3))
def test_llama_cpp_takes_an_lfm2_call_whose_values_python_reads_as_json_does(small, text, escapes):
    """LFM2's Python call: a text value is JSON's, which Python's parser reads as the same text,
    except ``\\/`` (JSON's ``/``, Python's backslash and ``/``), which the grammar does not write; a
    value taken is read back as the JSON it was written as; ``true`` and ``null`` (JSON's) too."""
    import json

    tools = [("write", {"type": "object", "properties": {"text": {"type": "string"}, "flag": {"type": "boolean"},
                                                          "none": {"type": "null"}}, "required": ["text"]})]
    grammar = call_grammar_text(LFM2, tools)
    value = json.dumps(text, ensure_ascii=False)[:-1] + "".join(escapes) + '"'
    call = f'<|tool_call_start|>[write(text={value}, flag=true, none=null)]<|tool_call_end|>'
    taken = grammar_accepts(small, grammar, call)
    assert taken == ("\\/" not in escapes), call
    if taken:
        content, calls = read(LFM2, call, tools)
        assert content is None and json.loads(calls[0]["function"]["arguments"]) == {
            "text": json.loads(value), "flag": True, "none": None}, call
