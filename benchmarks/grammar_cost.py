"""What a grammar costs a decode (docs/serve.md, "The grammar's cost"): milliseconds a token with no
grammar, with the grammar in llama-cpp-python's sampler chain (a plain ``llama_cpp.Llama``: llama.cpp
matches every token of the vocabulary against it at every step), and checked first
(``expertcache.llama.textgen.ObservedLlama``: ``constraints.GrammarFirst``, the whole vocabulary only
for a token the grammar refuses), for ``json_object`` and a two-property schema, greedy, same
prompt, same tokens (checked). Also how many of the tokens drawn the grammar refused.

    .venv/bin/python benchmarks/grammar_cost.py MODEL.gguf [MODEL.gguf ...] [--repeats 5] [--tokens 48] [--json]

With ``--forced``: a forced tool call's grammar in each call format (``expertcache.llama.callgrammar``,
three tools) against the call's arguments alone (the grammar of one tool's parameters), checked
first as the server does: milliseconds to make the grammar and a token to decode under it; and
Hermes' call after a thinking block, gpt-oss's after an analysis message (:data:`THINKING`); and
calls of one or more (:data:`PARALLEL`).

Each cell: ``--repeats`` decodes of up to ``--tokens`` tokens, median [min-max] ms a token (1 thread).
A model that does not write JSON (random weights) has most of its tokens refused: its "checked
first" column is then near the chain's; a model that follows the prompt has few refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp

from expertcache.llama.callgrammar import FORMS, HARMONY_MESSAGES, Thinking, call_grammar
from expertcache.llama.constraints import GrammarFirst, response_grammar
from expertcache.llama.textgen import ObservedLlama

PROMPT = b"The Python interpreter"
FORMATS = {"json_object": {"type": "json_object"},
           "schema": {"type": "json_schema", "json_schema": {"schema": {
               "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
               "required": ["n", "s"]}}}}


def decode(llm, tokens: int, grammar=None) -> list[int]:
    out = []
    for t in llm.generate(llm.tokenize(PROMPT), temp=0, top_k=1, repeat_penalty=1.0, grammar=grammar):
        out.append(t)
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t) or len(out) == tokens:
            break
    return out


def timed(llm, tokens: int, repeats: int, grammar=None) -> tuple[list[int], list[float]]:
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = decode(llm, tokens, grammar)
        ms.append((time.perf_counter() - t0) / len(out) * 1000)
    return out, ms


def spread(ms: list[float]) -> str:
    return f"{statistics.median(ms):.2f} [{min(ms):.2f}-{max(ms):.2f}]"


def measure(path: str, tokens: int, repeats: int) -> dict:
    rec = {"model": path}
    refused: list[tuple[int, int]] = []
    close = GrammarFirst.close

    def counting_close(self):  # the counts of each generation's grammar, read as it closes
        if self.sampler:
            refused.append((self.drawn, self.refused))
        close(self)

    GrammarFirst.close = counting_close
    try:
        for cls, name in ((llama_cpp.Llama, "chain"), (ObservedLlama, "first")):
            llm = cls(path, verbose=False, n_ctx=512, n_threads=1)
            rec["n_vocab"] = llm.n_vocab()
            _, rec[f"plain_{name}_ms"] = timed(llm, tokens, repeats)
            for fmt, spec in FORMATS.items():
                grammar = response_grammar(spec, llm._model.vocab)
                out, ms = timed(llm, tokens, repeats, grammar)
                rec[f"{fmt}_{name}_ms"] = ms
                key = f"{fmt}_tokens"
                if rec.setdefault(key, out) != out:
                    raise SystemExit(f"{path}: {fmt}: the two ways sampled other tokens ({rec[key]} vs {out})")
                if name == "first":
                    rec[f"{fmt}_drawn_refused"] = refused[-1]
            llm.close()
    finally:
        GrammarFirst.close = close
    return rec


FORCED_TOOLS = [
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "days": {"type": "integer"},
                                                      "units": {"type": "string", "enum": ["C", "F"]}},
                     "required": ["city"]}),
    ("get_time", {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                  "required": ["zone"]}),
    ("ping", None)]
FORCED = ("arguments",) + FORMS  # every format a forced call is written in, against the arguments alone
THINKING = {"hermes, after thinking": ("hermes", Thinking("<think>", "</think>", ("<tool_call>",))),
            "harmony, after analysis": ("harmony", HARMONY_MESSAGES)}
"""Forced calls a thinking block may come before (the server's, for a reasoning template): a random
model thinks through every token, so the row is the thinking text's rule."""
PARALLEL = {"hermes, one or more": "hermes", "minimax-m2, one or more": "minimax-m2",
            "kimi-k3, one or more": "kimi-k3"}
"""Forced calls of one or more (the server's default: ``parallel_tool_calls`` not false), one format
of each kind: a block per call, calls in one block, calls numbered."""
ROWS = FORCED + tuple(THINKING) + tuple(PARALLEL)


def grammar_of(row: str, vocab):
    """The grammar a row decodes under."""
    if row == "arguments":
        return response_grammar({"type": "json_schema", "json_schema": {"schema": FORCED_TOOLS[0][1]}}, vocab)
    if row in THINKING:
        return call_grammar(THINKING[row][0], FORCED_TOOLS, vocab, THINKING[row][1])
    if row in PARALLEL:
        return call_grammar(PARALLEL[row], FORCED_TOOLS, vocab, parallel=True)
    return call_grammar(row, FORCED_TOOLS, vocab)


def forced(path: str, tokens: int, repeats: int) -> dict:
    """Per call format: the grammar's making and a token's decode, ms (``repeats`` each)."""
    llm = ObservedLlama(path, verbose=False, n_ctx=512, n_threads=1)
    vocab = llm._model.vocab
    rec = {"model": path, "n_vocab": llm.n_vocab(), "plain_ms": timed(llm, tokens, repeats)[1]}
    for fmt in ROWS:
        builds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            grammar = grammar_of(fmt, vocab)
            builds.append((time.perf_counter() - t0) * 1000)
        rec[f"{fmt}_build_ms"] = builds
        out, rec[f"{fmt}_ms"] = timed(llm, tokens, repeats, grammar)
        rec[f"{fmt}_tokens"] = len(out)
    llm.close()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", metavar="MODEL.gguf")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true", help="one JSON object per model instead of the table")
    ap.add_argument("--forced", action="store_true", help="a forced tool call's grammar per call format instead")
    args = ap.parse_args(argv)
    if args.forced:
        recs = [forced(m, args.tokens, args.repeats) for m in args.models]
        if args.json:
            for rec in recs:
                print(json.dumps(rec))
            return 0
        print("| model | format | grammar made, ms | ms a token | tokens | x no grammar |")
        print("|---|---|---|---|---|---|")
        for r in recs:
            plain = statistics.median(r["plain_ms"])
            print(f"| {r['model'].rsplit('/', 1)[-1]} | no grammar | - | {spread(r['plain_ms'])} | - | 1.00 |")
            for fmt in ROWS:
                print(f"| | {fmt} | {spread(r[f'{fmt}_build_ms'])} | {spread(r[f'{fmt}_ms'])} | {r[f'{fmt}_tokens']} "
                      f"| {statistics.median(r[f'{fmt}_ms']) / plain:.2f} |")
        return 0
    recs = [measure(m, args.tokens, args.repeats) for m in args.models]
    if args.json:
        for rec in recs:
            print(json.dumps({k: v for k, v in rec.items() if not k.endswith("_tokens")}))
        return 0
    print("| model | vocabulary | no grammar | `json_object`, in the chain / checked first | refused / drawn "
          "| schema, in the chain / checked first | refused / drawn |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        cells = [r["model"].rsplit("/", 1)[-1], f"{r['n_vocab']:,}", spread(r["plain_first_ms"])]
        for fmt in FORMATS:
            drawn, refused = r[f"{fmt}_drawn_refused"]
            cells += [f"{spread(r[f'{fmt}_chain_ms'])} / {spread(r[f'{fmt}_first_ms'])}", f"{refused} / {drawn}"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
