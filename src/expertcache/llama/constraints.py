"""What a request may constrain its sampling with besides temperature and top-p (docs/serve.md,
"Structured output and logit_bias"): a grammar made from OpenAI's ``response_format`` by
llama-cpp-python's JSON-schema converter, and ``logit_bias``. Both reach llama.cpp's sampler
through llama-cpp-python's own seams (``Llama.generate``'s ``grammar`` and ``logits_processor``);
:class:`GrammarFirst` applies the grammar as llama.cpp's own sampler does.

Invariants:

* **The text is JSON and keeps to every keyword of the schema, or the request is refused.** The
  converter ignores without a word what it has no grammar for (:func:`held_schema` refuses it,
  naming it), lets a string hold a control character unescaped (:func:`strict_strings`), and makes
  a pattern's ``.`` write a quote or a newline and its ``\\d`` a grammar llama.cpp refuses
  (:func:`json_safe_pattern`).

* **A grammar llama.cpp refuses never reaches the sampler chain.** llama-cpp-python adds the
  sampler ``llama_sampler_init_grammar`` returns to its chain unchecked; for a grammar llama.cpp
  refuses that is a null pointer and the process dies (``root ::= ("" | "a")*``: SIGSEGV).
  :func:`response_grammar` makes the sampler once itself and refuses the grammar where it is null.
* **Bounded memory for any schema.** llama-cpp-python's JSON-schema converter writes a repetition
  out in full: ``{"pattern": "^a{1000000000}$"}`` made a 1 GB grammar (2.9 GB resident, 4 s) and
  ``{"minLength": 1000000000}`` a MemoryError. :func:`expansion` bounds the text a schema's
  repetitions can write (patterns parsed for their quantifiers, nested ones multiplied) before
  anything is converted, and the grammar's length is checked after.
* A schema the converter cannot take (a remote ``$ref``: it fetches nothing; an unknown type; a
  nesting deeper than Python's recursion limit) is a :class:`ConstraintError` naming why.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys

import numpy as np

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar, json_schema_to_gbnf

MAX_GRAMMAR_CHARS = 4 << 20
"""The longest grammar text a schema may make (estimated by :func:`expansion` before converting,
then measured): four times the largest request body."""
REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
"""Schema keywords the converter writes out as that many copies of an item."""
MAX_BIAS = 100.0
"""OpenAI's range of a ``logit_bias`` value: [-100, 100]."""


class ConstraintError(ValueError):
    """A ``response_format`` or ``logit_bias`` this server cannot sample with; ``param`` is the request's
    field, which the message follows (the server writes ``param: message``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def response_grammar(fmt: dict | None, vocab) -> LlamaGrammar | None:
    """The grammar of an OpenAI ``response_format`` (``{"type": "text"}``: None; ``json_object``: any
    JSON value that is an object, llama.cpp's JSON grammar, or the ``schema`` llama-cpp-python's
    server takes beside it; ``json_schema``: its ``json_schema.schema``), checked by llama.cpp
    against the model's ``vocab`` (module docstring). Raises :class:`ConstraintError`."""
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ConstraintError("json_schema.schema: a JSON schema is required", "response_format")
    else:
        schema = fmt.get("schema")
    return checked_grammar(JSON_GBNF if schema is None else schema_text(schema), vocab)


def hoisted(schemas: list) -> tuple[list[dict | None], dict]:
    """``schemas`` (tools' parameters; None: none) without their ``$defs`` and ``definitions``, and
    those gathered for the root of one grammar: a ``"#/$defs/X"`` is read from the root, so every
    tool's definitions go there. Two tools defining one name differently is a :class:`ConstraintError`."""
    out, defs = [], {}
    for params in schemas:
        params = dict(params) if isinstance(params, dict) else None
        for key in ("$defs", "definitions"):
            if params is None or not isinstance(params.get(key), dict):
                continue
            for def_name, definition in params.pop(key).items():
                if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise ConstraintError(f"two tools define {key}.{clipped(str(def_name), 40)} differently",
                                          "response_format")
        out.append(params)
    return out, defs


def tool_call_text(tools: list[tuple[str, dict | None]]) -> str:
    """The grammar text of one Hermes-format call (:mod:`.toolcalls`) to one of ``tools`` (``(name,
    parameters schema)``; None: an object with no properties): ``<tool_call>``, a newline, ``{"name":
    NAME, "arguments": ARGS}`` with ARGS held to that tool's schema, a newline, ``</tool_call>``."""
    params, defs = hoisted([p for _, p in tools])
    alternatives = [{"type": "object", "properties": {"name": {"const": name}, "arguments": p if p is not None else
                                                      {"type": "object", "properties": {}}},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for (name, _), p in zip(tools, params)]
    body = schema_text({**(alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}), **defs})
    # the converter's root is the call's JSON; no other rule names it (a "$ref": "#" is refused)
    body = "\n".join("call ::= " + line[len("root ::= "):] if line.startswith("root ::= ") else line
                     for line in body.split("\n"))
    return 'root ::= "<tool_call>\\n" call "\\n</tool_call>"\n' + body


def schema_text(schema) -> str:
    """The grammar text of a JSON ``schema``: held (:func:`held_schema`), bounded (:func:`expansion`),
    converted by llama-cpp-python, its strings strict (:func:`strict_strings`). Raises
    :class:`ConstraintError`."""
    if not isinstance(schema, dict):
        raise ConstraintError("the schema is not a JSON object", "response_format")
    schema = held_schema(schema)
    cost = expansion(schema)
    if cost > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"the schema's repetitions (minLength, maxItems, a pattern's "
                              f"{{m,n}}) would write a grammar of about {cost:,} characters, over "
                              f"{MAX_GRAMMAR_CHARS:,}", "response_format")
    try:
        text = strict_strings(json_schema_to_gbnf(json.dumps(schema)))
    except RecursionError:
        raise ConstraintError("the schema is nested too deeply to convert", "response_format") from None
    except Exception as exc:  # the converter's own refusals: AssertionError, ValueError, KeyError, ...
        raise ConstraintError(f"the schema cannot be made a grammar ({type(exc).__name__}: {str(exc)[:200]})",
                              "response_format") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"the schema makes a grammar of {len(text):,} characters, over "
                              f"{MAX_GRAMMAR_CHARS:,}", "response_format")
    return text


def checked_grammar(text: str, vocab) -> LlamaGrammar:
    """``text`` as a grammar once llama.cpp has made its sampler from it against ``vocab`` (its
    report of a grammar it cannot parse kept off stderr); a grammar it refuses is a
    :class:`ConstraintError`, never a null sampler in a chain."""
    grammar = LlamaGrammar.from_string(text, verbose=False)
    with grammar_dump_dropped(text.encode("utf-8")):
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), grammar._root.encode("utf-8"))
    if not sampler:
        raise ConstraintError("llama.cpp refuses the grammar made from the schema (a rule "
                              "that can repeat without reading anything, such as the pattern ^(|a)*$, or one "
                              "that calls itself first)", "response_format")
    llama_cpp.llama_sampler_free(sampler)
    return grammar


@contextlib.contextmanager
def grammar_dump_dropped(grammar: bytes):
    """File descriptor 2 into a memory file for the block; then what was written to it meanwhile (by
    any thread) is written back, less llama.cpp's report of a grammar it cannot parse, which it
    prints with ``fprintf`` (no log callback reaches it): its ``parse: error parsing grammar`` line
    and the grammar, quoted from where the parse failed and then whole (a line of another thread's
    that is a line of the grammar is dropped too), up to :data:`MAX_GRAMMAR_CHARS` a request. :func:`held_schema` keeps
    the converter from making such a grammar (none in 20,000 generated schemas and 10,000 hypothesis
    JSON values); this is the guard
    for what it does not foresee."""
    sys.stderr.flush()
    saved = os.dup(2)
    buf = os.memfd_create("expertcache-grammar-stderr")
    os.dup2(buf, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        size = os.lseek(buf, 0, os.SEEK_END)
        data = os.pread(buf, size, 0) if size else b""
        os.close(buf)
        if data:  # its report quotes the grammar from where the parse failed, then the whole grammar
            ours = set(grammar.split(b"\n"))
            kept = [line for line in data.replace(grammar, b"").split(b"\n")
                    if line.strip() and line not in ours and not line.startswith(b"parse: error parsing grammar")]
            if kept:
                os.write(2, b"\n".join(kept) + b"\n")


ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$anchor", "$comment", "default", "examples",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
"""Keywords that constrain nothing (``$defs`` and ``definitions`` hold schemas a ``$ref`` names)."""
HELD = {"ref": {"$ref"}, "union": {"oneOf", "anyOf"}, "types": {"type"}, "const": {"const", "type"},
        "enum": {"enum", "type"}, "object": {"type", "properties", "required", "additionalProperties"},
        "array": {"type", "items", "minItems", "maxItems"}, "tuple": {"type", "items", "prefixItems"},
        "pattern": {"type", "pattern"}, "format": {"type", "format"}, "string": {"type", "minLength", "maxLength"},
        "any": {"type", "additionalProperties"}, "primitive": {"type"}}
"""Per kind of schema node, the keywords llama-cpp-python's converter turns into grammar (it takes the
first kind that matches, in :func:`node_kind`'s order, and ignores the rest of the node; ``oneOf`` it
reads as ``anyOf``; ``type`` beside ``const`` or ``enum`` changes nothing, the values being given)."""
FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
"""The string formats the converter has a grammar for."""


def node_kind(node: dict) -> str:
    """Which of :data:`HELD`'s kinds the converter makes of a schema node (its ``visit``'s order)."""
    kind = node.get("type")
    if "$ref" in node:
        return "ref"
    if "oneOf" in node or "anyOf" in node:
        return "union"
    if isinstance(kind, list):
        return "types"
    if "const" in node:
        return "const"
    if "enum" in node:
        return "enum"
    if kind in (None, "object") and ("properties" in node or node.get("additionalProperties", True) is not True):
        return "object"
    if kind in (None, "array") and ("items" in node or "prefixItems" in node):
        return "tuple" if isinstance(node.get("items") or node.get("prefixItems"), list) else "array"
    if kind in (None, "string") and "pattern" in node:
        return "pattern"
    if kind in (None, "string") and "format" in node:
        return "format"
    if kind == "string" and ("minLength" in node or "maxLength" in node):
        return "string"
    if kind == "object" or not node:
        return "any"
    return "primitive"


def clipped(message: str, most: int = 300) -> str:
    """``message`` cut to ``most`` characters: a path through a schema is made of the request's own
    keys, which may be long."""
    return message if len(message) <= most else message[:most - 3] + "..."


def held_schema(schema: dict) -> dict:
    """A copy of ``schema`` whose every ``pattern`` is :func:`json_safe_pattern`'s, once every
    keyword is found held by the grammar; else a :class:`ConstraintError` naming the first that is
    not. llama-cpp-python's converter ignores, without a word, a keyword it has no grammar for
    (``maximum``: an integer of 16 digits came out of ``{"maximum": 99}``) and the rest of a node
    once it has picked its kind (``minLength`` beside ``pattern``); ``allOf`` it reads as a union of
    optional properties; a ``format`` it does not know it leaves out. Walked without recursion,
    through every place a schema can stand."""
    try:
        schema = json.loads(json.dumps(schema))
    except RecursionError:
        raise ConstraintError("the schema is nested too deeply", "response_format") from None

    def refuse(where: str, why: str):
        raise ConstraintError(f"{clipped(where, 120)}: {clipped(why, 200)}", "response_format")

    def literal(where: str, value) -> None:  # a const, an enum's value, a property's name
        if "\\" in json.dumps(value, ensure_ascii=False):
            refuse(where, f"{clipped(repr(value), 40)} holds a quote, a backslash or a control character, which "
                   "the converter writes wrongly (a grammar llama.cpp cannot read, or a raw newline in the JSON)")

    stack = [(schema, "schema")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node_kind(node)
        extra = sorted(set(node) - ANNOTATIONS - HELD[kind])
        if extra:
            beside = sorted(HELD[kind] & set(node) - {"type"})
            refuse(where, f"{clipped(extra[0], 64)} is not held by the grammar"
                   + (f" beside {beside[0]}" if beside and any(extra[0] in held for held in HELD.values()) else ""))
        if kind == "format" and node["format"] not in FORMATS:
            refuse(where, f"format {str(node['format'])[:40]!r} has no grammar (only {', '.join(FORMATS[:4])}...)")
        if kind == "tuple" and "items" in node and "prefixItems" in node:
            refuse(where, "items beside prefixItems is not held by the grammar")
        if kind == "pattern" and isinstance(node["pattern"], str):
            node["pattern"] = json_safe_pattern(node["pattern"], f"{where}.pattern")
        if kind == "enum" and not (isinstance(node["enum"], list) and node["enum"]):
            refuse(where, "enum: an empty enum admits no value (and makes a grammar llama.cpp cannot read)")
        if kind == "union" and not (isinstance(node.get("anyOf", node.get("oneOf")), list)
                                    and node.get("anyOf", node.get("oneOf"))):
            refuse(where, "anyOf / oneOf: an empty union admits no value (and makes a grammar llama.cpp cannot read)")
        if kind == "types" and not node["type"]:
            refuse(where, "type: an empty list of types admits no value (and makes a grammar llama.cpp cannot read)")
        for value in ([node["const"]] if kind == "const" else node["enum"] if kind == "enum" else []):
            literal(where, value)
        if kind == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            for name in props:
                literal(f"{where}.properties", name)
            required = node.get("required", [])
            if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
                refuse(where, "required: not a list of property names")
            missing = [r for r in required if r not in props]
            if missing:
                refuse(where, f"required: {clipped(str(missing[0]), 40)!r} is not among the properties (the "
                       "converter leaves such a name out)")
        children = []
        for key in ("$defs", "definitions", "properties"):
            if isinstance(node.get(key), dict):
                children += [(v, f"{where}.{key}.{k}") for k, v in node[key].items()]
        for key in ("oneOf", "anyOf", "items", "prefixItems"):
            value = node.get(key)
            if isinstance(value, list):
                children += [(v, f"{where}.{key}[{i}]") for i, v in enumerate(value)]
            elif isinstance(value, dict):
                children.append((value, f"{where}.{key}"))
        if isinstance(node.get("additionalProperties"), dict):
            children.append((node["additionalProperties"], f"{where}.additionalProperties"))
        stack.extend(reversed(children))
    return schema


JSON_UNSAFE = '"\\\\\\x00-\\x1F'
"""A class body of what a JSON string cannot hold unescaped: the quote, the backslash and the
control characters (U+0000-U+001F)."""
CLASS_ESCAPES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " "}
r"""A pattern's ``\d``, ``\w`` and ``\s`` as class bodies the grammar can hold: each a subset of what
Python's ``re`` matches (``\s``: the space alone; a tab or newline would have to be escaped in JSON)."""


def json_safe_pattern(pattern: str, where: str = "pattern") -> str:
    r"""``pattern`` rewritten so that the converter's grammar writes only what a JSON string holds
    unescaped, every string it matches still matching ``pattern``: ``.`` and a negated class lose the
    quote, the backslash and the control characters; ``\d``, ``\w`` and ``\s`` become classes
    (:data:`CLASS_ESCAPES`), an escaped punctuation character a class of its ``\xHH``. The
    converter passed ``\d`` through as a grammar escape llama.cpp refuses, and let ``.`` write a
    quote or a newline into the string (invalid JSON). Raises :class:`ConstraintError` where the
    pattern needs what the grammar cannot write: a quote, a backslash or a control character, or
    ``\D``, ``\b`` and the other escapes."""
    def refuse(why: str):
        raise ConstraintError(f"{clipped(where, 120)}: {clipped(why, 200)}", "response_format")

    def escape(c: str) -> str:
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in '"\\':
            refuse(f"the escape \\{c} is a character a JSON string must escape, which the grammar cannot write")
        if c.isascii() and not c.isalnum() and c.isprintable():
            return f"\\x{ord(c):02X}"
        refuse(f"the escape \\{c} is not held by the grammar (\\d, \\w, \\s and escaped punctuation are)")

    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n:
                refuse("it ends in a lone backslash")
            nxt = pattern[i + 1]
            out.append("\\" + nxt if nxt in "[]()|{}*+?" else f"[{escape(nxt)}]")  # the first: the converter's
            i += 2
        elif c == ".":
            out.append(f"[^{JSON_UNSAFE}]")
            i += 1
        elif c == "[":
            j, negated = i + 1, pattern.startswith("[^", i)
            j += negated
            body = []
            while j < n and (pattern[j] != "]" or (j == i + 1 + negated)):
                ch = pattern[j]
                if ch == "]":  # first in the class: a character, which the grammar must have escaped
                    body.append("\\x5D")
                    j += 1
                    continue
                if ch == "\\":
                    if j + 1 >= n:
                        refuse("a class ends in a lone backslash")
                    nxt = pattern[j + 1]
                    if negated and nxt in '"\\':
                        j += 2  # already left out
                        continue
                    body.append(escape(nxt) if nxt not in "]-^[" else f"\\x{ord(nxt):02X}")
                    j += 2
                    continue
                if not negated and (ch == '"' or ord(ch) < 0x20):
                    refuse(f"the class {pattern[i:i + 40]} holds {ch!r}, which a JSON string must escape")
                if ch == "-" and body and j + 1 < n and pattern[j + 1] != "]" and not negated:
                    lo, hi = body[-1], pattern[j + 1]
                    lo_code = int(lo[2:], 16) if lo.startswith("\\x") else ord(lo[-1])
                    if hi == "\\" or lo_code <= 0x5C <= ord(hi) or lo_code <= 0x22 <= ord(hi) or lo_code < 0x20:
                        refuse(f"the range {pattern[j - 1:j + 2]} holds a quote, a backslash or a control character, "
                               "which a JSON string must escape")
                body.append(ch)
                j += 1
            if j >= n:
                refuse("a class is not closed")
            out.append("[" + ("^" if negated else "") + "".join(body) + (JSON_UNSAFE if negated else "") + "]")
            i = j + 1
        elif c == '"' or ord(c) < 0x20:
            refuse(f"it holds {c!r}, which a JSON string must escape and the grammar cannot write")
        else:
            out.append(c)
            i += 1
    return "".join(out)


LOOSE_CHAR = 'char ::= [^"\\\\] | '
"""The start of the converter's rule for a string's character: it lets a control character through
unescaped (a newline sampled into a string made the text invalid JSON)."""


def strict_strings(grammar: str) -> str:
    """The converter's grammar with its string character rule holding what JSON allows: no control
    character unescaped (as llama.cpp's own JSON grammar, ``JSON_GBNF``, has it)."""
    lines = grammar.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(LOOSE_CHAR):
            lines[i] = f"char ::= [^{JSON_UNSAFE}] | " + line[len(LOOSE_CHAR):]
        elif line.startswith("char ::= "):  # another llama-cpp-python: its rule must be read again
            raise RuntimeError(f"llama-cpp-python's string character rule is not the one expertcache knows: {line[:80]}")
    return "\n".join(lines)


def expansion(schema) -> int:
    """An upper bound, in characters, of the grammar text the schema's repetitions make the
    converter write: each count of :data:`REPEAT_KEYS` (at least 1) times (the length of the path that names the
    item's rule + :data:`RULE_CHARS`), each ``pattern`` by :func:`pattern_expansion` with the same
    names. Walked without recursion; stops counting once over :data:`MAX_GRAMMAR_CHARS`."""
    total = 0
    stack = [(schema, 0)]
    while stack and total <= MAX_GRAMMAR_CHARS:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key in REPEAT_KEYS:
                n = node.get(key)
                if isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0:  # 0 writes a little
                    total += max(int(min(n, 1e12)), 1) * (path + RULE_CHARS)
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                total += pattern_expansion(pattern, path)
            for key, value in node.items():
                stack.append((value, path + len(str(key)) + 1))
        elif isinstance(node, list):
            stack.extend((value, path + 1) for value in node)
    return total


RULE_CHARS = 32
"""Characters a rule name adds to the path that names it, and the most a one-character atom of a
pattern becomes (``\\w``: ``[0-9A-Za-z_]``; ``.``: a class of its own)."""


def pattern_expansion(pattern: str, name_chars: int = 0) -> int:
    """An upper bound of the grammar text a regular expression becomes when every ``{m}``, ``{m,}``
    and ``{m,n}`` is written out as copies: each atom (a character, an escape, a class) costs its
    own length + ``name_chars`` + :data:`RULE_CHARS` (its text, or a reference to the rule made for
    it), a group its atoms plus a reference, and a counted quantifier multiplies what it follows by
    its largest count (nested ones multiply; ``*``, ``+`` and ``?`` are grammar operators and copy
    nothing)."""
    unit = name_chars + RULE_CHARS
    seqs = [0]  # the cost of the sequence open at each group depth
    last = 0  # the cost of the atom just read (what a quantifier copies)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(":
            seqs.append(0)
            i += 1
            continue
        if c == ")" and len(seqs) > 1:
            last = seqs.pop() + 2 + unit
            seqs[-1] += last
            i += 1
            continue
        if c == "{":
            j = pattern.find("}", i)
            counts = [part.strip() for part in pattern[i + 1:j].split(",")] if j > 0 else []
            if 1 <= len(counts) <= 2 and all(part.isdigit() or not part for part in counts) and any(counts):
                copies = max(int(part) for part in counts if part)
                seqs[-1] += last * (copies - 1) if copies else -last  # the atom was counted once
                last *= copies
                if seqs[-1] > MAX_GRAMMAR_CHARS:
                    return seqs[-1]
                i = j + 1
                continue
        j = i + 1
        if c == "\\":
            j = i + 2
        elif c == "[":
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            j += 1
        last = min(j, n) - i + unit
        seqs[-1] += last
        i = j
    return sum(seqs)


def logit_bias(bias: dict[str, float] | None, n_vocab: int) -> llama_cpp.LogitsProcessorList | None:
    """OpenAI's ``logit_bias`` (token id as a decimal string -> a value in [-100, 100] added to that
    token's logit before any other sampling step) as a logits processor of llama-cpp-python's
    chain, or None for none. An id that is not the decimal spelling of a token of the vocabulary
    (``"05"`` and ``" 5"`` are not: two keys could then name one token), or a value out of range or
    not finite, is a :class:`ConstraintError`."""
    if not bias:
        return None
    ids = np.empty(len(bias), dtype=np.intp)
    values = np.empty(len(bias), dtype=np.float32)
    for i, (key, value) in enumerate(bias.items()):
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and key == str(int(key)) and int(key) < n_vocab):
            raise ConstraintError(f"{key[:40]!r} is not a token id of this model's vocabulary [0, {n_vocab})",
                                  "logit_bias")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise ConstraintError(f"{key}: {value} is outside [-100, 100]", "logit_bias")
        ids[i], values[i] = int(key), value

    def add_bias(_input_ids, scores):  # the chain's first step: scores are the logits in token id order
        scores[ids] += values
        return scores

    return llama_cpp.LogitsProcessorList([add_bias])


class GrammarFirst:
    """Sampling under a grammar as llama.cpp's own sampler does it (``common_sampler_sample``):
    the token is drawn by the chain without the grammar, then the grammar checks that one token;
    only where it refuses are the grammar and the chain applied to the whole vocabulary. The
    grammar then accepts the token, as the chain does.

    With the grammar in the chain, as llama-cpp-python puts it, llama.cpp matches every token of the
    vocabulary against the grammar at every step: 33-52 ms a token against 7.5 without a grammar,
    for a vocabulary of 151,936 on this machine (``benchmarks/grammar_cost.py``, docs/serve.md). The token drawn is the same in law: for an allowed ``t``,
    ``P(t) + (1 - Z) P(t) / Z = P(t) / Z`` with ``Z`` the allowed tokens' mass; greedy, the same
    token (``tests/test_serve.py`` checks greedy text against llama-cpp-python's chain). Top-k and
    top-p then cut the distribution before the grammar instead of after, as in llama.cpp."""

    def __init__(self, vocab, grammar: LlamaGrammar, n_vocab: int):
        self.sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar._grammar.encode("utf-8"),
                                                            grammar._root.encode("utf-8"))
        if not self.sampler:  # response_grammar made this grammar once already: not reached from the server
            raise ConstraintError("llama.cpp refuses the grammar", "response_format")
        self.n_vocab = n_vocab
        self.data = (llama_cpp.llama_token_data * n_vocab)()
        self.rows = np.ctypeslib.as_array(self.data)  # a structured view: id, logit, p
        self.ids = np.arange(n_vocab, dtype=self.rows.dtype["id"])
        self.one = llama_cpp.llama_token_data()
        self.one_array = llama_cpp.llama_token_data_array(data=ctypes.pointer(self.one), size=1, selected=-1,
                                                          sorted=False)
        self.drawn = self.refused = 0
        """Tokens drawn, and how many of them the grammar refused (each then cost a pass over the vocabulary)."""

    def _fill(self, logits) -> llama_cpp.llama_token_data_array:
        self.rows["id"] = self.ids
        self.rows["logit"] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        self.rows["p"] = 0.0
        return llama_cpp.llama_token_data_array(data=self.data, size=self.n_vocab, selected=-1, sorted=False)

    def sample(self, ctx, chain, idx: int) -> int:
        """The token for the logits of row ``idx`` of ``ctx`` (llama.cpp's index: -1 the last),
        ``chain`` the sampler chain without the grammar; accepted by both."""
        logits = llama_cpp.llama_get_logits_ith(ctx, idx)
        cur = self._fill(logits)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        self.one.id, self.one.logit, self.one.p = token, 1.0, 0.0
        self.one_array.size, self.one_array.selected = 1, -1
        llama_cpp.llama_sampler_apply(self.sampler, ctypes.byref(self.one_array))
        self.drawn += 1
        if not np.isfinite(self.one.logit):  # refused: the grammar first, over every token, then the chain
            self.refused += 1
            cur = self._fill(logits)
            llama_cpp.llama_sampler_apply(self.sampler, ctypes.byref(cur))
            llama_cpp.llama_sampler_apply(chain, ctypes.byref(cur))
            token = int(cur.data[cur.selected].id)
        llama_cpp.llama_sampler_accept(self.sampler, token)
        llama_cpp.llama_sampler_accept(chain, token)
        return token

    def close(self) -> None:
        if self.sampler:
            llama_cpp.llama_sampler_free(self.sampler)
            self.sampler = None
