#!/usr/bin/env python
"""What a page fault in a decode step costs with 1 and with 2 llama.cpp threads (docs/llama.md,
"Faults with two threads").

For each thread count (and each ``GOMP_SPINCOUNT`` in --spincounts, "default" leaving it unset),
a fresh process loads the GGUF with llama.cpp (mapped, no wall), decodes --steps tokens after a
fixed prompt once, then replays the same tokens --rounds times, twice per round:

* warm: every expert already in the page cache;
* cold: before each step, a seeded random --fraction of all the experts' slices unmapped and
  dropped from the page cache (``MADV_DONTNEED`` then ``POSIX_FADV_DONTNEED``, as the managed mode
  drops a victim), so the step faults them back in through llama.cpp's mapping (the kernel's
  readahead around each fault, as ``mmap`` and ``advise`` runs read).

Per cell it prints the warm and cold ms/token, the bytes the cold steps read (``/proc/self/io``
``read_bytes``, the process's own), and what a faulted MB costs: (cold - warm) / read MB, as the
median over rounds with its spread. The cost with 1 thread against the device's own speed is the
fault path's overhead. The ratio of 2 threads to 1 is what the serial forecast
(``expertcache size``: 1/c + D/B) leaves out.

Run (about a minute a cell on the shared 2-core machine)::

    .venv/bin/python benchmarks/fault_threads.py /work/scratch/tier-qwen3moe-q4_k_m.gguf --threads 1,2 --spincounts default,1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
import numpy as np
sys.path.insert(0, {src!r})
from expertcache.wall.procfs import OpenProcFile, read_self_io
from expertcache.llama import advice
from expertcache.llama.engine import Engine

path, threads, fraction, steps, rounds = {path!r}, {threads}, {fraction}, {steps}, {rounds}
maps, io = OpenProcFile("/proc/self/maps"), OpenProcFile("/proc/self/io")
prompt = list(range(1, 17))
out = []
with Engine(path, n_ctx=64, threads=threads) as eng:
    g = eng.geometry
    toks, _ = eng.generate(prompt, steps + 1)
    base = advice.mapping_base(path, maps)
    fd = os.open(path, os.O_RDONLY)
    slices = [(t.offset + e * (t.nbytes // g.num_experts), t.nbytes // g.num_experts)
              for layer in g.moe_layers for t in g.experts[layer].values() for e in range(g.num_experts)]
    rng = np.random.default_rng(0)

    def run(cold):
        eng.reset()
        eng.forward(prompt, logits="last")
        secs = read = 0
        for tok in toks[:steps]:
            if cold:
                for i in np.flatnonzero(rng.random(len(slices)) < fraction):
                    advice.drop(fd, base, *slices[i])
            b0 = read_self_io(io)[0]["read_bytes"]
            t0 = time.perf_counter()
            eng.forward([tok], logits="last")
            secs += time.perf_counter() - t0
            read += read_self_io(io)[0]["read_bytes"] - b0
        return secs / steps, read / steps

    for _ in range(rounds):
        warm, _ = run(False)
        cold, read = run(True)
        out.append({{"warm_s": warm, "cold_s": cold, "read_bytes": read}})
print(json.dumps(out))
"""


def cell(path: str, threads: int, fraction: float, steps: int, rounds: int, spincount: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if spincount != "default":
        env["GOMP_SPINCOUNT"] = spincount  # read by libgomp when llama.cpp loads it
    code = CHILD.format(src=str(REPO / "src"), path=path, threads=threads, fraction=fraction, steps=steps,
                        rounds=rounds)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"fault_threads: the child failed: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(xs: list[float], fmt: str) -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--fractions", default="0.1,0.3", help="shares of the experts' slices dropped before each cold step")
    ap.add_argument("--spincounts", default="default", help="GOMP_SPINCOUNT values ('default': unset)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the cells as JSON instead of a table")
    args = ap.parse_args()
    if not Path(args.gguf).is_file():
        print(f"fault_threads: {args.gguf}: no such file", file=sys.stderr)
        return 2
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for spin in args.spincounts.split(","):
            for threads in [int(t) for t in args.threads.split(",")]:
                rs = cell(args.gguf, threads, fraction, args.steps, args.rounds, spin)
                per_mb = [(r["cold_s"] - r["warm_s"]) * 1e3 / (r["read_bytes"] / 1e6) for r in rs if r["read_bytes"]]
                rows.append({"fraction": fraction, "spincount": spin, "threads": threads, "rounds": rs,
                             "warm_ms": [r["warm_s"] * 1e3 for r in rs], "cold_ms": [r["cold_s"] * 1e3 for r in rs],
                             "read_mb": [r["read_bytes"] / 1e6 for r in rs], "ms_per_mb": per_mb})
                print(f"  fraction {fraction} GOMP_SPINCOUNT={spin} T{threads}: {spread(per_mb, '.2f')} ms per faulted MB",
                      file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{args.gguf}: {args.steps} decode steps, {args.rounds} rounds; median [min-max] over rounds")
    print()
    print("| dropped share | GOMP_SPINCOUNT | threads | warm ms/token | cold ms/token | read MB/token | ms per faulted MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fraction']} | {r['spincount']} | {r['threads']} | {spread(r['warm_ms'], '.1f')} | "
              f"{spread(r['cold_ms'], '.1f')} | {spread(r['read_mb'], '.2f')} | {spread(r['ms_per_mb'], '.2f')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
