#!/usr/bin/env python
"""What one expert miss costs on the file, step by step, for the ``managed`` and ``mmap`` modes
(docs/llama.md, "Benchmark": where a ``managed`` token goes, and what the ``mmap`` model misses).

For each GGUF, --experts random (MoE layer, expert) pairs (seeded), the file evicted before each:

* ``managed``'s miss path, on a mapping marked ``MADV_RANDOM`` as the mode marks the expert
  tensors: the expert's slices hinted (``POSIX_FADV_WILLNEED`` in the advisor's pieces, as the
  step hints a load: the time the calling thread spends in the calls), then every page touched
  (a fault per page, waiting for the hinted reads: the wait), then dropped (``MADV_DONTNEED`` and
  ``POSIX_FADV_DONTNEED`` per slice, as the step drops a victim). Median [min-max] ms per expert.
* ``mmap``'s fault spill, on a mapping of a descriptor opened ``POSIX_FADV_SEQUENTIAL``, as
  llama.cpp opens the file (no advice on the mapping): one slice (the expert's first) touched page
  by page, the process's own ``read_bytes`` (``/proc/self/io``) over the slice's bytes; beside it,
  what the forecast's window model counts for that slice: the bytes of the readahead windows
  (twice the device's ``read_ahead_kb``) it overlaps, over the slice's bytes.

Run (seconds; the page cache of the file is dropped as it goes, so run it alone)::

    .venv/bin/python benchmarks/miss_path.py /work/scratch/serve-bench-olmoe-f16.gguf /work/scratch/tier-qwen3moe-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from expertcache.formats.gguf import read_geometry  # noqa: E402
from expertcache.llama.advice import (MADV_DONTNEED, MADV_RANDOM, SEQUENTIAL, drop, hint_piece,  # noqa: E402
                                      hint_range, madvise)
from expertcache.tier.readers import readahead_bytes  # noqa: E402
from expertcache.wall.pagecache import evict_file_pages  # noqa: E402
from expertcache.wall.procfs import read_self_io  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def read_bytes() -> int:
    io, why = read_self_io()
    if io is None:
        raise SystemExit(f"miss_path: {why}")
    return io["read_bytes"]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def touch(arr: np.ndarray, off: int, n: int) -> int:
    """Read one byte of every page of ``[off, off + n)`` (a fault per page not mapped)."""
    return int(arr[off:off + n:PAGE].sum())


def measure(path: str, experts: int, seed: int) -> dict:
    g = read_geometry(path)
    rng = random.Random(seed)
    picks = [(rng.choice(g.moe_layers), rng.randrange(g.num_experts)) for _ in range(experts)]
    piece, window = hint_piece(path), SEQUENTIAL * readahead_bytes(path)
    out: dict = {"gguf": path, "experts": experts, "hint_piece_bytes": piece, "window_bytes": window}

    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:  # managed: MADV_RANDOM, hint, fault, drop
            arr = np.frombuffer(mm, dtype=np.uint8)
            base = arr.__array_interface__["data"][0]
            madvise(base, len(mm), MADV_RANDOM)
            hint, wait, dropped, nbytes = [], [], [], []
            for layer, e in picks:
                evict_file_pages([path])
                ranges = g.compute_ranges(layer, [e])
                t0 = time.perf_counter()
                for off, n in ranges:
                    hint_range(fd, off, n, piece)
                t1 = time.perf_counter()
                for off, n in ranges:
                    touch(arr, off, n)
                t2 = time.perf_counter()
                for off, n in ranges:
                    drop(fd, base, off, n)
                t3 = time.perf_counter()
                hint.append(1e3 * (t1 - t0))
                wait.append(1e3 * (t2 - t1))
                dropped.append(1e3 * (t3 - t2))
                nbytes.append(sum(n for _, n in ranges))
            del arr
        out["managed"] = {"expert_bytes": statistics.median(nbytes), "hint_ms": spread(hint), "wait_ms": spread(wait),
                          "drop_ms": spread(dropped)}
    finally:
        os.close(fd)

    fd = os.open(path, os.O_RDONLY)  # mmap: llama.cpp's descriptor, no advice on the mapping
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
            arr = np.frombuffer(mm, dtype=np.uint8)
            base = arr.__array_interface__["data"][0]
            read, model, sizes = [], [], []
            for layer, e in picks:
                madvise(base, len(mm), MADV_DONTNEED)  # a page still mapped here would not be evicted
                evict_file_pages([path])
                off, n = g.expert_ranges(layer, e)[0]
                r0 = read_bytes()
                touch(arr, off, n)
                read.append((read_bytes() - r0) / n)
                model.append(((off + n - 1) // window - off // window + 1) * window / n)
                sizes.append(n)
            del arr
        out["mmap"] = {"slice_bytes": statistics.median(sizes), "read_over_slice": spread(read),
                       "windows_over_slice": spread(model)}
    finally:
        os.close(fd)
    evict_file_pages([path])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--experts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    rows = [measure(p, args.experts, args.seed) for p in args.gguf]

    def ms(s):
        return f"{s['median']:.3g} [{s['min']:.3g}-{s['max']:.3g}]"

    print(f"{args.experts} random experts per file, the file evicted before each; median [min-max]")
    print("| GGUF | expert MB | hint ms | wait ms | drop ms | slice KB | mmap read / slice | model windows / slice |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, f = r["managed"], r["mmap"]
        print(f"| {Path(r['gguf']).name} | {m['expert_bytes'] / 1e6:.3g} | {ms(m['hint_ms'])} | {ms(m['wait_ms'])} | "
              f"{ms(m['drop_ms'])} | {f['slice_bytes'] / 1024:.0f} | {ms(f['read_over_slice'])} | "
              f"{ms(f['windows_over_slice'])} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
