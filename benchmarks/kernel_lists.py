#!/usr/bin/env python
"""Why ``advise`` and ``mmap`` read more than the LRU demand under a wall: the kernel's two file
LRU lists, simulated, against the reads measured (docs/llama.md, "The kernel's two lists").

Under a memory cgroup the kernel (6.x without multi-gen LRU) keeps file pages on two lists. A
new page enters the *inactive* list; reclaim takes from its tail. There a page is activated
only if its mapping recorded a reference, seen in two scans, or if it refaults soon after its
eviction: its *refault distance* (the evictions and activations since) is at most the active
list's size. The active list is kept at most ``ratio`` times the inactive one: 1 below 1 GiB of
the cgroup's file pages, ``isqrt(10 * GiB)`` above, its tail moved back to the inactive head.
Two facts measured here drive it:

* llama.cpp's load leaves the file's pages on the **active** list (``active_file`` of the
  wall's ``memory.stat``, polled every 20 ms: 802-876 MB of an 883 MB wall once loaded);
* ``advise`` maps the expert tensors ``MADV_RANDOM`` and the kernel ignores references through
  such a mapping (``vma_has_recency``, 6.3+): an expert page is never activated by use, so it
  leaves the inactive list in the order it came in (ftrace's ``mm_filemap_*_page_cache``: every
  page evicted during a decode at the 50% wall had come in 451-469 MB of reads earlier, half of
  the 889 MB the file held).

So the inactive list, about half the wall, is a FIFO for the experts: the hot ones are evicted
and read again, and the reads are those of a pool of half the size. The simulation
(:func:`expertcache.llama.pagelists.two_lists`, the forecast's model) keeps the lists' rules above
at the granularity of an expert (``advise``) or of a readahead window (``mmap``, whose references
count and whose faults read the window around them: twice the device's, as llama.cpp opens the file
``POSIX_FADV_SEQUENTIAL``), the dense part always active, the whole file
loaded into the active list first, then the captured prompt's forward (uncounted) and its decode
(counted).

Per model and wall it prints the decode's read MB per token measured by ``llama run`` (--runs
runs, median [min-max]), the two-list model's, the LRU demand of the run, and the forecast's
(``expertcache size --trace``'s ``missed_bytes_per_token``: the two-list model, for ``mmap`` never
below ``advise``'s). The GGUFs and captures
are ``benchmarks/llama_tier.py``'s (built under --scratch where missing).

Run (about 3 minutes once the GGUFs exist)::

    .venv/bin/python benchmarks/kernel_lists.py --scratch /work/scratch
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from llama_tier import PROMPT, build, capture, cli  # noqa: E402  (the same files and captures)
from expertcache.formats.gguf import read_geometry  # noqa: E402
from expertcache.llama.forecast import (SEQUENTIAL, expert_groups, expert_windows, prompt_rows,  # noqa: E402
                                        readahead_bytes, routing, unit_groups)
from expertcache.llama.pagelists import two_lists  # noqa: E402
from expertcache.llama.textgen import tokenize  # noqa: E402
from expertcache.trace.core import load_trace  # noqa: E402

MB = 1e6


def measured(gguf: Path, ids: Path, prompt_len: int, wall: str, mode: str, tokens: int) -> dict:
    """One walled ``llama run`` (its record), through :func:`llama_tier.cli`."""
    return cli("llama", "run", str(gguf), "--tokens", str(ids), "--prompt-len", str(prompt_len), "--max-new-tokens",
               str(tokens), "--mode", mode, "--memory-wall", wall, "--no-roofline", "--json")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", required=True, help="where llama_tier.py's GGUFs and captures are (built if missing)")
    ap.add_argument("--walls", default="25,50,75", help="walls, percent of the expert tensors")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    scratch = Path(args.scratch)
    files = build(scratch)
    print("| model | wall | mode | measured MB/token median [min-max] | two-list model | error | LRU demand | "
          "forecast's D | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, gguf in files.items():
        g = read_geometry(str(gguf))
        prompt = tokenize(g.path, PROMPT)
        trace = load_trace(capture(gguf, prompt, args.new_tokens, scratch))
        ids = scratch / f"{gguf.stem}.prompt.npy"
        experts, flags = routing(trace, g), prompt_rows(trace)
        decode = int((~flags).sum())
        E = g.num_experts
        whole_bytes = np.repeat(np.asarray(g.layer_expert_bytes, dtype=np.int64), E)
        window, _ = readahead_bytes(g.path)
        win, win_bytes = expert_windows(g, SEQUENTIAL * window)  # llama.cpp's POSIX_FADV_SEQUENTIAL doubles it
        flat = [w for per in win for w in per]
        for pct in [int(p) for p in args.walls.split(",")]:
            wall = g.dense_bytes + pct * g.expert_tensor_bytes // 100
            captured = scratch / f"{gguf.stem}.prompt-decode{args.new_tokens}.npz"
            fc = {r["mode"]: r for r in cli("size", str(gguf), "--memory", str(wall), "--trace", str(captured),
                                            "--disk-bandwidth", "1", "--compute", "30", "--json") if "mode" in r}
            for mode, units, sizes, referenced in (("advise", None, whole_bytes, False), ("mmap", flat, win_bytes, True)):
                stream = expert_groups(experts, E, flags)
                stream = stream if units is None else unit_groups(stream, units)
                model = two_lists(stream, wall, sizes, g.dense_bytes, referenced)[0] / decode / MB
                runs = [measured(gguf, ids, len(prompt), f"{pct}%", mode, args.new_tokens) for _ in range(args.runs)]
                reads = [r["read_bytes_per_token"] / MB for r in runs]
                med = statistics.median(reads)
                lru = runs[0]["demand_bytes_per_token"] / MB
                old = fc[mode]["missed_bytes_per_token"] / MB
                print(f"| {name} | {pct}% {wall / MB:.0f} MB | {mode} | {med:.3g} [{min(reads):.3g}-{max(reads):.3g}] | "
                      f"{model:.3g} | {model / med - 1:+.0%} | {lru:.3g} | {old:.3g} | {old / med - 1:+.0%} |", flush=True)


if __name__ == "__main__":
    main()
