"""A forced tool call in the model's own call format (docs/serve.md, "Tool calls"): the grammar of
one call to one of the request's tools, or of one or more (``parallel``: as the format's template
writes a turn's calls, :data:`APART`, :data:`BETWEEN`), written as the format's template teaches it,
so that a ``"required"`` or named call is text the model learnt, read back by the same reader as
``"auto"`` (:data:`~.toolcalls.READERS`).

:func:`call_grammar_text` writes it for :data:`FORMS`:

* **JSON arguments** (Hermes, DeepSeek-V3 and V3.1, Kimi K2, Mistral, gpt-oss): the format's frame
  around the tool's name and its arguments, JSON under the grammar of its ``parameters``
  (llama-cpp-python's converter, as for ``response_format``: :func:`~.constraints.schema_text`).
  Where a format has two spellings (DeepSeek's V3 and V3.1 sections, Mistral's JSON array and its
  later ``NAME[ARGS]``), both are alternatives: the model writes the one it learnt.
* **Keyed arguments** (GLM-4.5, Qwen3-Coder, MiniMax-M2, DeepSeek-V3.2 and V4, Kimi K3): each of
  the tool's properties in its ``parameters``' order, the ``required`` ones always, the others
  optional; a value is written as the reader reads it: the text as written where the reader takes it
  as text (the property typed ``string``; DeepSeek's DSML, by its ``string="true"`` mark; Kimi K3's
  by ``type="string"``), else JSON of the property's schema (Kimi K3's ``type`` its kind).
  DeepSeek-V4's block has both spellings (V4's and V4.1's). Kimi K3's block may follow its empty
  answer section (:data:`LEADS`).
* **Gemma 4's syntax**: its arguments are not JSON, so :class:`_Gemma4` writes their grammar from
  the schema (texts raw between ``<|"|>`` marks, keys bare, no white space), as its template writes
  them.
* **MiniMax-M3's elements**: :class:`_M3` writes an element per argument from the schema, as its
  reader (:func:`~.toolcalls._m3_value`) takes them.
* **LFM2's Python calls**: ``[NAME(KEY=VALUE, ...)]`` between its tags, a keyword argument per
  property (the required ones first, the others each maybe), each value JSON of the property's
  schema, which Python's parser reads as a literal (a text in double quotes, a number, a list) or
  the reader as JSON (``true``, ``null``, an object holding them: :func:`~.toolcalls._python_value`).

Invariants (``tests/test_callgrammar.py``):

* **What the grammar lets through, the reader reads back as a call to one of the tools, whose
  arguments keep to its parameters** (with ``parallel``: as such calls, one or more), sampled under
  llama.cpp's grammar sampler and read by :func:`~.toolcalls.parse_tagged`; with ``parallel``, a
  turn of two calls as the format's template writes it is let through. A text value cannot hold what ends it: the parameter's closing
  tag (Gemma 4's mark, MiniMax-M3's element close) or the block's (:func:`until`); where the reader
  takes a new line off each end of a value (:func:`~.toolcalls._unframed`) and the format does not
  frame values with them, a text value neither begins nor ends with one.
* :func:`writes` says where a grammar can: a format of :data:`FORMS`, and for the keyed formats,
  each tool's parameters an object of named properties (an object with no properties: no
  arguments), a key or name with none of ``<>"&`` nor white space at its ends, a text value of a
  length bounded by at most :data:`MAX_TEXT_REPEAT` and no ``pattern`` or ``format`` (which the
  grammar of a text written raw would not hold), an ``enum`` or ``const`` of texts none of which
  holds what ends it (Gemma 4's and MiniMax-M3's: where :class:`_Gemma4`, :class:`_M3` write the
  schema). Elsewhere the server forces the call as its arguments alone (JSON under the grammar), as
  for a template whose format it does not read.
"""

from __future__ import annotations

import functools
import json
import keyword
import re
from typing import NamedTuple

from llama_cpp.llama_grammar import LlamaGrammar

from .constraints import ConstraintError, checked_grammar, held_schema, hoisted, schema_text, tool_call_text
from .reasoning import CHANNEL, END, MESSAGE, START
from .toolcalls import (CALL_CLOSE, CALL_OPEN, CALL_SEP, CALLS_CLOSE, CALLS_OPEN, CLOSE, DSML, DSML_CLOSE, DSML_OPEN,
                        DSML_SPACED, DSV3, DSV4, DSV4_CLOSE, DSV4_OPEN, DSV41_CLOSE, DSV41_OPEN, GEMMA4,
                        GEMMA4_CLOSE, GEMMA4_KEY, GEMMA4_OPEN, GEMMA4_QUOTE, GLM, HARMONY, HERMES, K3_SEP, KIMI,
                        KIMI_K3, KIMI_TAGS, LFM2, LFM2_CLOSE, LFM2_OPEN,
                        M3_CLOSE, M3_INVOKE_END, M3_ITEM, M3_ITEM_END, M3_NS, M3_OPEN, MINIMAX, MINIMAX_CLOSE,
                        MINIMAX_M3, MINIMAX_OPEN, MISTRAL, MISTRAL_ARGS, MISTRAL_CALLS, OPEN, QWEN_XML, XML_FORMS,
                        k3_close, k3_open, m3_may_be_text, schema_alternatives)

KIND = "{kind}"
"""In a spelling's opening of a JSON value, where the value's kind is written (Kimi K3's ``type``
attribute: :func:`_kinds`)."""
INDEX = "{index}"
"""In a spelling's name end, where the call's place among the turn's calls is written (Kimi K3's
``index`` attribute: ``1`` for the first call, the model's own number for each call after it)."""
MORE_INDEX = '([2-9] | [1-9] [0-9]{1,2})'
"""The index of a call after the first (2 to 999, no leading zero): the model's own, as Kimi K2's."""
SPELLINGS = {
    GLM: [(OPEN, CLOSE, "", "\n", "", "<arg_key>", "</arg_key>\n<arg_value>", "</arg_key>\n<arg_value>", "",
           "</arg_value>", "\n", False)],
    QWEN_XML: [(OPEN, CLOSE, "\n<function=", ">\n", "</function>\n", "<parameter=", ">\n", ">\n", "\n", "</parameter>",
                "\n", False)],
    MINIMAX: [(MINIMAX_OPEN, MINIMAX_CLOSE, '\n<invoke name="', '">\n', "</invoke>\n", '<parameter name="', '">', '">',
               "", "</parameter>", "\n", True)],
    **{fmt: [(b_open, b_close, "\n" + form[0], form[1] + "\n", form[2] + "\n", form[3], form[4] + "true" + form[5],
              form[4] + "false" + form[5], "", form[6], "\n", True) for b_open, b_close, form in spellings]
       for fmt, spellings in ((DSML, [(DSML_OPEN, DSML_CLOSE, XML_FORMS[DSML])]),
                              (DSV4, [(DSV4_OPEN, DSV4_CLOSE, XML_FORMS[DSML]), (DSV41_OPEN, DSV41_CLOSE, DSML_SPACED)]))},
    KIMI_K3: [(k3_open("tools"), k3_close("tools"), '<|open|>call tool="', f'" index="{INDEX}"' + K3_SEP, k3_close("call"),
               '<|open|>argument key="', '" type="string"' + K3_SEP, f'" type="{KIND}"' + K3_SEP, "",
               k3_close("argument"), "", False)],
}
"""The keyed formats' spellings, as their templates write a call: the block's open and close; the
call's open (before the name), the name's end, the call's close; a parameter's open (before its key),
what follows the key before a text value and before a JSON one, what precedes the value's closing
tag, the tag, what follows it; and ``edges``: the reader takes a new line off each end of a value
(:func:`~.toolcalls._unframed`) that the format does not frame with them. GLM-4.5:
``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``; Qwen3-Coder:
``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``;
MiniMax-M2: ``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n
</invoke>\\n</minimax:tool_call>``; DeepSeek-V3.2's DSML the same with its mark in each tag and
``string="true"`` (a text) or ``"false"`` (JSON) after the key; V4's block ``tool_calls``, or
V4.1's `` calls`` with a space before each keyword; Kimi K3: ``<|open|>tools<|sep|><|open|>call
tool="NAME" index="1"<|sep|><|open|>argument key="K" type="KIND"<|sep|>V<|close|>argument<|sep|>
<|close|>call<|sep|><|close|>tools<|sep|>`` (no new lines), ``KIND`` ``string`` for a text, else
the JSON value's kind (:data:`KIND`); the index the call's place (:data:`INDEX`)."""
LEADS = {KIMI_K3: (k3_open("response"), k3_close("response"))}
"""Tags a format's turn may hold before its block of calls, each maybe, in order: Kimi K3's answer
section (the prompt opened it where it opened no thinking; after the thinking, an empty one). The
readers take them out of the content (:data:`~.reasoning.DROPPED`)."""
JSON_KINDS = {"integer": "number", "number": "number", "boolean": "boolean", "object": "object", "array": "array",
              "null": "null"}
"""Kimi K3's ``type`` of a JSON value, by its schema's type (a text is ``string``, written raw)."""
FORMS = (HERMES, GLM, QWEN_XML, MINIMAX, DSML, DSV4, DSV3, KIMI, MISTRAL, HARMONY, GEMMA4, MINIMAX_M3, LFM2, KIMI_K3)
"""The call formats whose forced call is written in the format (the others' as its arguments alone)."""
APART = {HERMES: "\n", GLM: "\n", QWEN_XML: "\n", GEMMA4: ""}
"""The formats whose template writes each of a turn's calls in a block of its own, and what it
writes between two blocks; the others' write a turn's calls in one block (:func:`call_grammar_text`,
``parallel``)."""
BETWEEN = {MINIMAX_M3: "\n", LFM2: ", ", MISTRAL: ", "}
"""What a format's template writes between two calls of one block, where it writes anything (the
keyed formats' calls share a new line: :func:`_following`; Mistral's: between two items of its JSON
array, and its later spelling's calls each after their own ``[TOOL_CALLS]``)."""


class Thinking(NamedTuple):
    """A thinking block a forced call may follow (:func:`call_grammar`): its ``opening`` and
    ``close`` tags; ``ends``, the tags its text cannot hold (where the reader ends a block never
    closed: a call's opening among them); ``framed``: messages, each opened by ``opening`` or one of
    ``also``, any number of them, the call right after the last close (gpt-oss's), else one block,
    maybe, its opening maybe (the prompt may have opened it), and a little white space before the
    call."""

    opening: str
    close: str
    ends: tuple[str, ...]
    framed: bool = False
    also: tuple[str, ...] = ()


HARMONY_MESSAGES = Thinking(CHANNEL + "analysis" + MESSAGE, END + START + "assistant", (END, START), framed=True,
                            also=(CHANNEL + "commentary" + MESSAGE,))
"""gpt-oss's messages before a forced call, as llama.cpp's gpt-oss grammar for ``required`` allows
them (``zero_or_more(start + (preamble | analysis)) + start + tool_call``): each framed (the prompt
ends ``<|start|>assistant``, and a text that begins with no channel is not read as harmony), on its
``analysis`` channel (reasoning) or ``commentary`` with no recipient (a preamble: content), its text
to ``<|end|>`` or ``<|start|>``, where :class:`~.reasoning.HarmonyStream` ends a body."""
HARMONY_CONSTRAINT = '(" " "<|constrain|>"? "json")?'
"""What may stand between a gpt-oss call's header and ``<|message|>`` (its content type: the model's
``<|constrain|>json``, its template's ``json``, or none), as llama.cpp's grammar allows."""
ROOT = "root ::= "
"""How a grammar's first rule begins."""
MAX_TEXT_REPEAT = 10_000
"""The longest ``minLength`` or ``maxLength`` of a text value written raw (a bounded repetition is
written out by llama.cpp's grammar parser, a rule element per character)."""
SAFE = re.compile(r'[^<>"&\s]([^<>"&\r\n]*[^<>"&\s])?')
"""A key or tool name a keyed format's grammar writes: its reader takes it to the next ``>`` or
``"``, and strips white space off its ends."""


GBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def literal(text: str) -> str:
    """``text`` as a GBNF string literal (another control character as ``\\xHH``: llama.cpp's
    grammar parser reads no ``\\b`` nor ``\\f``)."""
    return '"' + "".join(GBNF_ESCAPES.get(c) or (f"\\x{ord(c):02X}" if ord(c) < 32 or ord(c) == 127 else c)
                         for c in text) + '"'


def _class_char(c: str) -> str:
    """``c`` inside a GBNF character class (anything but a letter or digit escaped)."""
    return c if c.isalnum() and c.isascii() else f"\\x{ord(c):02X}" if ord(c) < 256 else f"\\u{ord(c):04X}"


@functools.lru_cache(maxsize=128)
def until(name: str, closes: tuple[str, ...], edges: bool) -> tuple[str, ...]:
    """GBNF rules, the first named ``name``, for any text that holds none of ``closes`` (none of
    which holds a new line). With ``edges``, the text neither begins nor ends with a new line. The
    states are the longest ending of the text so far that begins a close (an Aho-Corasick automaton
    over the closes, its moves found by trying each ending), each a rule that reads one character and
    goes on to the next state (a rule at the end of its alternative, which llama.cpp's grammar stacks
    do not grow on); a character no close holds goes back to the start. Kept once made (the same
    for every request of a format: the automaton took 1-3 ms to make in Python)."""
    assert closes and all(c and "\n" not in c for c in closes), closes
    prefixes = sorted({c[:i] for c in closes for i in range(len(c))}, key=lambda p: (len(p), p))
    ids = {p: i for i, p in enumerate(prefixes)}  # "" is state 0
    letters = sorted(set("".join(closes)))
    newline = len(prefixes)  # state "" after a new line (not an end, with edges)

    def state(p: str | int) -> str:
        return f"{name}-{p if isinstance(p, int) else ids[p]}"

    def move(here: str, c: str) -> str | None:
        """The state after ``c``, or None where a close ends there."""
        text = here + c
        if any(text.endswith(close) for close in closes):
            return None
        return next(text[i:] for i in range(len(text) + 1) if text[i:] in ids)

    def moves(here: str, first: bool = False) -> list[str]:
        """The alternatives of one character from ``here``: the letters that go elsewhere than the
        start, each to its state (none where a close would end), the rest to the start."""
        special = [c for c in letters if move(here, c) != ""] + (["\n"] if edges else [])
        alts = [f"{literal(c)} {state(nxt)}" for c in special if c != "\n" and (nxt := move(here, c)) is not None]
        if edges and not first:
            alts.append(f'"\\n" {state(newline)}')
        return alts + [f"[^{''.join(_class_char(c) for c in special)}] {state('')}"]

    rules = []
    for p in prefixes + ([newline] if edges else []):
        here = "" if p == newline else p
        rules.append(f"{state(p)} ::= " + " | ".join(([] if p == newline else ['""']) + moves(here)))
    if edges:  # the start: "" or a first character that is not a new line
        rules.append(f"{name} ::= " + " | ".join(['""'] + moves("", first=True)))
    else:
        rules.append(f"{name} ::= {state('')}")
    return tuple(rules)


def _bounded(low, high) -> bool:
    """A length or count bound the grammar writes out: each a non-negative integer up to
    :data:`MAX_TEXT_REPEAT` (``high`` None: none), ``low`` not above ``high``."""
    counts = [low] + ([high] if high is not None else [])
    return all(type(n) is int and 0 <= n <= MAX_TEXT_REPEAT for n in counts) and (high is None or low <= high)


def _string_typed(schema) -> bool:
    """The reader takes this property's value as the text written (:func:`~.toolcalls._keyed_call`)."""
    return isinstance(schema, dict) and schema.get("type") == "string"


def _text_value(schema: dict, closes: tuple[str, ...], edges: bool, rule: str = "text", barred: str = "<"
                ) -> str | None:
    """The grammar expression of a text written raw, held to ``schema`` (a string-typed property),
    or None where it cannot be: a ``pattern`` or ``format``; a length bound over
    :data:`MAX_TEXT_REPEAT` (or not a count); an ``enum``/``const`` text holding a close or (``edges``)
    beginning or ending with a new line. ``rule`` names :func:`until`'s rules."""
    if "pattern" in schema or "format" in schema:
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        if not values or not all(isinstance(v, str) for v in values):
            return None
        if any(c in v for v in values for c in closes):
            return None
        if edges and any(v[:1] == "\n" or v[-1:] == "\n" for v in values):
            return None
        return "(" + " | ".join(literal(v) for v in values) + ")"
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low == 0 and high is None:
        return rule
    if not _bounded(low, high):
        return None
    char = f"[^{_class_char(barred)}\\x0A]" if edges else f"[^{_class_char(barred)}]"  # nothing closes it without
    # ``barred`` (every close begins with it), and with edges no new line at all
    return f"{char}{{{low},{'' if high is None else high}}}"


def _kinds(schema) -> str:
    """The grammar of a JSON value's kind as Kimi K3 writes it (:data:`JSON_KINDS`): the kinds its
    schema's ``type`` names, every one where it names none (the reader reads the value as JSON
    whatever the kind, except ``string``: never written before JSON)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    kinds = sorted({JSON_KINDS[t] for t in types if t in JSON_KINDS}) or sorted(set(JSON_KINDS.values()))
    return "(" + " | ".join(literal(k) for k in kinds) + ")"


def _keyed_ok(params) -> bool:
    """The tool's parameters are an object of named properties (or none)."""
    if params is None:
        return True
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        return False
    if set(params) & {"anyOf", "oneOf", "allOf", "$ref", "patternProperties", "enum", "const"}:
        return False
    props = params.get("properties", {})
    required = params.get("required", [])
    return isinstance(props, dict) and all(isinstance(k, str) and SAFE.fullmatch(k) for k in props) \
        and isinstance(required, list) and all(r in props for r in required)


def _python_name(name) -> bool:
    """A name Python's parser reads as a function's or a keyword argument's (LFM2's calls)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def _closes(fmt: str, spelling: tuple) -> tuple[str, ...]:
    """What ends a text value of ``fmt`` in ``spelling``: its closing tag, and its block's close."""
    return tuple(dict.fromkeys([spelling[9], spelling[1]]))


def writes(fmt: str | None, tools: list[tuple[str, dict | None]]) -> bool:
    """Whether :func:`call_grammar_text` writes a forced call of ``fmt`` to one of ``tools``
    (``(name, parameters)``): the module docstring's conditions."""
    if fmt not in FORMS:
        return False
    try:  # a malformed schema is the JSON path's to refuse, naming the keyword
        for _, params in tools:
            held_schema(params if isinstance(params, dict) else {})
    except ConstraintError:
        return False
    if fmt == GEMMA4:
        return all(_keyed_ok(params) and _Gemma4().value(params or {"type": "object", "properties": {}}) is not None
                   for _, params in tools)
    if fmt == MINIMAX_M3:
        return all(_keyed_ok(params) and _M3(_Values({})).members(params or {"type": "object"}, M3_INVOKE_END)
                   is not None for _, params in tools)
    if fmt == LFM2:
        return all(_python_name(name) and _keyed_ok(params) and all(map(_python_name, (params or {}).get(
            "properties", {}))) for name, params in tools)
    if fmt not in SPELLINGS:
        return True
    for name, params in tools:
        if not (SAFE.fullmatch(name) and _keyed_ok(params)):
            return False
        for schema in (params or {}).get("properties", {}).values():
            for spelling in SPELLINGS[fmt]:
                if _string_typed(schema) and _text_value(schema, _closes(fmt, spelling), spelling[11]) is None:
                    return False
    return True


class _Values:
    """JSON values under schemas, converted together (one converter run: its primitive rules once):
    :meth:`add` a schema, get the rule its values are written by; :meth:`rules` the grammar text."""

    def __init__(self, defs: dict):
        self.defs, self.schemas = defs, []

    def add(self, schema) -> str:
        self.schemas.append({"type": "object", "properties": {}} if schema is None else schema)
        return f"json-{len(self.schemas) - 1}"

    def rules(self) -> str:
        if not self.schemas:
            return ""
        keys = [f"v{i}" for i in range(len(self.schemas))]
        wrapper = {"type": "object", "properties": dict(zip(keys, self.schemas)), "required": keys,
                   "additionalProperties": False, **self.defs}
        text = schema_text(wrapper)
        out, found = [], {}
        for line in text.split("\n"):
            m = re.fullmatch(r'(v[0-9]+)-kv ::= "\\"\1\\"" space ":" space (.+)', line)
            if m:
                found[m.group(1)] = m.group(2)
            if not line.startswith("root ::= "):  # the wrapper's object: not the call's
                out.append(line)
        if set(found) != set(keys):  # another llama-cpp-python's converter: its rules must be read again
            raise RuntimeError("llama-cpp-python's JSON-schema converter names an object's members otherwise "
                               "than expertcache reads them")
        out += [f"json-{i} ::= {found[k]}" for i, k in enumerate(keys)]
        return "\n".join(out)


def _json_call(fmt: str, name: str, args: str) -> list[str]:
    """The alternatives of one call of a JSON-arguments format to ``name`` (``args``: its arguments' rule;
    Mistral's: an item of its JSON array, and its later spelling's call)."""
    n = literal(name)
    if fmt == DSV3:
        v3 = f'{literal(CALL_OPEN + "function" + CALL_SEP)} {n} "\\n```json\\n" {args} "\\n```" {literal(CALL_CLOSE)}'
        v31 = f'{literal(CALL_OPEN)} {n} {literal(CALL_SEP)} {args} {literal(CALL_CLOSE)}'
        return [v3] + ([v31] if name != "function" else [])  # V3.1's "function" would read as V3's kind
    if fmt == KIMI:
        index = '("0" | [1-9] [0-9]{0,2})'  # the model's own: up to 999, no leading zero
        return [f'{literal(KIMI_TAGS[2] + "functions.")} {n} ":" {index} {literal(KIMI_TAGS[4])} {args} '
                f'{literal(KIMI_TAGS[3])}']
    if fmt == HARMONY:  # the recipient in the channel's header (as the model writes it), or the role's (its template)
        return [f'{literal(CHANNEL + "commentary to=functions.")} {n} {HARMONY_CONSTRAINT} {literal(MESSAGE)} {args}',
                f'{literal(" to=functions.")} {n} {literal(CHANNEL + "commentary")} {HARMONY_CONSTRAINT} '
                f'{literal(MESSAGE)} {args}']
    return [f'"{{\\"name\\": " {literal(literal(name))} ", \\"arguments\\": " {args} "}}"',  # an item of Mistral's array
            f'{n} {literal(MISTRAL_ARGS)} {args}']  # its later tokenizers'


GEMMA4_INTEGER = '"-"? ("0" | [1-9] [0-9]{0,15})'
GEMMA4_NUMBER = GEMMA4_INTEGER + ' ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?'
"""A number as Gemma 4 writes one (JSON's), of at most 16 digits each side and an exponent of two:
always finite (the reader refuses one that is not)."""
GEMMA4_SCALARS = {"integer": GEMMA4_INTEGER, "number": GEMMA4_NUMBER, "boolean": '("true" | "false")',
                  "null": '"null"'}
GEMMA4_NESTING = 32
"""The deepest schema a Gemma 4 call's grammar is written for (its reader reads 64 levels)."""


class _Gemma4:
    """The grammar of a value in Gemma 4's syntax under a JSON schema (:func:`~.toolcalls.gemma4_value`
    reads it back): a text between ``<|"|>`` marks written raw (none in it, nor the block's close), a
    number, ``true``, ``false``, ``null``, an object's members ``key:value`` (keys bare where the
    reader takes them bare, else between marks) and an array's items, separated by commas, no white
    space; ``enum``, ``const``, a list of types and ``anyOf``/``oneOf`` as alternatives. :meth:`value`
    gives None for what it does not write (``$ref``, a schema of any value, a ``pattern`` or ``format``,
    a length or count over :data:`MAX_TEXT_REPEAT`, deeper than :data:`GEMMA4_NESTING`)."""

    CLOSES = (GEMMA4_QUOTE, GEMMA4_CLOSE)

    def __init__(self):
        self.rules: list[str] = []

    def _rule(self, body: str) -> str:
        name = f"g-{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def _constant(self, v) -> str | None:
        if isinstance(v, str):
            return None if any(c in v for c in self.CLOSES) else literal(GEMMA4_QUOTE + v + GEMMA4_QUOTE)
        finite = not isinstance(v, float) or v == v and abs(v) != float("inf")
        if v is None or isinstance(v, (bool, int, float)) and finite:
            return literal(json.dumps(v))
        return None

    def _key(self, key: str) -> str | None:
        if GEMMA4_KEY.fullmatch(key):
            return literal(key + ":")
        return None if any(c in key for c in self.CLOSES) else literal(GEMMA4_QUOTE + key + GEMMA4_QUOTE + ":")

    def value(self, schema, depth: int = 0) -> str | None:
        if not isinstance(schema, dict) or depth > GEMMA4_NESTING or "$ref" in schema:
            return None
        alternatives = None
        if "const" in schema or "enum" in schema:
            alternatives = [self._constant(v) for v in ([schema["const"]] if "const" in schema else schema["enum"])]
        elif (listed := schema_alternatives(schema)) is not None:
            alternatives = [self.value(s, depth + 1) for s in listed]
        elif isinstance(schema.get("type"), list):
            alternatives = [self.value({**schema, "type": t}, depth + 1) for t in schema["type"]]
        if alternatives is not None:
            return None if not alternatives or None in alternatives else "(" + " | ".join(alternatives) + ")"
        kind = schema.get("type")
        if kind in GEMMA4_SCALARS:
            return GEMMA4_SCALARS[kind]
        if kind == "string":
            text = _text_value(schema, self.CLOSES, False, "g-text")
            return None if text is None else f"{literal(GEMMA4_QUOTE)} {text} {literal(GEMMA4_QUOTE)}"
        if kind == "array" or kind is None and "items" in schema:
            item = self.value(schema.get("items", {}), depth + 1) if isinstance(schema.get("items"), dict) else None
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if item is None or not _bounded(low, high):
                return None
            item = self._rule(item)
            more = f'("," {item})' + ("*" if high is None else f"{{{max(low - 1, 0)},{high - 1}}}")
            body = f"{item} {more}" if high != 0 else '""'
            return f'"[" {body if low > 0 else f"({body})?"} "]"'
        if kind == "object" or kind is None and "properties" in schema:
            props = schema.get("properties", {})
            if not isinstance(props, dict):
                return None
            members = []
            for key, sub in props.items():
                head, value = self._key(key), self.value(sub, depth + 1)
                if head is None or value is None:
                    return None
                members.append((self._rule(f"{head} {value}"), key in schema.get("required", [])))
            return f'"{{" {_members(members)} "}}"'
        return None


M3_KEY_NAME = re.compile(r"[^<>/\s]+")
"""A member's name MiniMax-M3's reader takes (its element's name)."""


class _M3:
    """The grammar of MiniMax-M3's arguments under a JSON schema, as its reader
    (:func:`~.toolcalls._m3_value`) reads them: each member an element named after it
    (``NS<KEY>VALUE NS</KEY>``, ``NS`` its namespace token), the required ones first, in the schema's
    order, then the others each maybe; a value that may be a text (:func:`~.toolcalls.m3_may_be_text`)
    written raw, to its close (nor the block's close in it); alternatives (``anyOf``/``oneOf`` without
    a type) as alternatives; an object with properties as its members; an array as ``NS<item>``
    elements; anything else JSON of its schema (``values``: :class:`_Values`). :meth:`value` gives
    None for what it does not write (a text's ``pattern`` or ``format``, a length or count over
    :data:`MAX_TEXT_REPEAT`, a member name the reader would not take, deeper than
    :data:`GEMMA4_NESTING`)."""

    def __init__(self, values: _Values):
        self.values, self.rules, self.texts = values, [], {}

    def _rule(self, body: str) -> str:
        name = f"m-{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def _text(self, close: str) -> str:
        """The rule of a text holding neither ``close`` nor the block's close (one per close)."""
        if close not in self.texts:
            self.texts[close] = f"m-text-{len(self.texts)}"
            self.rules += until(self.texts[close], tuple(dict.fromkeys([close, M3_CLOSE])), False)
        return self.texts[close]

    def members(self, schema: dict, close: str, depth: int = 0) -> str | None:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            return None
        members = []
        for key, sub in props.items():
            end = f"{M3_NS}</{key}>"
            value = self.value(sub, end, depth + 1) if M3_KEY_NAME.fullmatch(key) else None
            if value is None:
                return None
            members.append((self._rule(f"{literal(f'{M3_NS}<{key}>')} {value} {literal(end)}"),
                            key in schema.get("required", [])))
        order = [m for m, r in members if r] + [f"({m})?" for m, r in members if not r]
        return " ".join(order) if order else '""'

    def value(self, schema, close: str, depth: int = 0) -> str | None:
        if depth > GEMMA4_NESTING:
            return None
        schema = schema if isinstance(schema, dict) else {}
        if m3_may_be_text(schema):
            if schema.get("type") == "string" and ("enum" in schema or "const" in schema):
                values = [schema["const"]] if "const" in schema else schema["enum"]
                if not all(isinstance(v, str) and close not in v and M3_CLOSE not in v for v in values):
                    return None
                return "(" + " | ".join(literal(v) for v in values) + ")"
            if "pattern" in schema or "format" in schema:
                return None
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            if low == 0 and high is None:
                return self._text(close)
            bounds = {"minLength": low, "maxLength": high} if high is not None else {"minLength": low}
            return _text_value(bounds, (close, M3_CLOSE), False, barred=M3_NS[0])
        kind = schema.get("type")
        if kind is None and (listed := schema_alternatives(schema)) is not None:
            alternatives = [self.value(a, close, depth + 1) for a in listed]
            return None if not alternatives or None in alternatives else "(" + " | ".join(alternatives) + ")"
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self.members(schema, close, depth)
        if kind == "array":
            item = self.value(schema.get("items"), M3_ITEM_END, depth + 1)
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if item is None or not _bounded(low, high):
                return None
            item = self._rule(f"{literal(M3_ITEM)} {item} {literal(M3_ITEM_END)}")
            return f"{item}{{{low},{'' if high is None else high}}}"
        return self.values.add(schema)


JSON_ESCAPES = '["\\\\/bfnrt]'
"""The characters llama-cpp-python's converter lets a JSON text escape with a backslash (its ``char``
rule), ``/`` among them."""


def _python_strings(rules: str) -> str:
    """The converter's ``rules`` with JSON texts Python reads as JSON does: without ``\\/`` (JSON's
    ``/``, Python's backslash and ``/``); every other escape the rule lets through is read alike."""
    if "char ::=" not in rules:
        return rules
    if rules.count(JSON_ESCAPES) != 1:  # another llama-cpp-python's converter: its rule must be read again
        raise RuntimeError("llama-cpp-python's JSON-schema converter writes a text's escapes otherwise than "
                           "expertcache reads them")
    return rules.replace(JSON_ESCAPES, JSON_ESCAPES.replace("/", ""))


def _members(members: list[tuple[str, bool]], sep: str = ",") -> str:
    """Members (their rules, and whether each is required) separated by ``sep``: the required ones
    always, first, the others each maybe; where none is required, any of them first, then the later
    ones each maybe."""
    required = [m for m, r in members if r]
    optional = [m for m, r in members if not r]
    s = literal(sep)
    if required:
        return " ".join([required[0]] + [f'{s} {m}' for m in required[1:]] + [f'({s} {m})?' for m in optional])
    if not optional:
        return '""'
    return "(" + " | ".join(" ".join([m] + [f'({s} {n})?' for n in optional[i + 1:]])
                            for i, m in enumerate(optional)) + ")?"


def _many(one: str, parallel: bool, between: str = "", more: str | None = None) -> str:
    """The grammar of ``one``, and with ``parallel`` any number more after it, each after the text
    ``between``: ``more`` where a call after the first is written otherwise."""
    if not parallel:
        return one
    after = f"{literal(between)} ({more or one})" if between else f"({more or one})"
    return f"({one}) ({after})*"


def _following(c_open: str, c_close: str) -> str:
    """A keyed call's opening after another call of its block: ``c_open`` without what ``c_close``
    already wrote (MiniMax-M2's and DSML's calls share the new line between them)."""
    shared = next((n for n in range(min(len(c_open), len(c_close)), 0, -1) if c_close.endswith(c_open[:n])), 0)
    return c_open[shared:]


def call_grammar_text(fmt: str, tools: list[tuple[str, dict | None]], parallel: bool = False) -> str:
    """The GBNF of one call of format ``fmt`` to one of ``tools`` (``(name, parameters)``; where
    :func:`writes` says it can); with ``parallel``, of one or more, each to one of them, as the
    format's template writes a turn's calls: a block each (:data:`APART`), else one block of them
    (:data:`BETWEEN`); gpt-oss's one (its call ends the decode). Raises
    :class:`~.constraints.ConstraintError` for parameters the grammar would not hold (as a
    ``response_format``'s)."""
    if fmt == HERMES:
        head, _, rules = tool_call_text(tools).partition("\n")
        return f"root ::= {_many(head[len(ROOT):], parallel, APART[fmt])}\n{rules}"
    params, defs = hoisted([p for _, p in tools])
    for p in params:  # a keyword the grammar would not hold is refused, as in a response_format
        held_schema(p or {})
    values = _Values(defs)
    rules: list[str] = []
    if fmt == MINIMAX_M3:
        m3 = _M3(values)
        calls = [f'{literal(f"{M3_NS}<invoke name=" + chr(34) + name + chr(34) + ">")} '
                 f'{m3.members(p or {"type": "object"}, M3_INVOKE_END)} {literal(M3_INVOKE_END)}'
                 for (name, _), p in zip(tools, params)]
        many = _many(f'({" | ".join(calls)})', parallel, BETWEEN[fmt])
        return "\n".join([f'root ::= {literal(M3_OPEN + chr(10))} {many} {literal(chr(10) + M3_CLOSE)}']
                          + m3.rules + [values.rules()])
    if fmt == GEMMA4:
        gemma = _Gemma4()
        calls = [f'{literal("call:" + name)} {gemma.value(p or {"type": "object", "properties": {}})}'
                 for (name, _), p in zip(tools, params)]
        block = f'{literal(GEMMA4_OPEN)} ({" | ".join(calls)}) {literal(GEMMA4_CLOSE)}'
        return "\n".join([f"root ::= {_many(block, parallel, APART[fmt])}"]
                          + list(until("g-text", _Gemma4.CLOSES, False)) + gemma.rules)
    if fmt == LFM2:
        calls = []
        for (name, _), p in zip(tools, params):
            required = set((p or {}).get("required", []))
            members = [(f'{literal(key + "=")} {values.add(schema)}', key in required)
                       for key, schema in (p or {}).get("properties", {}).items()]
            calls.append(f'{literal(name + "(")} {_members(members, ", ")} ")"')
        many = _many(f'({" | ".join(calls)})', parallel, BETWEEN[fmt])
        return "\n".join([f'root ::= {literal(LFM2_OPEN + "[")} {many} {literal("]" + LFM2_CLOSE)}',
                          _python_strings(values.rules())])
    if fmt == MISTRAL:  # its JSON array's items, or its later spelling's calls
        items, later = zip(*(_json_call(fmt, name, values.add(p)) for (name, _), p in zip(tools, params)))
        item, later = f'({" | ".join(items)})', f'({" | ".join(later)})'
        array = f'"[" {_many(item, parallel, BETWEEN[fmt])} "]"'
        calls = _many(later, parallel, MISTRAL_CALLS)
        return "\n".join([f'root ::= {literal(MISTRAL_CALLS)} " "? ({array} | {calls})', values.rules()])
    if fmt in (DSV3, KIMI, HARMONY):
        calls = [alt for (name, _), p in zip(tools, params) for alt in _json_call(fmt, name, values.add(p))]
        alternatives = " | ".join(calls)
        if fmt == HARMONY:  # one: its call ends the decode (<|call|>)
            root = f"({alternatives})"
        else:
            tags = (CALLS_OPEN, CALLS_CLOSE) if fmt == DSV3 else KIMI_TAGS[:2]
            root = f'{literal(tags[0])} {_many(f"({alternatives})", parallel)} {literal(tags[1])}'
        return "\n".join([f"root ::= {root}", values.rules()])
    json_of = {(i, key): values.add(schema) for i, p in enumerate(params)
               for key, schema in (p or {}).get("properties", {}).items() if not _string_typed(schema)}
    blocks = []
    for s, spelling in enumerate(SPELLINGS[fmt]):
        b_open, b_close, c_open, name_end, c_close, k_open, text_open, json_open, before, tag, after, edges = spelling
        closes = _closes(fmt, spelling)
        rules += until(f"text-{s}", tuple(closes), edges)
        firsts, mores, following = [], [], _following(c_open, c_close)
        for i, ((name, _), p) in enumerate(zip(tools, params)):
            parts = []
            required = set((p or {}).get("required", []))
            for key, schema in (p or {}).get("properties", {}).items():
                if (i, key) in json_of:
                    head, kind, tail = json_open.partition(KIND)
                    opening = f"{literal(k_open + key + head)} {_kinds(schema)} {literal(tail)}" if kind else \
                        literal(k_open + key + json_open)
                    value = f"{opening} {json_of[i, key]}"
                else:
                    value = f"{literal(k_open + key + text_open)} {_text_value(schema, closes, edges, f'text-{s}')}"
                piece = f"{value} {literal(before + tag + after)}"
                parts.append(piece if key in required else f"({piece})?")
            body = " ".join(parts + [literal(c_close)])
            if parallel:  # a call's members once, whatever its place
                rules.append(f"call-{s}-{i} ::= {body}")
                body = f"call-{s}-{i}"
            firsts.append(f"{literal(c_open + name + name_end.replace(INDEX, '1'))} {body}")
            head, indexed, tail = name_end.partition(INDEX)
            more = f"{literal(following + name + head)} {MORE_INDEX} {literal(tail)}" if indexed else \
                literal(following + name + name_end)
            mores.append(f"{more} {body}")
        first, more = f'({" | ".join(firsts)})', f'({" | ".join(mores)})'
        if fmt in APART:
            blocks.append(_many(f"{literal(b_open)} {first} {literal(b_close)}", parallel, APART[fmt]))
        else:
            blocks.append(f"{literal(b_open)} {_many(first, parallel, more=more)} {literal(b_close)}")
    lead = "".join(f"{literal(tag)}? " for tag in LEADS.get(fmt, ()))
    return "\n".join([f"root ::= {lead}({' | '.join(blocks)})"] + rules + [values.rules()])


def call_grammar(fmt: str, tools: list[tuple[str, dict | None]], vocab,
                 thinking: Thinking | None = None, parallel: bool = False) -> LlamaGrammar:
    """:func:`call_grammar_text` as a grammar llama.cpp has taken (:func:`~.constraints.checked_grammar`);
    ``parallel``: one call or more.
    ``thinking``: the call may follow such a block (:class:`Thinking`): its opening, any text holding
    neither its close nor one of its ``ends``, its close. As llama.cpp's grammars allow a reasoning
    model (its 2026 parsers: ``<think>`` and text until ``</think>``; gpt-oss's: ``analysis`` and
    preamble messages before a ``required`` call, :data:`HARMONY_MESSAGES`); an empty block is how a
    model writes a turn without thinking after a prompt that opened one."""
    for _, params in tools:  # a keyword the grammar would not hold, named
        held_schema(params if isinstance(params, dict) else {})
    if not writes(fmt, tools):
        raise ConstraintError(f"a forced call of the {fmt} format cannot hold these tools' parameters", "tools")
    text = call_grammar_text(fmt, tools, parallel)
    if thinking:
        assert text.startswith(ROOT)
        if thinking.framed:  # messages, each opened by one of its openings, any number of them
            opening = "(" + " | ".join(literal(o) for o in (thinking.opening, *thinking.also)) + ")"
            head = f"root ::= ({opening} think-text {literal(thinking.close)})* call-root"
        else:  # one block, maybe; its opening maybe; a little white space after it
            block = f"{literal(thinking.opening)}? think-text {literal(thinking.close)} " + "[ \\n]{0,4}"
            head = f"root ::= ({block})? call-root"
        closes = tuple(dict.fromkeys((thinking.close, *thinking.ends)))
        text = "\n".join([head, *until("think-text", closes, False), "call-root ::= " + text[len(ROOT):]])
    return checked_grammar(text, vocab)
