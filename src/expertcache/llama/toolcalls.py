"""Tool calls written in a model's own format, read back into OpenAI's ``tool_calls`` (docs/serve.md,
"Tool calls"). Three formats write each call in a ``<tool_call>`` block: the Hermes format, which
Qwen3-MoE, Qwen3-Next and many other models are trained on, a JSON object::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

GLM-4.5's (GLM-4.5, 4.6, 4.5-Air), the name, then each argument's key and value::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

and the XML of Qwen3-Coder, which Qwen3.5, Nemotron 3 Nano and Step-3.5-Flash write too::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

MiniMax-M2's is XML of its own, and DeepSeek-V3.2's (DSML) the same with a mark in each tag and
each parameter saying whether it is a string (``string="true"``: the text as written) or JSON::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

DeepSeek-V4's is V3.2's with its block named ``<｜DSML｜tool_calls>`` (V4.1's: ``<｜DSML｜ calls>``,
and a space before each keyword: :data:`ALTERNATIVES`, :data:`DSML_SPACED`).

DeepSeek's (V3, R1; V3.1 without ``function`` and the fence) and Kimi K2's are sections of calls
with JSON arguments; Kimi's call id, ``functions.NAME:INDEX``, is the id the call is reported with
(its template writes it back into the next turn)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

Mistral's (Mixtral 8x22B, Mistral Small and Large) has an opening tag and no closing one: the
calls run to the end of the text, a JSON array (``[{"name": ..., "arguments": {...}}]``) or, in
its later tokenizers, each call ``NAME[ARGS]{...}`` after its own ``[TOOL_CALLS]``::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

LFM2's (LFM2-8B-A1B) are Python calls, keyword arguments only, each a Python literal (or, as its
template writes a mapping, JSON), read by Python's parser, never run::

    <|tool_call_start|>[get_weather(city='Paris', days=2)]<|tool_call_end|>

Gemma 4's (gemma-4-26B-A4B and its dense kin) is a call in a syntax of its own: keys bare, text
between ``<|"|>`` marks (written raw: nothing is escaped), numbers, ``true``, ``false``, ``null``,
objects and arrays as JSON writes them, with no white space; a block per call, back to back::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2,opts:{units:[<|"|>C<|"|>]}}<tool_call|>

MiniMax-M3's are elements after its namespace token, each argument an element named after its
parameter, read by the tool's parameters (objects as elements, arrays as ``<item>`` elements)::

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Kimi K3's turn is sections (``<|open|>NAME ATTRIBUTES<|sep|>`` ... ``<|close|>NAME<|sep|>``): its
thinking, its answer, then its calls, each argument a section, a string's text as written, any other
value its JSON (:mod:`.reasoning` reads the first two)::

    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>

Mistral's templates refuse a call id that is not 9 letters and digits (``Tool call IDs should be
alphanumeric strings with length 9!``): the calls of this format get such ids (:func:`new_call_id`).

The chat template tells the format (:func:`call_format`), as llama.cpp's server detects it: one
that holds ``<|open|>``, ``<|close|>`` and ``<|end_of_msg|>`` teaches Kimi K3's, ``]<]minimax[>[``,
``<tool_call>`` and ``<invoke name=`` MiniMax-M3's, ``<minimax:tool_call>`` MiniMax-M2's, ``｜DSML｜`` DeepSeek-V3.2's (V4's without
``function_calls``), ``<|tool_calls_section_begin|>`` Kimi's, ``[TOOL_CALLS]`` Mistral's,
``<|tool_call_start|>`` LFM2's, ``<|tool_call>call:`` Gemma 4's; one that holds ``<tool_call>``
teaches Qwen3-Coder's where it holds ``<function=`` and ``<parameter=`` too, GLM's where it holds
``<arg_key>``, else Hermes'; one that holds
``<｜tool▁calls▁begin｜>`` and ``<｜tool▁sep｜>``, DeepSeek's. (gpt-oss's calls are messages on its
channels: :class:`~.reasoning.HarmonyStream`.)

Invariants (``tests/test_toolcalls.py``):

* **A call is reported only when its block is complete and valid**: the JSON parses to an object
  with a ``name`` among the request's tools and an object of ``arguments`` (Hermes); the name is
  among them and the rest is key-value pairs only, each key once (GLM, Qwen3-Coder, MiniMax,
  DSML, Kimi K3: a value is the text as written where the tool's parameters type the key a string, or
  DSML's mark says ``string="true"`` (Kimi K3's ``type="string"``, where the parameters do not type
  the key), else its JSON when it parses; the XML formats' values lose one
  newline at each end, the template's framing); every call of a block is valid (DeepSeek, Kimi,
  Mistral, LFM2, and the XML formats, which may hold several); MiniMax-M3's are of the tool's
  parameters (:func:`_m3_value`); Gemma 4's is ``call:NAME`` and an
  object of :func:`gemma4_value`'s grammar, each key once, nothing after it. Otherwise the block's
  text stays content, word for word (nothing the model wrote is dropped).
* **Streamed and whole agree**: :class:`TaggedCalls` fed the text in any pieces gives the content
  and calls :func:`parse_tagged` gives for the whole text; content that could begin the format's
  opening tag is held back until it cannot, a block until its closing tag (or the end of the text,
  Mistral's).
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from typing import Callable

from .._text import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES, GLM, QWEN_XML, MINIMAX, MINIMAX_M3, DSML, DSV4, DSV3, KIMI, KIMI_K3, MISTRAL, LFM2, GEMMA4, HARMONY = (
    "hermes", "glm", "qwen3-coder", "minimax-m2", "minimax-m3", "deepseek-v3.2", "deepseek-v4", "deepseek-v3", "kimi-k2",
    "kimi-k3", "mistral", "lfm2", "gemma4", "harmony")
CALLS_OPEN, CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_OPEN, CALL_CLOSE, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_TAGS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_end|>", "<|tool_call_argument_begin|>")
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
LFM2_OPEN, LFM2_CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
K3_OPEN, K3_CLOSE, K3_SEP, K3_END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
"""Kimi K3's markers (special tokens of its vocabulary): each section is ``<|open|>NAME ATTRS<|sep|>``
... ``<|close|>NAME<|sep|>``; ``<|end_of_msg|>`` ends a turn (the decode stops there)."""


def k3_open(name: str) -> str:
    """Kimi K3's opening of a section ``name`` without attributes."""
    return f"{K3_OPEN}{name}{K3_SEP}"


def k3_close(name: str) -> str:
    """Kimi K3's closing of a section ``name``."""
    return f"{K3_CLOSE}{name}{K3_SEP}"


M3_NS = "]<]minimax[>["
"""MiniMax-M3's namespace token, before each of its call tags (a special token of its vocabulary)."""
M3_OPEN, M3_CLOSE, M3_INVOKE_END, M3_ITEM, M3_ITEM_END = (M3_NS + tag for tag in (
    "<tool_call>", "</tool_call>", "</invoke>", "<item>", "</item>"))
DSML_MARK = "｜DSML｜"
DSML_OPEN, DSML_CLOSE = f"<{DSML_MARK}function_calls>", f"</{DSML_MARK}function_calls>"
DSV4_OPEN, DSV4_CLOSE = f"<{DSML_MARK}tool_calls>", f"</{DSML_MARK}tool_calls>"
DSV41_OPEN, DSV41_CLOSE = f"<{DSML_MARK} calls>", f"</{DSML_MARK} calls>"
TAGS = {HERMES: (OPEN, CLOSE), GLM: (OPEN, CLOSE), QWEN_XML: (OPEN, CLOSE), MINIMAX: (MINIMAX_OPEN, MINIMAX_CLOSE),
        DSML: (DSML_OPEN, DSML_CLOSE), DSV4: (DSV4_OPEN, DSV4_CLOSE), DSV3: (CALLS_OPEN, CALLS_CLOSE),
        KIMI: KIMI_TAGS[:2], KIMI_K3: (k3_open("tools"), k3_close("tools")), MINIMAX_M3: (M3_OPEN, M3_CLOSE),
        MISTRAL: (MISTRAL_CALLS, None), LFM2: (LFM2_OPEN, LFM2_CLOSE), GEMMA4: (GEMMA4_OPEN, GEMMA4_CLOSE)}
"""The tags around a format's block of calls (None: the block runs to the end of the text)."""
ALTERNATIVES = {DSV4: ((DSV41_OPEN, DSV41_CLOSE),)}
"""Other tags a format's block may stand between: DeepSeek-V4.1 renamed V4's block to `` calls``
(and spaced its keywords, :data:`DSML_SPACED`); llama.cpp accepts every spelling for a V4 template,
since a wrong guess would hand well-formed calls back as text without a word."""
MARKERS = {HERMES: (OPEN, CLOSE), GLM: (OPEN, CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
           QWEN_XML: (OPEN, CLOSE), MINIMAX: (MINIMAX_OPEN, MINIMAX_CLOSE), DSML: (DSML_OPEN, DSML_CLOSE, DSML_MARK),
           DSV4: (DSV4_OPEN, DSV4_CLOSE, DSV41_OPEN, DSV41_CLOSE, DSML_MARK),
           DSV3: (CALLS_OPEN, CALLS_CLOSE, CALL_OPEN, CALL_CLOSE, CALL_SEP), KIMI: KIMI_TAGS,
           KIMI_K3: (K3_OPEN, K3_CLOSE, K3_SEP), MINIMAX_M3: (M3_NS, OPEN, CLOSE),
           MISTRAL: (MISTRAL_CALLS, MISTRAL_ARGS), LFM2: (LFM2_OPEN, LFM2_CLOSE),
           GEMMA4: (GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE)}
"""The tags each call format is read by (gpt-oss's: :data:`~.reasoning.MARKERS`); DeepSeek's DSML
mark is one special token of its vocabulary, which the text must hold for its tags to be read."""


ENDS_THINKING = {DSML: (DSML_OPEN,), DSV4: (DSV4_OPEN, DSV41_OPEN), KIMI: (KIMI_TAGS[0], KIMI_TAGS[2]),
                 KIMI_K3: (k3_open("tools"),)}
"""Tags that end a thinking block never closed, per call format: the block of calls beginning
(llama.cpp's DeepSeek DSML and Kimi K2 parsers end the reasoning there; the calls follow; Kimi K3's
too here, where llama.cpp's parser would keep the calls in the reasoning)."""


def call_format(template: str | None) -> str | None:
    """The call format the chat ``template`` teaches (module docstring): :data:`HERMES`,
    :data:`GLM`, :data:`QWEN_XML`, :data:`MINIMAX`, :data:`DSML`, :data:`DSV4`, :data:`DSV3`,
    :data:`KIMI`, :data:`KIMI_K3`, :data:`MINIMAX_M3`, :data:`MISTRAL`, :data:`LFM2` or
    :data:`GEMMA4`; :data:`HARMONY` where it teaches gpt-oss's calls (a message ``to=functions.NAME``
    on its channels: :class:`~.reasoning.HarmonyStream`); None. Formats whose templates hold another's
    marks too are told first (Kimi K3's and MiniMax-M3's hold ``<tool_call>``)."""
    if not template:
        return None
    if all(mark in template for mark in (K3_OPEN, K3_CLOSE, K3_END)):  # llama.cpp's test: unique to Kimi K3
        return KIMI_K3
    if all(mark in template for mark in (M3_NS, OPEN, '<invoke name=')):  # llama.cpp's: before <tool_call>'s
        return MINIMAX_M3
    if MINIMAX_OPEN in template:
        return MINIMAX
    if DSML_MARK in template:  # V3.2's and V4's templates spell their tags through a variable: the mark shows
        return DSML if "function_calls" in template else DSV4  # llama.cpp's test: V4 renamed the block
    if KIMI_TAGS[0] in template:
        return KIMI
    if MISTRAL_CALLS in template:
        return MISTRAL
    if LFM2_OPEN in template:
        return LFM2
    if GEMMA4_OPEN + "call:" in template:
        return GEMMA4
    if OPEN in template:
        if "<function=" in template and "<parameter=" in template:
            return QWEN_XML
        return GLM if "<arg_key>" in template else HERMES
    if CALLS_OPEN in template and CALL_SEP in template:
        return DSV3
    if "<|channel|>" in template and "<|message|>" in template and "to=" in template:
        return HARMONY
    return None


ID_CHARACTERS = string.ascii_letters + string.digits


def new_call_id(fmt: str | None) -> str:
    """A new tool call's id: 9 random letters and digits for Mistral's format (its templates refuse
    any other id), else OpenAI's shape, ``call_`` and 24 hexadecimal digits."""
    if fmt == MISTRAL:
        return "".join(secrets.choice(ID_CHARACTERS) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def function_call(name, arguments, names, call_id: str | None = None) -> dict | None:
    """The OpenAI tool call of ``name`` with ``arguments`` (an object, or its JSON text), its id
    ``call_id`` or a new one, or None where ``name`` is not among ``names`` or the arguments are not
    a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not (isinstance(name, str) and name in names and isinstance(arguments, dict)):
        return None
    return {"id": call_id or new_call_id(None), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _hermes_calls(block: str, tools: dict) -> list[dict] | None:
    """The call a Hermes block's inner text holds, or None where it is not a valid one."""
    try:
        obj = json.loads(block.strip())
    except (ValueError, RecursionError):
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("arguments"), dict)):  # an object, not its text
        return None
    call = function_call(obj.get("name"), obj["arguments"], tools)
    return None if call is None else [call]


def _parameters(tools: dict, name: str) -> dict:
    """Tool ``name``'s parameters' JSON schema (``tools``: name -> it), ``{}`` where it gives none."""
    schema = tools.get(name)
    return schema if isinstance(schema, dict) else {}


def _properties(tools: dict, name: str) -> dict:
    """The ``properties`` of tool ``name``'s parameters, ``{}`` where they give none."""
    properties = _parameters(tools, name).get("properties")
    return properties if isinstance(properties, dict) else {}


def _keyed_call(name: str, pairs: list[tuple[str, str, bool | None]], tools: dict) -> dict | None:
    """The call of ``name`` with its arguments written as ``(key, text, as_text)`` triples (GLM's and
    the XML formats'), each value the text as written where ``as_text`` is true, or, with ``as_text``
    None, where the tool's parameters (``tools``: name -> its parameters' JSON schema, or None) type
    the key a string; else its JSON when it parses. None where the name is no tool's or a key
    repeats."""
    if name not in tools:
        return None
    properties = _properties(tools, name)
    args = {}
    for key, value, as_text in pairs:
        if key in args:
            return None
        typed = properties.get(key)
        if as_text is None:
            as_text = isinstance(typed, dict) and typed.get("type") == "string"
        if not as_text:
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                pass  # not JSON: the text, as written
        args[key] = value
    return function_call(name, args, tools)


GLM_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_calls(block: str, tools: dict) -> list[dict] | None:
    """The call a GLM block's inner text holds (the name, then key-value pairs only), or None where
    it is not a valid one (:func:`_keyed_call`)."""
    at = block.find("<arg_key>")
    name, rest = (block, "") if at < 0 else (block[:at], block[at:])
    pairs, at = [], 0
    while at < len(rest):
        m = GLM_ARGUMENT.match(rest, at)
        if m is None:
            break
        pairs.append((m.group(1).strip(), m.group(2), None))
        at = m.end()
    if rest[at:].strip():
        return None
    call = _keyed_call(name.strip(), pairs, tools)
    return None if call is None else [call]


XML_FORMS = {QWEN_XML: ("<function=", ">", "</function>", "<parameter=", ">", None, "</parameter>"),
             MINIMAX: ('<invoke name="', '">', "</invoke>", '<parameter name="', '">', None, "</parameter>"),
             DSML: (f'<{DSML_MARK}invoke name="', '">', f"</{DSML_MARK}invoke>", f'<{DSML_MARK}parameter name="',
                    '" string="', '">', f"</{DSML_MARK}parameter>")}
"""Per XML format: the call's opening and the end of its name, its closing; a parameter's opening
and the end of its key, the end of its string mark (``true`` or ``false``; None: the format has
none), its closing."""
DSML_SPACED = (f'<{DSML_MARK} invoke name="', '">', f"</{DSML_MARK} invoke>", f'<{DSML_MARK} parameter name="',
               '" string="', '">', f"</{DSML_MARK} parameter>")
"""DeepSeek-V4.1's DSML: each keyword after a space (one token each, as its tokenizer writes them)."""


def _unframed(value: str) -> str:
    """An XML value less one newline at each end (the template's framing: ``>\\nVALUE\\n</``)."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _xml_calls(block: str, form: tuple, tools: dict) -> list[dict] | None:
    """The calls an XML block holds (``form``: :data:`XML_FORMS`): one or more calls with only white
    space around them, each its name, then its parameters with only white space around them (a
    name or key is the text to its end mark, a key without ``<``; a value the text to its closing,
    which it cannot hold); None where any is not a valid call (:func:`_keyed_call`)."""
    call_open, name_end, call_close, key_open, key_end, mark_end, value_close = form
    calls, rest = [], block.lstrip()
    while rest:
        if not rest.startswith(call_open):
            return None
        name, sep, rest = rest[len(call_open):].partition(name_end)
        if not sep:
            return None
        pairs = []
        while not (rest := rest.lstrip()).startswith(call_close):
            if not rest.startswith(key_open):
                return None
            key, sep, rest = rest[len(key_open):].partition(key_end)
            mark, marked, rest = rest.partition(mark_end) if mark_end else (None, True, rest)
            value, closed, rest = rest.partition(value_close)
            if not (sep and marked and closed) or "<" in key or mark not in (None, "true", "false"):
                return None
            pairs.append((key.strip(), _unframed(value), None if mark is None else mark == "true"))
        call = _keyed_call(name.strip(), pairs, tools)
        if call is None:
            return None
        calls.append(call)
        rest = rest[len(call_close):].lstrip()
    return calls or None


K3_CALL = re.compile(re.escape(K3_OPEN) + r'call tool="([^"<]*)"[^<]*?' + re.escape(K3_SEP))
K3_ARGUMENT = re.compile(re.escape(K3_OPEN) + r'argument key="([^"<]*)"(?: type="([^"<]*)")?[^<]*?' + re.escape(K3_SEP))
K3_CALL_END, K3_ARGUMENT_END = k3_close("call"), k3_close("argument")


def _k3_attribute(value: str) -> str:
    """An attribute's value as Kimi K3's template escapes it (``&quot;``, ``&amp;``), unescaped."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _k3_calls(block: str, tools: dict) -> list[dict] | None:
    """The calls of a Kimi K3 ``tools`` section: one or more ``call`` sections (``tool="NAME"``, any
    other attributes) with only white space around them, each of ``argument`` sections only
    (``key="KEY" type="TYPE"``, the value the text to its close). A value is the text as written
    where the tool's parameters type the key a string, JSON where they give it one other type, and
    else as the section's ``type`` says (``string``: the text; llama.cpp reads such a value as text);
    None where any is not a valid call (:func:`_keyed_call`)."""
    calls, at = [], _space(block, 0)
    while at < len(block):
        head = K3_CALL.match(block, at)
        if head is None:
            return None
        name, at = _k3_attribute(head.group(1)), _space(block, head.end())
        properties = _properties(tools, name)
        pairs = []
        while not block.startswith(K3_CALL_END, at):
            arg = K3_ARGUMENT.match(block, at)
            end = -1 if arg is None else block.find(K3_ARGUMENT_END, arg.end())
            if end < 0:
                return None
            key = _k3_attribute(arg.group(1))
            typed = isinstance(properties.get(key), dict) and isinstance(properties[key].get("type"), str)
            pairs.append((key, block[arg.end():end], None if typed else arg.group(2) == "string"))
            at = _space(block, end + len(K3_ARGUMENT_END))
        call = _keyed_call(name, pairs, tools)
        if call is None:
            return None
        calls.append(call)
        at = _space(block, at + len(K3_CALL_END))
    return calls or None


M3_INVOKE = re.compile(re.escape(M3_NS) + r'<invoke name="([^"<]*)">')
M3_KEY = re.compile(re.escape(M3_NS) + r"<([^<>/\s]+)>")
M3_DEPTH = 64
M3_STEPS = 100_000
"""Values a block's reading may try (alternatives are tried in order, and a schema of nested
alternatives could make that exponential): past it, the block is not a call."""
M3_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None), "object": dict,
            "array": list}


def m3_may_be_text(schema) -> bool:
    """Whether a value of ``schema`` may be a text (then MiniMax-M3's is the text as written):
    ``string`` among its types, a string alternative (``anyOf``, ``oneOf``), or nothing that says."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    if kind is None:
        if (alternatives := schema_alternatives(schema)) is not None:
            return any(m3_may_be_text(a) for a in alternatives)
        return not any(k in schema for k in ("properties", "items", "enum", "const"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def schema_alternatives(schema: dict) -> list | None:
    """A schema's ``anyOf`` (else its ``oneOf``) list, or None."""
    alternatives = schema.get("anyOf", schema.get("oneOf"))
    return alternatives if isinstance(alternatives, list) else None


def _m3_value(text: str, at: int, schema, close: str, depth: int, steps: list) -> tuple[object, int]:
    """A MiniMax-M3 value of ``schema`` at ``text[at]`` and where its ``close`` ends; ``ValueError``
    where none is. A text where the schema allows one (:func:`m3_may_be_text`): as written, to its
    close; alternatives tried in order; an object with properties: its members (:func:`_m3_members`);
    an array: ``<item>`` elements; anything else: JSON of the schema's type (a finite number).
    ``depth``: the elements around it (at most :data:`M3_DEPTH`); ``steps``: ``[values left to try]``
    (:data:`M3_STEPS`), shared by the block."""
    steps[0] -= 1
    if depth > M3_DEPTH or steps[0] < 0:
        raise ValueError("nested too deep, or too many alternatives")
    schema = schema if isinstance(schema, dict) else {}
    if m3_may_be_text(schema):
        end = text.find(close, at)
        if end < 0:
            raise ValueError("not closed")
        return text[at:end], end + len(close)
    if schema.get("type") is None and (alternatives := schema_alternatives(schema)) is not None:
        for alternative in alternatives:
            try:
                return _m3_value(text, at, alternative, close, depth, steps)
            except ValueError:
                continue
        raise ValueError("no alternative")
    if schema.get("type") == "object" and isinstance(schema.get("properties"), dict):
        return _m3_members(text, at, schema, close, depth, steps)
    if schema.get("type") == "array":
        items = []
        while not text.startswith(close, at := _space(text, at)):
            if not text.startswith(M3_ITEM, at):
                raise ValueError("not an item")
            item, at = _m3_value(text, at + len(M3_ITEM), schema.get("items"), M3_ITEM_END, depth + 1, steps)
            items.append(item)
        return items, at + len(close)
    end = text.find(close, at)
    if end < 0:
        raise ValueError("not closed")
    value = json.loads(text[at:end], parse_constant=_no_constant)  # ValueError where it is not JSON
    kinds = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if not any(_m3_typed(value, kind) for kind in kinds):
        raise ValueError("not of the schema's type")
    return value, end + len(close)


def _m3_typed(value, kind) -> bool:
    """Whether JSON ``value`` is of JSON-schema type ``kind`` (None: any; a kind that is no type's
    name, of a client's schema, is none)."""
    if kind is None:
        return True
    if not isinstance(kind, str) or kind not in M3_TYPES or (kind in ("integer", "number") and isinstance(value, bool)):
        return False
    return isinstance(value, M3_TYPES[kind])


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON number")


def _m3_members(text: str, at: int, schema: dict, close: str, depth: int, steps: list) -> tuple[dict, int]:
    """The members of an object (``schema``'s properties; any key, each a text, where it has none) to
    ``close``, each ``NS<KEY>VALUE NS</KEY>`` with white space around it, each key once, every
    ``required`` key there (llama.cpp's grammar asks them first in the schema's order; any order here)."""
    properties = schema.get("properties")
    out: dict = {}
    while not text.startswith(close, at := _space(text, at)):
        m = M3_KEY.match(text, at)
        if m is None or m.group(1) in out or (isinstance(properties, dict) and m.group(1) not in properties):
            raise ValueError("not a member")
        key = m.group(1)
        sub = properties[key] if isinstance(properties, dict) else {}
        out[key], at = _m3_value(text, m.end(), sub, f"{M3_NS}</{key}>", depth + 1, steps)
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if any(isinstance(key, str) and key not in out for key in required):
        raise ValueError("a required member missing")
    return out, at + len(close)


def _m3_calls(block: str, tools: dict) -> list[dict] | None:
    """The calls of a MiniMax-M3 block: one or more ``NS<invoke name="NAME">`` ... ``NS</invoke>``
    with white space around them, each the members of the tool's parameters (:func:`_m3_members`);
    None where any is not a valid call."""
    calls, at, steps = [], _space(block, 0), [M3_STEPS]
    try:
        while at < len(block):
            m = M3_INVOKE.match(block, at)
            if m is None or m.group(1) not in tools:
                return None
            args, at = _m3_members(block, m.end(), _parameters(tools, m.group(1)), M3_INVOKE_END, 0, steps)
            calls.append(function_call(m.group(1), args, tools))
            at = _space(block, at)
    except (ValueError, RecursionError):
        return None
    return calls or None


def _sections(block: str, open_: str, close: str) -> list[str] | None:
    """The inner texts of a block made of ``open_ ... close`` sections with only white space around
    them (at least one); None otherwise."""
    inner, rest = [], block.strip()
    while rest:
        if not rest.startswith(open_) or close not in rest:
            return None
        text, rest = rest[len(open_):].split(close, 1)
        inner.append(text)
        rest = rest.lstrip()
    return inner or None


DSV3_FENCED = re.compile(r"\s*```json\n(.*)\n```\s*", re.S)


def _deepseek_call(inner: str, tools: dict) -> dict | None:
    """The call one DeepSeek section holds: V3's and R1's ``function<｜tool▁sep｜>NAME`` and its
    arguments in a fenced json block, or V3.1's ``NAME<｜tool▁sep｜>ARGUMENTS``; None."""
    kind, sep, tail = inner.partition(CALL_SEP)
    if not sep:
        return None
    if kind.strip() == "function":  # V3, R1
        name, _, fenced = tail.partition("\n")
        m = DSV3_FENCED.fullmatch(fenced)
        return function_call(name.strip(), m.group(1), tools) if m else None
    return function_call(kind.strip(), tail, tools)  # V3.1


KIMI_ID = re.compile(r"functions\.(.+):[0-9]+")


def _kimi_call(inner: str, tools: dict) -> dict | None:
    """The call one Kimi K2 section holds: ``functions.NAME:INDEX``, the id it is reported with,
    then ``<|tool_call_argument_begin|>`` and the JSON arguments; None."""
    ident, sep, arguments = inner.partition(KIMI_TAGS[4])
    m = KIMI_ID.fullmatch(ident.strip())
    return function_call(m.group(1), arguments, tools, call_id=ident.strip()) if sep and m else None


def _json_list(block: str) -> list | None:
    """The JSON array a block's text is, or None where it is not one."""
    try:
        items = json.loads(block)
    except (ValueError, RecursionError):
        return None
    return items if isinstance(items, list) else None


def _listed_calls(items: list, tools: dict, call_id: Callable[[dict], str | None] = lambda item: None
                  ) -> list[dict] | None:
    """The calls of a JSON array of objects, each a ``name`` and an object of ``arguments`` (Mistral's
    and LFM2's JSON; ``call_id``: an item's id, None for a new one); None where there are none or any
    is not a call."""
    calls = [function_call(x.get("name"), x["arguments"], tools, call_id=call_id(x))
             if isinstance(x, dict) and isinstance(x.get("arguments"), dict) else None for x in items]
    return calls if calls and None not in calls else None


def _mistral_id(item: dict) -> str:
    """A Mistral call's id: the model's own where it is 9 letters and digits, else a new one."""
    given = item.get("id")
    keep = isinstance(given, str) and len(given) == 9 and given.isascii() and given.isalnum()
    return given if keep else new_call_id(MISTRAL)


def _mistral_calls(block: str, tools: dict) -> list[dict] | None:
    """The calls of a Mistral block (the text after ``[TOOL_CALLS]``, to the end): a JSON array of
    objects with a ``name`` and an object of ``arguments`` (an ``id`` of 9 letters and digits kept),
    or one or more ``NAME[ARGS]ARGUMENTS``, each after its own ``[TOOL_CALLS]``; None."""
    items = _json_list(block)
    if items is not None:
        return _listed_calls(items, tools, _mistral_id)
    calls = []
    for part in block.split(MISTRAL_CALLS):
        name, sep, arguments = part.partition(MISTRAL_ARGS)
        calls.append(function_call(name.strip(), arguments, tools, call_id=new_call_id(MISTRAL)) if sep else None)
    return calls if None not in calls else None


def _python_value(node: ast.expr, source: str):
    """A keyword argument's value: a Python literal (a tuple as a list), or the JSON its source text
    holds (LFM2's template writes a mapping as JSON: ``true``, ``null``); a ``ValueError`` otherwise,
    or where it is not JSON's (a set, bytes, a complex or infinite number)."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        text = ast.get_source_segment(source, node)
        value = json.loads(text) if text is not None else None  # a ValueError where it is not JSON either
    value = _lists(value)
    json.dumps(value, allow_nan=False)  # a ValueError or TypeError where JSON cannot hold it
    return value


def _lists(value):
    """``value`` with its tuples as lists (JSON's arrays) and each text's surrogate pairs joined (a
    Python literal's ``\\ud83d\\ude00`` is two code points where JSON reads one character); a
    ``ValueError`` for a mapping with a key that is not text (JSON would make it text without a word)."""
    if isinstance(value, str):
        return _joined(value)
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("a key that is not text")
        return {_joined(k): _lists(v) for k, v in value.items()}
    return value


SURROGATE = re.compile("[\ud800-\udfff]")


def _joined(text: str) -> str:
    """``text`` with each surrogate pair one character, as JSON reads the pair's escapes (a lone
    surrogate stays: the server's answer writes it as its escape)."""
    if not SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _pythonic_calls(block: str, tools: dict) -> list[dict] | None:
    """The calls of an LFM2 block: a Python list of calls ``NAME(KEY=VALUE, ...)`` (keywords only,
    each key once, values :func:`_python_value`), parsed by Python's parser and never run, or a JSON
    array of objects with a ``name`` and an object of ``arguments``; None."""
    items = _json_list(block)
    if items is not None:
        return _listed_calls(items, tools)
    source = block.strip()
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not (isinstance(tree, ast.List) and tree.elts):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            args = {k.arg: _python_value(k.value, source) for k in node.keywords}
        except (ValueError, TypeError, RecursionError):
            return None
        if len(args) != len(node.keywords):
            return None
        calls.append(function_call(node.func.id, args, tools))
    return calls if None not in calls else None


JSON_SPACE = " \t\n\r"
GEMMA4_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
GEMMA4_KEY = re.compile(r'[^ \t\n\r:{}\[\],"<]+')
GEMMA4_DEPTH = 64
"""Objects and arrays within one another that a Gemma 4 call may hold (deeper: not a call)."""


def _space(text: str, at: int) -> int:
    """Where the JSON white space beginning at ``at`` ends."""
    while at < len(text) and text[at] in JSON_SPACE:
        at += 1
    return at


def _quoted(text: str, at: int) -> tuple[str, int]:
    """The text between the ``<|"|>`` mark at ``at`` and the next one, and where that one ends."""
    end = text.find(GEMMA4_QUOTE, at + len(GEMMA4_QUOTE))
    if end < 0:
        raise ValueError("a text never closed")
    return text[at + len(GEMMA4_QUOTE):end], end + len(GEMMA4_QUOTE)


def gemma4_value(text: str, at: int = 0, depth: int = 0) -> tuple[object, int]:
    """The Gemma 4 value beginning at ``text[at]`` (after JSON white space) and where it ends; a
    ``ValueError`` where none does. A value: a text between ``<|"|>`` marks, as written; a JSON number
    (finite), ``true``, ``false`` or ``null``; ``[`` values ``]`` or ``{`` members ``}``, separated by
    commas, white space around each; a member: a key, ``:``, a value, the key bare (characters other
    than white space and ``:{}[],"<``) or between ``<|"|>`` marks, each key once; at most
    :data:`GEMMA4_DEPTH` levels."""
    at = _space(text, at)
    if text.startswith(GEMMA4_QUOTE, at):
        return _quoted(text, at)
    if text.startswith(("{", "["), at):
        if depth >= GEMMA4_DEPTH:
            raise ValueError("nested too deep")
        close, out = ("}", {}) if text[at] == "{" else ("]", [])
        at = _space(text, at + 1)
        if text.startswith(close, at):
            return out, at + 1
        while True:
            if close == "]":
                value, at = gemma4_value(text, at, depth + 1)
                out.append(value)
            else:
                if text.startswith(GEMMA4_QUOTE, at):
                    key, at = _quoted(text, at)
                else:
                    m = GEMMA4_KEY.match(text, at)
                    if m is None:
                        raise ValueError("no key")
                    key, at = m.group(), m.end()
                at = _space(text, at)
                if key in out or not text.startswith(":", at):
                    raise ValueError("a key twice, or no colon")
                out[key], at = gemma4_value(text, at + 1, depth + 1)
            at = _space(text, at)
            if text.startswith(close, at):
                return out, at + 1
            if not text.startswith(",", at):
                raise ValueError("no comma")
            at = _space(text, at + 1)
    m = GEMMA4_SCALAR.match(text, at)
    if m is None:
        raise ValueError("no value")
    value = json.loads(m.group())
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a number JSON cannot hold")
    return value, m.end()


def _gemma4_calls(block: str, tools: dict) -> list[dict] | None:
    """The call a Gemma 4 block holds: ``call:NAME`` and an object of arguments
    (:func:`gemma4_value`), white space around it; None where it is not a valid one."""
    inner = block.strip()
    name, brace, _ = inner[len("call:"):].partition("{")
    if not (inner.startswith("call:") and brace):
        return None
    try:
        args, end = gemma4_value(inner, len("call:") + len(name))
    except (ValueError, RecursionError):
        return None
    call = function_call(name, args, tools) if end == len(inner) else None
    return None if call is None else [call]


def gemma4_tool_responses(messages: list[dict]) -> list[dict]:
    """``messages`` as Gemma 4's first templates take a tool round trip, as llama.cpp's server passes
    them (its ``convert_tool_responses_gemma4``): an assistant message with ``tool_calls``, the
    ``tool`` messages after it and an assistant message of content only after those, one assistant
    message with ``tool_responses`` (each ``{"name": the call's name in order, else the message's
    tool_call_id, "response": its content's JSON where it parses, else the content}``; the content of
    the message with the calls is not carried, as llama.cpp's is not). Those templates render no
    ``tool`` role; the later one (:data:`GEMMA4_TOOL_ROLE`) takes both."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        calls = m["tool_calls"]
        turn = {"role": "assistant", "tool_calls": calls}
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        responses = []
        while i < len(messages) and messages[i].get("role") == "tool":
            result, content = messages[i], messages[i].get("content")
            try:
                response = json.loads(content) if isinstance(content, str) else content
            except (ValueError, RecursionError):
                response = content
            name = calls[len(responses)].get("function", {}).get("name") if len(responses) < len(calls) else None
            responses.append({"name": name or result.get("tool_call_id", ""), "response": response})
            i += 1
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i].get("role") == "assistant" and not messages[i].get("tool_calls") \
                and messages[i].get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        out.append(turn)
    return out


def results_in_call_order(messages: list[dict]) -> list[dict]:
    """``messages`` with the tool results of each run of user and tool messages put in the order of the
    calls they answer (those of the last assistant message with calls, matched by ``tool_call_id``; a
    result that answers none as the first call's; ties as they came), the other messages where they
    were: DeepSeek-V4's reference encoder renders a run's results in call order, and llama.cpp's
    server passes them so (``deepseek_v4_sort_tool_results``)."""
    out, order, i = list(messages), {}, 0
    while i < len(out):
        role = out[i].get("role")
        if role == "assistant" and out[i].get("tool_calls"):
            order = {c.get("id"): n for n, c in enumerate(out[i]["tool_calls"]) if c.get("id")}
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(out) and out[end].get("role") in ("user", "tool"):
            end += 1
        at = [j for j in range(i, end) if out[j].get("role") == "tool"]
        if len(at) > 1 and order:
            for j, m in zip(at, sorted((out[j] for j in at), key=lambda m: order.get(m.get("tool_call_id"), 0))):
                out[j] = m
        i = end
    return out


GEMMA4_REOPEN = ("<turn|>\n", "<|turn>model\n")
"""A Gemma 4 prompt ending in the first (an assistant message with content beside its calls and
their results: the template closes the turn and opens none) is given the second, as llama.cpp's
server does: the model answers in a turn of its own."""
GEMMA4_TOOL_ROLE = "{#- OpenAI Chat Completions:"
"""What the Gemma 4 template that renders ``tool`` messages itself holds (llama.cpp tells the two
apart by it); a Gemma 4 template without it is given :func:`gemma4_tool_responses`."""


def _each(sections: list[str] | None, read: Callable, tools: dict) -> list[dict] | None:
    """Each section read into its call (``read``), or None where there are none or any is not a call."""
    calls = [read(inner, tools) for inner in sections or ()]
    return calls if calls and None not in calls else None


READERS = {
    HERMES: _hermes_calls,
    GLM: _glm_calls,
    QWEN_XML: lambda block, tools: _xml_calls(block, XML_FORMS[QWEN_XML], tools),
    MINIMAX: lambda block, tools: _xml_calls(block, XML_FORMS[MINIMAX], tools),
    DSML: lambda block, tools: _xml_calls(block, XML_FORMS[DSML], tools),
    DSV4: lambda block, tools: _xml_calls(block, XML_FORMS[DSML], tools) or _xml_calls(block, DSML_SPACED, tools),
    DSV3: lambda block, tools: _each(_sections(block, CALL_OPEN, CALL_CLOSE), _deepseek_call, tools),
    KIMI: lambda block, tools: _each(_sections(block, KIMI_TAGS[2], KIMI_TAGS[3]), _kimi_call, tools),
    KIMI_K3: _k3_calls,
    MINIMAX_M3: _m3_calls,
    MISTRAL: _mistral_calls,
    LFM2: _pythonic_calls,
    GEMMA4: _gemma4_calls,
}
"""Per call format: a block's inner text and the tools (name -> parameters' schema) -> its calls, or None."""


def reader(fmt: str, tools) -> Callable[[str], list[dict] | None]:
    """The block reader of call format ``fmt`` (:data:`READERS`) for ``tools`` (``(name,
    parameters)`` pairs): a block's inner text -> its calls, or None."""
    tools, read = dict(tools), READERS[fmt]
    return lambda block: read(block, tools)


class TaggedCalls:
    """Text in, in pieces; out, content pieces and complete calls (:meth:`feed`, :meth:`finish`:
    lists of ``("content", text)`` and ``("call", call)``) of call format ``fmt`` for ``tools``
    (:func:`reader`): each block between the format's tags (:data:`TAGS`, or other spellings of them:
    :data:`ALTERNATIVES`) read once it closes (at the end of the text where the format has no
    closing tag). Per piece the work is bounded by the piece and the tags, not by the text so far nor by the open
    block (a call that writes a file grows one block over thousands of pieces); a block is joined
    and read once, when its close arrives."""

    def __init__(self, fmt: str, tools):
        self.read = reader(fmt, tools)
        self.pairs = (TAGS[fmt],) + ALTERNATIVES.get(fmt, ())  # the block's tags, and other spellings of them
        self.open, self.close = TAGS[fmt]  # the open block's (the first pair's until a block opens)
        self.pending = ""  # content held back: it could begin the open tag
        self.inside = False
        self.parts: list[str] = []  # the open block's text, as it came
        self.tail = ""  # the open block's last len(close) - 1 characters: a close may begin in them
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        text = piece
        while True:
            if self.inside:
                if self.close is None:  # the block runs to the end of the text
                    self.parts.append(text)
                    return out
                window = self.tail + text  # a close that ends in this piece begins in the window
                end = window.find(self.close)
                if end < 0:
                    self.parts.append(text)
                    self.tail = window[max(0, len(window) - len(self.close) + 1):]
                    return out
                whole = "".join(self.parts) + text
                at = len(whole) - len(window) + end  # where the close begins in the block's text
                block, text = whole[:at], whole[at + len(self.close):]
                self.inside, self.parts, self.tail = False, [], ""
                out += self._read(block, self.close)
                continue
            text, self.pending = self.pending + text, ""
            found = [(at, pair) for pair in self.pairs if (at := text.find(pair[0])) >= 0]
            if found:
                start, (self.open, self.close) = min(found, key=lambda x: x[0])
                if start:
                    out.append(("content", text[:start]))
                text, self.inside = text[start + len(self.open):], True
                continue
            keep = held_back(text, [pair[0] for pair in self.pairs])
            text, self.pending = text[:len(text) - keep], text[len(text) - keep:]
            if text:
                out.append(("content", text))
            return out

    def _read(self, block: str, close: str) -> list[tuple[str, object]]:
        """A block's calls, or its text as content, as written, where it is not a call after all."""
        calls = self.read(block)
        if calls is None:
            return [("content", self.open + block + close)]
        self.calls += len(calls)
        return [("call", call) for call in calls]

    def finish(self) -> list[tuple[str, object]]:
        """What is left at the end: held-back content, or an open block: read where the format has
        no closing tag, else its text as content."""
        if self.inside and self.close is None:
            out = self._read("".join(self.parts), "")
            self.inside, self.parts = False, []
            return out
        text = (self.open + "".join(self.parts) if self.inside else "") + self.pending
        self.pending, self.inside, self.parts, self.tail = "", False, [], ""
        return [("content", text)] if text else []


def read_whole(stream, text: str) -> tuple[str, str | None, list[dict]]:
    """``(reasoning, content, calls)`` of a whole text read by ``stream`` (a :class:`TaggedCalls`, or
    a :mod:`.reasoning` stream): its parts joined by kind, the content None where only white space is
    left beside calls."""
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(x for kind, x in parts if kind == "reasoning")
    content = "".join(x for kind, x in parts if kind == "content")
    calls = [x for kind, x in parts if kind == "call"]
    return reasoning, (None if calls and not content.strip() else content), calls


def parse_tagged(text: str, fmt: str, tools) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole text (:class:`TaggedCalls`): the valid blocks as calls, the
    rest as content (None where only whitespace is left once calls were found)."""
    _, content, calls = read_whole(TaggedCalls(fmt, tools), text)
    return content, calls
