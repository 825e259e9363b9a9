"""``expertcache.llama.constraints`` (docs/serve.md, "Structured output and logit_bias"): the bound on
the grammar a schema makes, checked against llama-cpp-python's own converter on generated schemas
(it must never be below what the converter writes), with reference cases; the refusals of schemas
that would exhaust memory or that llama.cpp refuses; logit_bias's parsing. The sampling itself is
tested through the server (tests/test_serve.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import small_moe_gguf

pytest.importorskip("llama_cpp", reason="the llama extra (llama-cpp-python) is not installed")
from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from expertcache.llama.constraints import (  # noqa: E402
    MAX_GRAMMAR_CHARS, RULE_CHARS, ConstraintError, expansion, held_schema, json_safe_pattern, logit_bias,
    pattern_expansion, response_grammar)

ATOMS = st.sampled_from(["a", "b", "\\d", "\\w", ".", "[a-c]", "[^x]", "\\.", "-"])
COUNTS = st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{3,}", "{1,2}", "{4}", "{,2}"])


def _pattern(atoms=ATOMS, leaves: int = 10):
    """Regular expressions of ``atoms``: sequences, groups with a quantifier, alternations."""
    return st.recursive(atoms, lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map("".join),
        st.tuples(inner, COUNTS).map(lambda t: "(" + t[0] + ")" + t[1]),
        st.tuples(atoms, COUNTS).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")")), max_leaves=leaves)


NAMES = st.text(alphabet="abxyz_-", min_size=1, max_size=40)


def _base(name: str, node: dict) -> int:
    """The converter's grammar for the same schema without its repetitions."""
    plain = {k: v for k, v in node.items() if k not in ("pattern", "minLength", "maxLength", "minItems", "maxItems")}
    return len(json_schema_to_gbnf(json.dumps({"type": "object", "properties": {name: plain}})))


@settings(max_examples=300, deadline=None)
@given(NAMES, _pattern())
def test_a_patterns_bound_is_never_below_the_converters_grammar(name, pattern):
    node = {"type": "string", "pattern": "^" + pattern + "$"}
    schema = held_schema({"type": "object", "properties": {name: node}})  # as response_grammar converts it
    written = len(json_schema_to_gbnf(json.dumps(schema)))
    assert written <= _base(name, node) + expansion(schema), (pattern, written, expansion(schema))


@settings(max_examples=200, deadline=None)
@given(NAMES, st.sampled_from(["string", "array"]), st.integers(0, 60), st.integers(0, 60),
       st.sampled_from(["integer", "string", "boolean"]))
def test_a_counts_bound_is_never_below_the_converters_grammar(name, kind, low, extra, item):
    keys = ("minLength", "maxLength") if kind == "string" else ("minItems", "maxItems")
    node = {"type": kind, keys[0]: low, keys[1]: low + extra}
    if kind == "array":
        node["items"] = {"type": item}
    schema = {"type": "object", "properties": {name: node}}
    written = len(json_schema_to_gbnf(json.dumps(schema)))
    assert written <= _base(name, node) + expansion(schema), (node, written, expansion(schema))


def test_pattern_reference_cases():
    unit = RULE_CHARS  # an atom of one character at the top (no path)
    assert pattern_expansion("abc") == 3 * (1 + unit)
    assert pattern_expansion("a{5}") == 5 * (1 + unit)
    assert pattern_expansion("(ab){3}") == 3 * (2 * (1 + unit) + 2 + unit)
    assert pattern_expansion("((ab){10}){10}") == 10 * (10 * (2 * (1 + unit) + 2 + unit) + 2 + unit)
    assert pattern_expansion("[a-z]{4}") == 4 * (5 + unit) and pattern_expansion("\\d{3}") == 3 * (2 + unit)
    assert pattern_expansion("a{,4}") == 4 * (1 + unit) and pattern_expansion("a{2,}") == 2 * (1 + unit)
    assert pattern_expansion("a{0}") == 0 and pattern_expansion("{x}") == 3 * (1 + unit)  # not a count: text
    assert pattern_expansion("a*b+c?") == 6 * (1 + unit)  # operators copy nothing
    assert pattern_expansion("a", name_chars=10) == 1 + 10 + unit


def test_schemas_that_would_exhaust_memory_are_refused_before_converting():
    """The converter wrote ``^a{1000000000}$`` out in full: 1 GB of grammar, 2.9 GB resident."""
    vocab = None  # never reached: refused before llama.cpp is asked
    for schema in [{"type": "string", "pattern": "^a{1000000000}$"},
                   {"type": "string", "pattern": "^((((ab){100}){100}){100})$"},
                   {"type": "string", "minLength": 10 ** 9}, {"type": "array", "items": {"type": "string"}, "maxItems": 1e300},
                   {"type": "object", "properties": {"x" * 1000: {"type": "string", "maxLength": 5000}}}]:
        assert expansion(schema) > MAX_GRAMMAR_CHARS, schema
        with pytest.raises(ConstraintError, match="would write a grammar of about"):
            response_grammar({"type": "json_schema", "json_schema": {"schema": schema}}, vocab)


def test_logit_bias_keys_and_values():
    assert logit_bias(None, 10) is None and logit_bias({}, 10) is None
    (add,) = logit_bias({"3": 5.0, "0": -100.0}, 10)
    import numpy as np

    scores = np.zeros(10, dtype=np.float32)
    assert list(add(None, scores)) == [-100, 0, 0, 5, 0, 0, 0, 0, 0, 0]
    for bias, match in [({"10": 1.0}, "not a token id"), ({"05": 1.0}, "not a token id"), ({" 5": 1.0}, "not a token id"),
                        ({"-1": 1.0}, "not a token id"), ({"x": 1.0}, "not a token id"), ({"\u0665": 1.0}, "not a token id"),
                        ({"1" * 40: 1.0}, "not a token id"), ({"3": 100.5}, r"outside \[-100, 100\]"),
                        ({"3": float("nan")}, "outside"), ({"3": float("-inf")}, "outside")]:
        with pytest.raises(ConstraintError, match=match) as info:
            logit_bias(bias, 10)
        assert info.value.param == "logit_bias"


SAFE_ATOMS = st.sampled_from(["a", "Z", "7", "@", "-", ".", "\\d", "\\w", "\\s", "\\.", "\\-", "\\(", "\\]", "é",
                              "[a-c]", "[^x]", "[\\d_]", "[]a]", "[^\"\\\\]", "[.-]", "[ -!]"])


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """small-moe's vocabulary, for llama.cpp's own check of a grammar."""
    import llama_cpp

    llm = llama_cpp.Llama(str(small_moe_gguf(tmp_path_factory, "vocab")), vocab_only=True, verbose=False)
    yield llm._model.vocab
    llm.close()


@settings(max_examples=300, deadline=None)
@given(_pattern(SAFE_ATOMS, 8), st.data())
def test_a_rewritten_pattern_matches_only_what_the_original_does_and_json_needs_no_escape(pattern, data):
    """Every string the rewritten pattern matches (drawn by hypothesis from it) matches the
    original, and is one a JSON string holds without an escape, so that the grammar's text is JSON."""
    import re

    safe = json_safe_pattern("^" + pattern + "$")
    text = data.draw(st.from_regex(safe, fullmatch=True), label="text")
    assert re.fullmatch(pattern, text), (pattern, safe, text)
    assert json.dumps(text, ensure_ascii=False) == '"' + text + '"', (pattern, safe, text)


@settings(max_examples=150, deadline=None)
@given(NAMES, _pattern(SAFE_ATOMS, 8))
def test_llama_cpp_takes_the_grammar_of_every_held_pattern(vocab, name, pattern):
    """The converter passed ``\\d`` and ``\\.`` through as grammar escapes llama.cpp refuses; the
    rewritten pattern's grammar is one llama.cpp takes."""
    schema = {"type": "object", "properties": {name: {"type": "string", "pattern": "^" + pattern + "$"}}}
    assert response_grammar({"type": "json_schema", "json_schema": {"schema": schema}}, vocab) is not None


def test_json_safe_pattern_reference_cases():
    unsafe = '"\\\\\\x00-\\x1F'
    assert json_safe_pattern(r"^\d{3}-\w+$") == r"^[0-9]{3}-[0-9A-Za-z_]+$"
    assert json_safe_pattern(r"^a\.b\(\)$") == r"^a[\x2E]b\(\)$"  # the converter's own escapes kept
    assert json_safe_pattern("^.[^x]$") == f"^[^{unsafe}][^x{unsafe}]$"
    assert json_safe_pattern(r"^[]a\]]$") == r"^[\x5Da\x5D]$"
    for pattern, match in [('^a"b$', "must escape"), ("^a\\\\b$", "must escape"), ("^[ -~]$", "the range"),
                           ('^["]$', "holds '\"'"), (r"^\D$", r"the escape \\D is not held"), (r"^\bx$", "escape"),
                           ("^a\tb$", "must escape"), ("^[a-z$", "not closed"), ("^a\\", "lone backslash")]:
        with pytest.raises(ConstraintError, match=match):
            json_safe_pattern(pattern)


def test_keywords_the_grammar_would_not_hold_are_refused():
    """llama-cpp-python's converter ignores, without a word, what it has no grammar for: refused,
    each naming the keyword and where it stands; annotations pass."""
    for schema, match in [({"type": "integer", "maximum": 99}, "schema: maximum is not held"),
                          ({"type": "object", "properties": {"n": {"type": "number", "minimum": 0}}},
                           "schema.properties.n: minimum is not held"),
                          ({"type": "string", "pattern": "^a$", "minLength": 3}, "minLength is not held by the grammar beside pattern"),
                          ({"type": "string", "format": "email"}, "format 'email' has no grammar"),
                          ({"allOf": [{"type": "object"}]}, "allOf is not held"),
                          ({"type": "object", "required": ["a"]}, "required is not held"),
                          ({"$defs": {"X": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
                            "$ref": "#/$defs/X"}, r"schema.\$defs.X: uniqueItems is not held"),
                          ({"type": "array", "prefixItems": [{"type": "string"}], "items": [{"type": "string"}]},
                           "items beside prefixItems")]:
        with pytest.raises(ConstraintError, match=match):
            held_schema(schema)
    with pytest.raises(ConstraintError) as info:  # a path of the request's own long keys: the message stays short
        held_schema({"type": "object", "properties": {"x" * 100_000: {"type": "integer", "maximum": 1}}})
    assert len(str(info.value)) < 400 and str(info.value).endswith("...: maximum is not held by the grammar")
    ok = {"title": "t", "description": "d", "type": "object", "additionalProperties": False, "required": ["a"],
          "properties": {"a": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}], "default": None},
                         "b": {"type": "string", "format": "date-time", "examples": ["x"]},
                         "c": {"type": "array", "items": {"$ref": "#/$defs/C"}, "minItems": 1}},
          "$defs": {"C": {"enum": ["x", "y"]}}}
    assert held_schema(ok) == ok and held_schema(ok) is not ok


def test_what_the_converter_writes_wrongly_is_refused_before_llama_cpp_reads_it(vocab):
    """Schemas whose grammar llama.cpp could not parse (it then printed the whole grammar to stderr)
    or whose text would not be what the schema says: an empty enum or union, a value or property
    name holding a quote, a backslash or a control character, a required name with no property."""
    for schema, match in [({"enum": []}, "an empty enum"), ({"anyOf": []}, "an empty union"),
                          ({"type": "object", "additionalProperties": {"enum": []}}, "an empty enum"),
                          ({"const": 'say "hi"'}, "holds a quote"), ({"const": "a\nb"}, "holds a quote"),
                          ({"enum": ["x", {"k": "a\\b"}]}, "holds a quote"),
                          ({"type": "object", "properties": {'a"b': {"type": "string"}}}, "schema.properties: 'a\"b'"),
                          ({"type": "object", "properties": {"a": {}}, "required": ["a", "zz"]},
                           "'zz' is not among the properties")]:
        with pytest.raises(ConstraintError, match=match):
            response_grammar({"type": "json_schema", "json_schema": {"schema": schema}}, vocab)
    assert response_grammar({"type": "json_schema", "json_schema": {"schema": {"enum": ["é", 1, None]}}}, vocab)


def test_llama_cpps_dump_of_a_grammar_it_cannot_parse_never_reaches_stderr(vocab, capfd):
    """llama.cpp prints a grammar it cannot parse whole with fprintf (up to 4 MiB a request); what
    else is written meanwhile comes through."""
    import llama_cpp

    from expertcache.llama.constraints import grammar_dump_dropped

    bad = b'root ::= \nspace ::= " "?'
    with grammar_dump_dropped(bad):
        print("a line of our own", file=__import__("sys").stderr, flush=True)
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, bad, b"root")
    assert not sampler
    err = capfd.readouterr().err
    assert err == "a line of our own\n", err


def test_a_tool_call_grammar_reads_each_tools_definitions_from_the_root(vocab):
    """A tool's parameters with ``$defs`` (pydantic's nested models) are nested in the call's
    grammar, where ``#/$defs/X`` is read from the root: the definitions are moved there; two tools
    defining one name differently are refused."""
    from expertcache.llama.callgrammar import call_grammar

    nested = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
              "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
    grammar = call_grammar("hermes", [("f", nested), ("g", None), ("h", nested)], vocab)
    assert grammar._grammar.startswith('root ::= "<tool_call>\\n" call "\\n</tool_call>"')
    assert nested["$defs"]  # the caller's schema untouched
    other = {"$defs": {"City": {"type": "string"}}, "type": "object", "properties": {"c": {"$ref": "#/$defs/City"}}}
    for fmt in ("hermes", "glm", "kimi-k2"):
        with pytest.raises(ConstraintError, match=r"two tools define \$defs.City differently"):
            call_grammar(fmt, [("f", nested), ("h", other)], vocab)
    assert "City" in call_grammar("qwen3-coder", [("f", nested)], vocab)._grammar  # a member's $ref: from the root


KEYWORDS = ["type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
            "minLength", "maxLength", "pattern", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
            "definitions", "format", "title"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True) | st.sampled_from(
        ["", "a", "object", "string", "integer", "array", "^a$", "^\\d{2}$", "#/$defs/X", "#", "date", "uuid", 'q"']),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYWORDS + ["a", "X"]), inner,
                                                                max_size=4), max_leaves=12)


@settings(max_examples=600, deadline=None)
@given(JSON_VALUES, st.sampled_from(["response_format", "hermes", "glm", "qwen3-coder", "minimax-m2",
                                     "deepseek-v3.2", "deepseek-v4", "deepseek-v3", "kimi-k2", "mistral", "harmony",
                                     "gemma4"]))
def test_any_json_value_as_a_schema_is_a_grammar_or_a_constraint_error(vocab, value, where):
    """Whatever JSON a client sends as a schema (or a tool's parameters, forced in a call format), the
    answer is a grammar or a ConstraintError (a 400), never another exception (a 500): ``"required":
    [{}]`` had raised a TypeError, a list of ``$defs`` an AttributeError. Where a format's grammar
    cannot be written (:func:`~expertcache.llama.callgrammar.writes`), the call is forced as its
    arguments: a ``response_format``'s grammar."""
    from expertcache.llama.callgrammar import FORMS, call_grammar, writes

    assert where == "response_format" or where in FORMS
    tools = [("f", value if isinstance(value, dict) else None), ("g", {"$defs": value})]
    try:
        if where != "response_format" and writes(where, tools):
            call_grammar(where, tools, vocab)
        else:
            response_grammar({"type": "json_schema", "json_schema": {"schema": value}}, vocab)
    except ConstraintError:
        pass


def test_an_empty_type_list_is_refused_and_a_failed_parse_leaves_stderr_clean(vocab, capfd):
    """``{"type": []}`` made an empty rule, which llama.cpp cannot parse; its report quotes the
    grammar from where the parse failed (lines the guard drops too), found by the JSON-value
    property test above."""
    from expertcache.llama.callgrammar import call_grammar
    from expertcache.llama.constraints import grammar_dump_dropped

    with pytest.raises(ConstraintError, match="an empty list of types"):
        call_grammar("hermes", [("f", {"type": []})], vocab)
    import llama_cpp

    bad = b'root ::= a\na ::= \nb ::= "x"\nc ::= "y"'
    with grammar_dump_dropped(bad):
        assert not llama_cpp.llama_sampler_init_grammar(vocab, bad, b"root")
    assert capfd.readouterr().err == ""
