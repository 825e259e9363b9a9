#!/usr/bin/env python
"""What the page cache's structure does to llama.cpp's compute rate (docs/llama.md, "The pages'
structure and the compute rate").

The same decode, every expert resident, timed with the file's pages brought in two ways
(``expertcache.llama.roofline.PAGE_STATES``):

* ``faulted``: the file evicted, then read by llama.cpp's load (``MAP_POPULATE``: page faults, whose
  read-around makes large folios) -- what an ``mmap`` run's pages are;
* ``hinted``: after that load, every page dropped and read back by ``POSIX_FADV_WILLNEED`` hints
  (single 4 KB pages) -- what the ``managed`` mode's pages are (it drops the load's pages and hints
  back what it keeps; ``advise`` and the other hinting modes read what they read the same way).

With ``--huge``, a third state (not one a mode holds): ``huge``, every page dropped after the load,
then the whole mapping advised ``MADV_HUGEPAGE`` and ``MADV_RANDOM`` and populated, so that each fault
reads its 2 MiB-aligned block into one PMD-mapped folio (kernel 6.18's ``do_sync_mmap_readahead``).

Each measurement is a fresh process: the file evicted, the engine loaded, the pages brought in
(:func:`expertcache.llama.roofline.bring_in`), the prompt ids 1..16 and --tokens tokens decoded once
to read in what they route, then 3 timed passes (the median kept, as ``roofline.compute_rate``
does). Where ``/proc/kpageflags`` can be read (root), the child also counts the share of the
file's mapped bytes that sit in large folios (compound pages). The cells run in a seeded shuffled
order within each of --rounds rounds. Per (model, threads, state): the median rate [min-max] over
rounds and the large-folio share; per (model, threads): hinted / faulted, a tie where the two
spreads overlap.

``--primitives`` instead asks which read a program controls puts a range into large folios: per
primitive, six experts' slices of one MoE layer (seeded) of the first file read into an evicted
page cache by it, the bytes the process read (``/proc/self/io``) against the slices' bytes, and
the share of the resident pages in and around the slices that sit in large folios (root only).

Run (about 6 minutes for two models, 1 and 2 threads, 6 rounds, on the shared 2-core machine)::

    .venv/bin/python benchmarks/page_state.py /work/scratch/serve-bench-olmoe-f16.gguf /work/scratch/tier-qwen3moe-q4_k_m.gguf --threads 1,2 --rounds 6
    .venv/bin/python benchmarks/page_state.py /work/scratch/serve-bench-olmoe-f16.gguf --primitives
    .venv/bin/python benchmarks/page_state.py /work/scratch/serve-bench-olmoe-f16.gguf --threads 1 --rounds 4 --huge
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CENSUS = r"""
def large_share(addr, pages):
    # of the pages (indices into the mapping at addr) that are mapped, the share in large folios
    # (compound pages, /proc/kpageflags bits 15 and 16); None where PFNs cannot be read (not root)
    pages = sorted(set(pages))
    if not pages:
        return None
    try:
        pm, kf = open("/proc/self/pagemap", "rb"), open("/proc/kpageflags", "rb")
    except OSError:
        return None
    with pm, kf:
        lo, n = pages[0], pages[-1] - pages[0] + 1
        pm.seek((addr // 4096 + lo) * 8)
        entries = struct.unpack(f"<{n}Q", pm.read(8 * n))
        mapped = large = 0
        for i in pages:
            e = entries[i - lo]
            if not e >> 63 & 1:
                continue
            pfn = e & ((1 << 55) - 1)
            if not pfn:
                return None  # PFNs hidden
            kf.seek(pfn * 8)
            flags = struct.unpack("<Q", kf.read(8))[0]
            mapped += 1
            large += bool(flags >> 15 & 1 or flags >> 16 & 1)
    return large / mapped if mapped else None
"""
"""The folio census both children run (inserted into their code)."""

CHILD = r"""
import json, os, statistics, struct, sys, time
sys.path.insert(0, {src!r})
from expertcache.llama import advice
from expertcache.llama.engine import Engine
from expertcache.llama.roofline import COMPUTE_REPEATS, bring_in
from expertcache.wall.pagecache import evict_file_pages
from expertcache.wall.procfs import OpenProcFile

path, threads, pages, tokens = {path!r}, {threads}, {pages!r}, {tokens}
prompt = list(range(1, 17))
{census}

evict_file_pages([path])
with Engine(path, n_ctx=len(prompt) + tokens + 1, threads=threads) as eng:
    if pages == "huge":  # every page dropped, then faulted back through a mapping advised MADV_HUGEPAGE
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        maps = OpenProcFile("/proc/self/maps")
        base, ranges = advice.mapping_base(path, maps), advice.mapped_ranges(path, maps)
        maps.close()
        fd = os.open(path, os.O_RDONLY)
        advice.drop_file(fd, base, ranges)
        os.close(fd)
        for off, n in ranges:  # HUGEPAGE, RANDOM (one block per fault, no read-around), POPULATE_READ
            for adv in (14, 1, 22):
                if libc.madvise(base + off, n, adv) != 0:
                    raise SystemExit(f"madvise {{adv}}: {{os.strerror(ctypes.get_errno())}}")
    else:
        bring_in(path, pages)

    def one():
        _, t = eng.generate(prompt, tokens)
        return t["decode_steps"] / t["decode_seconds"]

    one()
    rates = [one() for _ in range(COMPUTE_REPEATS)]
    maps = OpenProcFile("/proc/self/maps")
    base = advice.mapping_base(path, maps)
    maps.close()
    share = large_share(base, range(os.path.getsize(path) // 4096)) if base is not None else None
print(json.dumps({{"rate": statistics.median(rates), "large_folio_share": share}}))
"""


PRIMITIVES = r"""
import ctypes, json, os, random, struct, sys, time
sys.path.insert(0, {src!r})
{census}
from expertcache.formats.gguf import read_geometry
from expertcache.tier.readers import readahead_bytes
from expertcache.wall.procfs import read_self_io, OpenProcFile

path, how = {path!r}, {how!r}
g = read_geometry(path)
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
PG, POPULATE_READ, SEQUENTIAL, RANDOM = 4096, 22, 2, 1
addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
rng = random.Random(1)
layer = g.moe_layers[len(g.moe_layers) // 2]
ranges = [r for e in rng.sample(range(g.num_experts), min(6, g.num_experts)) for r in g.expert_ranges(layer, e)]
want = sum(n for _, n in ranges)
if how == "madvise-sequential-populate":
    libc.madvise(addr, size, SEQUENTIAL)
if how == "madvise-random-populate":
    libc.madvise(addr, size, RANDOM)
if how == "fadvise-sequential-pread":
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
io = OpenProcFile("/proc/self/io")
r0 = read_self_io(io)[0]["read_bytes"]
buf = bytearray(max(n for _, n in ranges))
W = readahead_bytes(path)  # the device's read-ahead window
for off, n in ranges:
    if how == "pread-chunked":  # one read-ahead window at a time, in order, on a fresh descriptor
        own = os.open(path, os.O_RDONLY)
        for p in range(off, off + n, W):
            os.preadv(own, [memoryview(buf)[:min(W, off + n - p)]], p)
        os.close(own)
    elif how == "populate-centred":  # the read-around of one fault at the centre of each whole window
        lo, hi = -(-off // W) * W, (off + n) // W * W
        for a, b in ((off, min(lo, off + n)), (max(hi, lo), off + n)):
            if b > a:
                os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
        for w in range(lo, hi, W):
            if libc.madvise(addr + w + W // 2, PG, POPULATE_READ) != 0:
                raise SystemExit(f"MADV_POPULATE_READ failed: {{os.strerror(ctypes.get_errno())}}")
        libc.madvise(addr + lo, max(0, hi - lo), 4)  # MADV_DONTNEED: unmapped again, kept in the page cache
    elif how == "huge-blocks":  # whole aligned 2 MiB blocks faulted as PMD folios, the ends hinted
        B = 2 << 20
        lo, hi = -(-off // B) * B, (off + n) // B * B
        for a, b in ((off, min(lo, off + n)), (max(hi, lo), off + n)):
            if b > a:
                os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
        if hi > lo:
            for adv in (14, RANDOM, POPULATE_READ):  # MADV_HUGEPAGE first: its own VMA, exactly the blocks
                if libc.madvise(addr + lo, hi - lo, adv) != 0:
                    raise SystemExit(f"madvise {{adv}}: {{os.strerror(ctypes.get_errno())}}")
    elif how.endswith("pread"):
        os.preadv(fd, [memoryview(buf)[:n]], off)
    elif how.endswith("populate"):
        lo, hi = off // PG * PG, -(-(off + n) // PG) * PG
        if libc.madvise(addr + lo, hi - lo, POPULATE_READ) != 0:
            raise SystemExit(f"MADV_POPULATE_READ failed: {{os.strerror(ctypes.get_errno())}}")
    else:
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
time.sleep(0.5)
got = read_self_io(io)[0]["read_bytes"] - r0
vec = (ctypes.c_ubyte * (size // PG + 1))()
libc.mincore(addr, size, vec)
resident = {{i for off, n in ranges for i in range(max(0, off // PG - 64), min(size // PG, (off + n) // PG + 64))
            if vec[i] & 1}}
for i in resident:
    ctypes.c_char.from_address(addr + i * PG).value  # map the resident page (no read: it is there)
share = large_share(addr, resident)
print(json.dumps({{"primitive": how, "wanted_bytes": want, "read_bytes": got, "large_folio_share": share}}))
"""
PRIMITIVE_NAMES = ("fadvise-willneed", "pread", "fadvise-sequential-pread", "pread-chunked", "populate",
                   "madvise-sequential-populate", "madvise-random-populate", "populate-centred", "huge-blocks")
"""``posix_fadvise(WILLNEED)`` (what the hinting modes issue), ``pread`` of the exact range (with the
file's readahead as opened, or after ``POSIX_FADV_SEQUENTIAL``, or one read-ahead window per call on
a fresh descriptor), and ``MADV_POPULATE_READ`` on a mapping of the file (its advice left normal,
``MADV_SEQUENTIAL``, or ``MADV_RANDOM`` as the hinting modes set it; or one page at the centre of
each whole read-ahead window inside the range, whose fault reads exactly that window around it,
the range's ends hinted); ``huge-blocks``: the mapping advised ``MADV_HUGEPAGE`` and ``MADV_RANDOM``
only over each whole 2 MiB-aligned block inside a slice, those blocks populated (a fault there reads
its block into one PMD-sized folio) and the slice's ends hinted."""


def primitives(path: str) -> list[dict]:
    out = []
    for how in PRIMITIVE_NAMES:
        code = PRIMITIVES.format(src=str(REPO / "src"), path=path, how=how, census=CENSUS)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise SystemExit(f"{how} failed: {res.stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def child(path: str, threads: int, pages: str, tokens: int) -> dict:
    code = CHILD.format(src=str(REPO / "src"), path=path, threads=threads, pages=pages, tokens=tokens,
                        census=CENSUS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"child failed ({path}, T{threads}, {pages}): {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):.3g} [{min(v):.3g}-{max(v):.3g}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts (default 1)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded per pass (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--primitives", action="store_true",
                    help="instead: which read puts a range in large folios, and how many bytes it reads (first file)")
    ap.add_argument("--huge", action="store_true",
                    help="also time a third state, 'huge': every page dropped after the load, then the mapping "
                         "advised MADV_HUGEPAGE and MADV_RANDOM and populated (2 MiB-aligned blocks, PMD-mapped folios)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()
    if args.primitives:
        rows = primitives(args.models[0])
        if args.json:
            print(json.dumps(rows))
            return 0
        print(f"{Path(args.models[0]).name}: six experts' slices of one MoE layer read into an evicted page cache")
        print("| primitive | read / wanted bytes | large folios |")
        print("|---|---|---|")
        for r in rows:
            share = r["large_folio_share"]
            print(f"| {r['primitive']} | {r['read_bytes'] / r['wanted_bytes']:.2f} | {'-' if share is None else f'{share:.0%}'} |")
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    states = ("faulted", "hinted", "huge") if args.huge else ("faulted", "hinted")
    cells = [(m, t, p) for m in args.models for t in threads for p in states]
    rng = random.Random(args.seed)
    got: dict = {}
    for r in range(args.rounds):
        order = cells[:]
        rng.shuffle(order)
        for m, t, p in order:
            res = child(m, t, p, args.tokens)
            got.setdefault((m, t, p), []).append(res)
            share = res["large_folio_share"]
            print(f"round {r + 1}/{args.rounds} {Path(m).name} T{t} {p}: {res['rate']:.3g} tok/s, large folios "
                  f"{'-' if share is None else f'{share:.0%}'}", file=sys.stderr, flush=True)
    out = []
    for m in args.models:
        for t in threads:
            rates = {p: [x["rate"] for x in got[(m, t, p)]] for p in states}
            f = rates["faulted"]
            shares = {p: [x["large_folio_share"] for x in got[(m, t, p)] if x["large_folio_share"] is not None]
                      for p in states}
            row = {"model": Path(m).name, "threads": t, **rates,
                   "large_folio_share": {p: statistics.median(v) if v else None for p, v in shares.items()}}
            for p in states[1:]:  # each against faulted; a tie where the two spreads overlap
                row[f"{p}_over_faulted"] = statistics.median(rates[p]) / statistics.median(f)
                row[f"{p}_tie"] = max(min(f), min(rates[p])) <= min(max(f), max(rates[p]))
            row["tie"] = row["hinted_tie"]
            out.append(row)
    if args.json:
        print(json.dumps(out))
        return 0
    print("| model | threads | " + " | ".join(f"{p} tok/s" for p in states) + " | "
          + " | ".join(f"{p} / faulted" for p in states[1:]) + f" | large folios {' / '.join(states)} |")
    print("|---" * (3 + 2 * (len(states) - 1)) + "|---|")
    for o in out:
        lf = o["large_folio_share"]
        fol = " / ".join("-" if lf[p] is None else f"{lf[p]:.0%}" for p in states)
        verdicts = [f"{o[f'{p}_over_faulted']:.2f}" + (" (tie: the spreads overlap)" if o[f"{p}_tie"] else "")
                    for p in states[1:]]
        print(f"| {o['model']} | {o['threads']} | " + " | ".join(spread(o[p]) for p in states) + " | "
              + " | ".join(verdicts) + f" | {fol} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
