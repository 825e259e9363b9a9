"""What llama.cpp's context settings cost and save (docs/serve.md, "Context settings"): prefill and
decode tokens/s and the KV cache's bytes with flash attention off and on, and with a q8_0 cache, on
the random OLMoE-geometry f16 GGUF of ``serve_bench.py`` (built under ``--scratch`` when missing).

    .venv/bin/python benchmarks/context_settings.py --scratch DIR [--runs 3] [--prompt-tokens 512] \\
        [--new-tokens 32] [--ctx 2048] [--threads 1] [--json]

Each run is a fresh :class:`~expertcache.llama.textgen.Session` (``mmap``: llama.cpp as it is; the
file is in the page cache after the first run) that evaluates a prompt of ``--prompt-tokens`` token
ids (one ``n_batch`` forward of 512 at a time), then decodes ``--new-tokens`` greedily; settings in
one seeded shuffled order, ``--runs`` each. The KV bytes are llama.cpp's state size after the
prompt less its size before it (the logits buffer and the header are in both). Medians [min-max].
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import llama_cpp  # noqa: E402

from expertcache.llama.convert import convert_random  # noqa: E402
from expertcache.llama.textgen import Session  # noqa: E402
from serve_bench import BIG  # noqa: E402

SETTINGS = {"flash attention off, f16 cache": {},
            "flash attention on, f16 cache": {"flash_attn": True},
            "flash attention on, q8_0 cache": {"flash_attn": True, "type_k": "q8_0", "type_v": "q8_0"}}


def one(gguf: Path, settings: dict, prompt: list[int], new: int, ctx: int, threads: int) -> dict:
    with Session.open(str(gguf), n_ctx=ctx, threads=threads, **settings) as s:
        llm = s.llama
        empty = llama_cpp.llama_state_get_size(llm.ctx)
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        kv = llama_cpp.llama_state_get_size(llm.ctx) - empty
        t0, n = time.perf_counter(), 0
        for _ in llm.generate(prompt, temp=0, top_k=1, repeat_penalty=1.0):  # the prompt kept: its last token again
            n += 1
            if n == new:
                break
        decode = time.perf_counter() - t0
    return {"prefill_tokens_per_s": len(prompt) / prefill, "decode_tokens_per_s": n / decode, "kv_bytes": kv}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4g} [{min(xs):.4g}-{max(xs):.4g}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    gguf = Path(args.scratch) / "serve-bench-olmoe-f16.gguf"
    if not gguf.exists():
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
        convert_random(BIG, gguf, "f16", seed=0, tokenizer=REPO / "models" / "small-moe")
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, BIG["vocab_size"]) for _ in range(args.prompt_tokens)]
    order = [name for name in SETTINGS for _ in range(args.runs)]
    rng.shuffle(order)
    one(gguf, {}, prompt[:16], 2, args.ctx, args.threads)  # the file into the page cache, llama.cpp's first load
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for name in order:
        runs[name].append(one(gguf, SETTINGS[name], prompt, args.new_tokens, args.ctx, args.threads))
    if args.json:
        print(json.dumps({"measured": t_start, "args": vars(args), "runs": runs}))
        return 0
    print(f"Measured {t_start}, {gguf.name}, {args.threads} thread(s), --ctx {args.ctx}, a prompt of "
          f"{args.prompt_tokens} token ids, {args.new_tokens} new tokens, {args.runs} runs each:\n")
    print("| settings | prefill tok/s | decode tok/s | KV cache bytes after the prompt |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        print(f"| {name} | {spread([r['prefill_tokens_per_s'] for r in rs])} | "
              f"{spread([r['decode_tokens_per_s'] for r in rs])} | {spread([r['kv_bytes'] for r in rs])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
