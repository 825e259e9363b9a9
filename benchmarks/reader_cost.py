"""What the server's text readers cost per piece of text (docs/serve.md, "What reading costs"): the
<think> reader, gpt-oss's harmony reader and the tagged tool-call reader, each fed 4,000 pieces
(2,000 of thinking, 2,000 of answer), and the tool-call reader fed one Qwen3-Coder call whose
parameter is 4,000 or 16,000 pieces of code (a file an agent writes), 5 repeats, median [min-max]
microseconds a piece.

    .venv/bin/python benchmarks/reader_cost.py [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from expertcache.llama.reasoning import HarmonyStream, ThinkStream
from expertcache.llama.toolcalls import HERMES, QWEN_XML, TaggedCalls

THINK = ["<think>"] + [" word"] * 2000 + ["</think>", "\n\n"] + [" answer"] * 2000
HARMONY = (["<|channel|>analysis<|message|>"] + [" word"] * 2000
           + ["<|end|><|start|>assistant<|channel|>final<|message|>"] + [" answer"] * 2000)
READERS = {"`<think>` (ThinkStream)": (ThinkStream, THINK),
           "harmony (HarmonyStream)": (lambda: HarmonyStream(["get_weather"]), HARMONY),
           "Hermes calls (TaggedCalls)": (lambda: TaggedCalls(HERMES, [("get_weather", None)]), THINK)}
for n in (4000, 16000):  # one call whose block grows piece by piece until its close
    READERS[f"a Qwen3-Coder call of {n:,} pieces (TaggedCalls)"] = (
        lambda: TaggedCalls(QWEN_XML, [("write_file", None)]),
        ["<tool_call>\n<function=write_file>\n<parameter=content>\n"] + ["    x = f(y)\n"] * n
        + ["</parameter>\n</function>\n</tool_call>"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for name, (make, pieces) in READERS.items():
        runs = []
        for _ in range(args.repeats):
            reader = make()
            t0 = time.perf_counter()
            for piece in pieces:
                reader.feed(piece)
            reader.finish()
            runs.append((time.perf_counter() - t0) / len(pieces) * 1e6)
        rows.append({"reader": name, "pieces": len(pieces), "median_us": statistics.median(runs),
                     "min_us": min(runs), "max_us": max(runs)})
    if args.json:
        print(json.dumps(rows))
        return
    print("| reader | pieces | us a piece |\n|---|---|---|")
    for r in rows:
        print(f"| {r['reader']} | {r['pieces']} | {r['median_us']:.2f} [{r['min_us']:.2f}-{r['max_us']:.2f}] |")


if __name__ == "__main__":
    main()
