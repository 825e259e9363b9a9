#!/usr/bin/env python
"""llama.cpp decode under a memory wall, every page-cache mode (issue 21, docs/llama.md "Benchmark").

1. Builds (once) a random-weight OLMoE-class GGUF of 1.69 GB (f16; hidden 1024, expert width 512,
   64 experts, top-8, 8 layers, vocab 2048: the feasibility probe's model) under --scratch, never
   in the repository, with ``expertcache.llama.convert.convert_random``.
2. Unwalled reference: ``mmap`` and ``nommap`` (--runs each).
3. ``expertcache.llama.sweep.sweep`` over --walls (P% = dense bytes + P% of the expert tensors)
   for every walled mode, --runs per cell, one seeded shuffled order, headroom calibrated once per mode.
4. The trained ``models/small-moe`` (f16 GGUF) through the same sweep, for realistic routing
   (its lookahead recall).
5. The table (median [min-max] decode tokens/s, read and demand MB per token, amplification,
   proof), the ratios the issue names, and the plot, written between the benchmark markers of
   docs/llama.md and to docs/img/llama_tier.png; the full records to --json-out.

Run (about 20 minutes on the shared 2-core machine)::

    nice -n 10 .venv/bin/python benchmarks/llama_tier.py --scratch /work/scratch --json-out /tmp/llama_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from expertcache.llama.convert import convert, convert_random  # noqa: E402
from expertcache.llama.geometry import read_geometry  # noqa: E402
from expertcache.llama.runner import run_one  # noqa: E402
from expertcache.llama.sweep import parse_walls, plot_sweep, sweep  # noqa: E402

BIG = dict(hidden_size=1024, intermediate_size=512, num_experts=64, num_experts_per_tok=8, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=16, vocab_size=2048, max_position_embeddings=4096,
           rms_norm_eps=1e-5, norm_topk_prob=False)
START, END = "<!-- llama-bench:start -->", "<!-- llama-bench:end -->"


def fmt_rate(c) -> str:
    s = c["decode_tokens_per_s"]
    return f"{s['median']:.3g} [{s['min']:.3g}-{s['max']:.3g}]"


def mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.3g}"


def table(res: dict, ref: dict, title: str) -> list[str]:
    lines = [f"**{title}**", "", "| wall | mode | runs | decode tok/s median [min-max] | read MB/token | "
             "demand MB/token | amplification | proof |", "|---|---|---|---|---|---|---|---|"]
    for mode, rs in ref.items():
        rates = [r["decode_tokens_per_s"] for r in rs]
        lines.append(f"| none | {mode} | {len(rs)} | {statistics.median(rates):.3g} [{min(rates):.3g}-{max(rates):.3g}] | "
                     f"{mb(statistics.median(r['read_bytes_per_token'] for r in rs))} | - | - | unwalled |")
    for c in sorted(res["cells"], key=lambda c: (c["memory_wall"], c["mode"])):
        amp = c["amplification"]["median"]
        if not c["runs"]:
            lines.append(f"| {c['memory_wall'] / 1e6:.0f} MB | {c['mode']} | 0 of {c['failed_runs']} | failed: "
                         f"{c['errors'][0][:80]} | | | | failed |")
            continue
        runs = f"{c['runs']} (+{c['failed_runs']} failed)" if c["failed_runs"] else str(c["runs"])
        lines.append(f"| {c['memory_wall'] / 1e6:.0f} MB | {c['mode']} | {runs} | {fmt_rate(c)} | "
                     f"{mb(c['read_bytes_per_token']['median'])} | {mb(c['demand_bytes_per_token'])} | "
                     f"{'-' if amp is None else f'{amp:.2f}'} | {'ok' if c['proof_ok'] else 'failed'} |")
    return lines


def ratios(res: dict, ref: dict, labels: dict) -> list[str]:
    med = {(c["mode"], c["memory_wall"]): c["decode_tokens_per_s"]["median"] for c in res["cells"]}
    walls = sorted({w for _, w in med})
    unwalled = statistics.median(r["decode_tokens_per_s"] for r in ref.get("mmap", [])) if ref.get("mmap") else None
    out = ["| wall | advise / mmap | pin / advise | managed / advise | lookahead / advise | mmap / nocache | "
           "advise / nocache | advise / unwalled mmap |", "|---|---|---|---|---|---|---|---|"]

    def r(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    for w in walls:
        g = lambda m: med.get((m, w))  # noqa: E731
        out.append(f"| {labels.get(w, '')} {w / 1e6:.0f} MB | {r(g('advise'), g('mmap'))} | {r(g('pin'), g('advise'))} | "
                   f"{r(g('managed'), g('advise'))} | {r(g('lookahead'), g('advise'))} | "
                   f"{r(g('mmap'), g('nocache'))} | {r(g('advise'), g('nocache'))} | {r(g('advise'), unwalled)} |")
    return out


def run_model(path: str, prompt, args, modes, title) -> tuple[dict, dict, list[str]]:
    g = read_geometry(path)
    ref = {m: [run_one(g, prompt, args.new_tokens, m, threads=args.threads) for _ in range(args.runs)]
           for m in ("mmap", "nommap")}
    walls = parse_walls(args.walls, g)
    labels = dict(zip(walls, [p.strip() for p in args.walls.split(",")]))

    def progress(i, n, rec):
        if rec.get("error"):
            print(f"  [{i}/{n}] {rec['mode']:9s} wall {rec['memory_wall'] / 1e6:7.0f} MB: failed: {rec['error']}", flush=True)
            return
        print(f"  [{i}/{n}] {rec['mode']:9s} wall {rec['memory_wall'] / 1e6:7.0f} MB: {rec['decode_tokens_per_s']:.3g} tok/s, "
              f"{mb(rec['read_bytes_per_token'])} MB/token, proof {rec['proof_ok']}", flush=True)

    res = sweep(g, prompt, args.new_tokens, modes, walls, runs=args.runs, seed=args.seed, threads=args.threads,
                progress=progress)
    shas = {r["output_sha256"] for r in res["records"] if r["output_sha256"]} | {r["output_sha256"] for rs in ref.values() for r in rs}
    lines = table(res, ref, title) + [""] + ratios(res, ref, labels) + [
        "", f"Every run's generated ids identical (one output_sha256 over {len(res['records']) + 2 * args.runs} runs): "
        f"{len(shas) == 1}. Headroom: {res['headroom_note']}."]
    recall = [r["advice"]["lookahead_recall"] for r in res["records"] if r["mode"] == "lookahead" and not r.get("error")]
    if recall:
        lines.append(f"Lookahead recall (predicted experts the next layer routed): median {statistics.median(recall):.3f}.")
    return res, ref, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", default="/work/scratch", help="folder for the GGUFs (outside the repository)")
    ap.add_argument("--walls", default="25%,50%,75%,100%")
    ap.add_argument("--modes", default="mmap,random,advise,pin,managed,lookahead,nocache")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--doc", default=str(REPO / "docs" / "llama.md"))
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "llama_tier.png"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    scratch = Path(args.scratch)
    big = scratch / "olmoe-random-1.7g.gguf"
    t0 = time.time()
    if not big.exists():
        print("building", big, flush=True)
        convert_random(BIG, big, "f16", seed=0)
    small = scratch / "small-moe-f16.gguf"
    if not small.exists():
        convert(REPO / "models" / "small-moe", small, "f16")
    load0 = os.getloadavg()
    prompt = np.random.default_rng(1).integers(0, BIG["vocab_size"], size=args.prompt_len)
    res, ref, lines = run_model(str(big), prompt, args, modes, f"Random OLMoE, {big.stat().st_size / 1e9:.2f} GB f16")
    plot_sweep(res, args.plot, f"llama.cpp decode, random OLMoE {big.stat().st_size / 1e9:.2f} GB, 1 thread")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"big": res, "big_unwalled": ref, "big_lines": lines}))
    held = np.load(REPO / "models" / "small-moe" / "heldout_ids.npy")[0][: args.prompt_len]
    sres, sref, slines = run_model(str(small), held, args, modes, "Trained models/small-moe, f16 (realistic routing)")
    load1 = os.getloadavg()
    head = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s, "
            f"load average {load0[0]:.1f} at the start and {load1[0]:.1f} at the end (2 cores, shared: noise is large), "
            f"{args.threads} thread, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens "
            f"({args.new_tokens - 1} decode steps), {args.runs} runs per cell, shuffled order seed {args.seed}.", "",
            "![decode against the wall](img/llama_tier.png)", ""]
    block = "\n".join([START, *head, *lines, "", *slines, END])
    doc = Path(args.doc)
    text = doc.read_text() if doc.exists() else ""
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        text += "\n" + block + "\n"
    doc.write_text(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"big": res, "big_unwalled": ref, "small": sres, "small_unwalled": sref,
                                                   "big_lines": lines, "small_lines": slines}))
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
