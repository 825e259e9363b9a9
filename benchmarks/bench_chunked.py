"""Scale: a chunked kimi-k3-shaped trace of about 1.5 billion requests, LRU and Belady at three
capacities, in bounded memory (issue 36's target: <= 10 minutes on 2 cores, <= 4 GB peak RSS).

    .venv/bin/python benchmarks/bench_chunked.py [--sequences 1024] [--tokens 1000] [--chunk-sequences 32]
        [--capacities 64,128,256] [--jobs 2] [--dir /tmp/bench-chunked] [--keep] [--json]

Steps, each timed in this run:

1. ``expertcache synth --preset kimi-k3 --chunk-sequences N`` writes the trace (E = 896, k = 16,
   L = 92: 1,472 requests a token; 1,024 x 1,000 tokens = 1.507 billion requests), one chunk in
   memory at a time;
2. ``expertcache sweep DIR --capacities ... -p lru -p belady --jobs J --json``: LRU's three
   capacities from one stack pass per chunk, Belady replayed at each, the chunks spread over J
   worker processes. Its wall time and the peak of the summed resident memory of the command and
   its workers (sampled from /proc every 0.2 s) are the figures the target is about;
3. the reference: a prefix of about 1% of the sequences, written chunked (chunks of 2
   sequences) and swept both ways, chunk by chunk and loaded whole; the counts must be equal;
4. an R3 log of ``--r3-mb`` MB (SGLang responses at Kimi-K2's 61 layers, k = 8, E = 384) imported
   whole and with ``--chunk-sequences 64``, the peak resident memory of each.

Requests per second are the trace's requests times the replays the sweep made (one stack pass for
LRU, one replay per capacity for Belady) over the sweep's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from expertcache.sim import StreamOptions, build_layout
from expertcache.sim.chunked import sweep_chunked
from expertcache.sim.curves.mrc import sweep_layout
from expertcache.trace.chunked import ChunkWriter, open_chunked
from expertcache.trace.synth import PRESETS, synthesize_chunks


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants now (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            ppid = int(fields[1])
            rss[int(d)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def run_measured(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run ``cmd``; (result, wall seconds, peak summed RSS of it and its descendants)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_rss(proc.pid))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.perf_counter() - t0, peak[0]


def write_r3_log(path: Path, size: int, seed: int = 0) -> int:
    """SGLang /v1/completions responses (sglext.routed_experts: base64 int32 [rows, 61, 8], Kimi-K2's
    layers and k, E = 384, the first layer dense) until the file holds ``size`` bytes; the rows."""
    import base64

    import numpy as np

    rng = np.random.default_rng(seed)
    rows_total, i = 0, 0
    with open(path, "w") as fh:
        while fh.tell() < size:
            P, C = int(rng.integers(16, 256)), int(rng.integers(16, 256))
            rows = P + C - 1
            ids = ((np.arange(8) * 48 + rng.integers(0, 384, (rows, 61, 1))) % 384).astype("<i4")  # 8 distinct
            ids[:, 0] = 0
            body = {"id": f"cmpl-{i}", "object": "text_completion", "created": 1, "model": "kimi",
                    "choices": [{"index": 0, "text": "...", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C},
                    "sglext": {"routed_experts": base64.b64encode(ids.tobytes()).decode()}}
            fh.write(json.dumps(body) + "\n")
            rows_total += rows
            i += 1
    return rows_total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per sequence")
    ap.add_argument("--chunk-sequences", type=int, default=32)
    ap.add_argument("--capacities", default="64,128,256", help="experts per layer")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/bench-chunked", help="where the chunked trace is written")
    ap.add_argument("--keep", action="store_true", help="keep the trace (and reuse it when it is there)")
    ap.add_argument("--r3-mb", type=int, default=1024, help="size of the R3 log imported both ways (0: skip)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    big = root / "kimi"
    exe = [sys.executable, "-m", "expertcache.cli.main"]
    record: dict = {"sequences": args.sequences, "tokens_per_sequence": args.tokens, "jobs": args.jobs,
                    "chunk_sequences": args.chunk_sequences, "capacities": args.capacities}

    # 1. write
    if not (args.keep and (big / "chunks.json").exists()):
        r, secs, peak = run_measured(exe + ["synth", "--preset", "kimi-k3", "--tokens", str(args.tokens),
                                            "--sequences", str(args.sequences), "--chunk-sequences",
                                            str(args.chunk_sequences), "--out", str(big), "--json"])
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        record |= {"synth_seconds": secs, "synth_peak_rss_mb": peak / 2**20}
    ct = open_chunked(big)
    size = sum((big / c.file).stat().st_size for c in ct.chunks)
    record |= {"requests": ct.num_requests_upper, "chunks": ct.num_chunks, "disk_mb": size / 2**20}
    print(f"trace: {ct!r}: {ct.num_requests_upper:,} requests, {size / 2**30:.2f} GiB on disk"
          + (f" (synth {record['synth_seconds']:.1f} s, peak RSS {record['synth_peak_rss_mb']:,.0f} MB)"
             if "synth_seconds" in record else " (kept from an earlier run)"))

    # 2. sweep
    caps = [int(c) for c in args.capacities.split(",")]
    r, secs, peak = run_measured(exe + ["sweep", str(big), "--capacities", args.capacities, "-p", "lru", "-p", "belady",
                                        "--jobs", str(args.jobs), "--json"])
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    replays = 1 + len(caps)
    record |= {"sweep_seconds": secs, "sweep_peak_rss_mb": peak / 2**20,
               "requests_per_s": ct.num_requests_upper * replays / secs,
               "results": [{k: row[k] for k in ("policy", "capacity", "copies_steady", "hit_rate", "copies_per_token")}
                           for row in rows]}
    print(f"sweep (lru one pass + belady x {len(caps)}), --jobs {args.jobs}: {secs:.1f} s wall, peak RSS "
          f"{peak / 2**20:,.0f} MB (command + workers), {record['requests_per_s'] / 1e6:.1f} M requests/s")
    print(f"{'policy':8} {'C':>5} {'copies/token':>13} {'hit rate':>9} {'steady copies':>16}")
    for row in rows:
        print(f"{row['policy']:8} {row['capacity']:5d} {row['copies_per_token']:13.2f} {row['hit_rate']:9.4f} "
              f"{row['copies_steady']:16,d}")

    # 3. the 1% prefix, both ways
    n = max(2, args.sequences // 100)
    prefix = root / "prefix"
    params = dataclasses.replace(PRESETS["kimi-k3"].params, tokens=args.tokens, sequences=n)
    with ChunkWriter(prefix) as w:
        for piece in synthesize_chunks(params, 0, chunk_sequences=2, preset="kimi-k3"):
            w.add(piece)
    pct = open_chunked(prefix)
    t0 = time.perf_counter()
    a = sweep_chunked(pct, caps, ["lru", "belady"])
    t_chunked = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = sweep_layout(build_layout(pct.load(), StreamOptions()), caps, ["lru", "belady"])
    t_whole = time.perf_counter() - t0
    agree = all((x.layer_copies_total == y.layer_copies_total).all() and (x.layer_copies_steady == y.layer_copies_steady).all()
                and x.tokens == y.tokens for x, y in zip(a, b))
    record |= {"prefix_sequences": n, "prefix_requests": pct.num_requests_upper, "prefix_agree": agree,
               "prefix_chunked_seconds": t_chunked, "prefix_whole_seconds": t_whole}
    print(f"1% prefix ({n} sequences, {pct.num_requests_upper:,} requests, {pct.num_chunks} chunks): chunked "
          f"{t_chunked:.1f} s, whole {t_whole:.1f} s; counts {'agree' if agree else 'DIFFER'}")
    # 4. an R3 log: imported whole and chunked, peak memory of each
    if args.r3_mb:
        log = root / "r3.jsonl"
        rows_written = write_r3_log(log, args.r3_mb << 20)
        size = log.stat().st_size
        for label, extra, out in (("whole", [], root / "r3.npz"), ("chunked", ["--chunk-sequences", "64"], root / "r3-chunks")):
            r, secs, peak = run_measured(exe + ["import", str(log), "--num-experts", "384", "--top-k", "8", "--out",
                                                str(out), *extra, "--json"])
            ok = r.returncode == 0
            record[f"r3_{label}"] = {"seconds": secs, "peak_rss_mb": peak / 2**20, "ok": ok,
                                     "error": None if ok else r.stderr.strip()[-300:]}
            print(f"R3 import of a {size / 2**20:,.0f} MB log ({rows_written:,} rows), {label}: "
                  + (f"{secs:.1f} s, peak RSS {peak / 2**20:,.0f} MB" if ok else f"failed: {r.stderr.strip()[-200:]}"))
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        log.unlink()
    if not args.keep:
        shutil.rmtree(big, ignore_errors=True)
    shutil.rmtree(prefix, ignore_errors=True)
    if args.json:
        print(json.dumps(record))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
