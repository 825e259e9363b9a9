"""The file-backed tier's capacity sweep on this machine (issue 10's last "Must be true" item).

    python benchmarks/tier_sweep.py [--workdir DIR] [--keep]

Writes a 1.024 GB pool (16 layers x 64 experts x 1 MB, pseudo-random bytes) for a synthetic
OLMoE-shaped trace (one sequence of 32 rows, k=4: 2048 accesses = 2.048 GB per pass), then runs

1. ``tier sweep`` over 128MB, 256MB, 512MB, 1GB for pagecache, arena and nocache, 3 interleaved
   repeats, capacity order shuffled per run (seeded), wall auto; the wall's headroom calibrated by
   the harness per mode (the worker's own memory), so the page cache or the arena gets the capacity;
2. the advice A/B at 256MB: pagecache with and without ``--advice oracle`` (fadvise), 3 runs each.

It prints the commands, the T(C) table (median of runs), device bytes against the demand model,
the pagecache/nocache repeat-read ratio at the largest capacity (both measured in this run), and
the advice result. Takes about 3-5 minutes on a 2-core VM with a ~1 GB/s disk; the pool is removed
afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CAPS = "128MB,256MB,512MB,1GB"
MODES = ("pagecache", "arena", "nocache")


def sh(argv: list[str]) -> str:
    print("$ " + " ".join(argv), flush=True)
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", help="where the pool goes (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the pool and trace")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="expertcache-tier-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ec = [sys.executable, "-m", "expertcache.cli.main"]
    t0 = time.time()
    try:
        trace, pool = str(work / "trace.npz"), str(work / "pool")
        sh(ec + ["synth", "--preset", "olmoe", "--tokens", "32", "--sequences", "1", "--num-layers", "16",
                 "--top-k", "4", "--out", trace])
        print(sh(ec + ["tier", "write", "--pool", pool, "--from-trace", trace, "--expert-mb", "1"]).strip())
        # the wall is capacity + headroom; without --headroom each command first measures the worker's
        # own memory (a calibration run) and uses that, so the page cache (or the arena) gets the capacity
        base = ["--pool", pool, "--threads", "4"]
        load = [os.getloadavg()[0]]
        out = sh(ec + ["tier", "sweep", trace, *base, "--capacities", CAPS, "--repeats", "3", "--seed", "0",
                       *[x for m in MODES for x in ("--mode", m)], "--json"])
        recs = [json.loads(x) for x in out.splitlines()]
        runs = [r for r in recs if not r.get("summary")]
        summ = [r for r in recs if r.get("summary")]
        load.append(os.getloadavg()[0])
        common = base
        adv = {}
        for label, extra in (("no advice", []), ("oracle fadvise", ["--advice", "oracle", "--delivery", "fadvise"])):
            o = sh(ec + ["tier", "replay", trace, *common, "--capacity", "256MB", "--repeats", "3", *extra, "--json"])
            adv[label] = [json.loads(x) for x in o.splitlines()]
        load.append(os.getloadavg()[0])
        report(runs, summ, adv, time.time() - t0)
        print(f"load average (1 min) at the start, after the sweep, at the end: {', '.join(f'{x:.1f}' for x in load)} "
              f"on {os.cpu_count()} CPUs")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(runs, summ, adv, seconds) -> None:
    r0 = runs[0]
    print(f"\npool {r0['pool_bytes'] / 1e9:.3f} GB ({r0['expert_bytes'] / 1e6:g} MB experts), {r0['iterations']} "
          f"iterations x {r0['accesses'] // r0['iterations']} accesses, {r0['bytes_read'] / 1e9:.3f} GB read per pass")
    walls = sorted({str(r["capacity_enforced_by"]).split(":")[0] for r in runs})
    print(f"capacity enforced by: {', '.join(walls)}; proof ok in {sum(r['proof_ok'] for r in runs)}/{len(runs)} runs; "
          f"reclaim setup: {json.dumps(r0.get('reclaim_setup'))}")
    other = sum(bool(r.get("device_other_readers")) for r in runs)
    print(f"device: {r0['accounting'].get('device')}; runs whose device read more than the process itself "
          f"(other readers): {other}/{len(runs)}; amplification and 'own MB/it' use the process's own read_bytes")
    print(f"\n{'mode':10} {'C GB':>6} {'s/iter':>8} {'spread':>7} {'own MB/it':>10} {'dev MB/it':>10} {'ref MB/it':>10} "
          f"{'demand MB/it':>13} {'amplif':>7} {'arena MB':>9} {'proof':>6}")
    for s in sorted(summ, key=lambda s: (MODES.index(s["mode"]), s["capacity_bytes"])):
        f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        print(f"{s['mode']:10} {s['capacity_bytes'] / 1e9:6.3f} {f(s['seconds_per_iteration_median'], '8.4f')} "
              f"{f(s['seconds_per_iteration_spread'], '7.3f')} {f(_mb(s['read_bytes_self_per_iteration_median']), '10.1f')} "
              f"{f(_mb(s['device_read_bytes_per_iteration_median']), '10.1f')} "
              f"{f(_mb(s['reference_bytes_per_iteration']), '10.1f')} {f(_mb(s['demand_miss_bytes_per_iteration']), '13.1f')} "
              f"{f(s['amplification_median'], '7.2f')} {(s['bytes_from_arena'] or 0) / 1e6:9.0f} {str(s['proof_ok']):>6}")
    for note in sorted({r.get("wall_note") for r in runs if r.get("wall_note")}):
        print(f"wall note: {note}")
    cmax = max(s["capacity_bytes"] for s in summ)
    at = {s["mode"]: s for s in summ if s["capacity_bytes"] == cmax}
    if "pagecache" in at and "nocache" in at:
        ratio = at["nocache"]["seconds_per_iteration_median"] / at["pagecache"]["seconds_per_iteration_median"]
        print(f"\nrepeat-read ratio at C={cmax / 1e9:g} GB: nocache / pagecache seconds per iteration = {ratio:.2f}x "
              f"(the paper's mechanism ceiling was 5.3x on its machine)")
    from expertcache.tier.sweep import comparisons
    print("\nper capacity (a lead inside the runs' range is a tie):")
    for c in comparisons(summ):
        print(f"  C={c['capacity_bytes'] / 1e9:g} GB {c['modes'][0]} vs {c['modes'][1]}: {c['verdict']}"
              + ("" if c["lead"] is None else f" (lead {c['lead']:.1%})"))
    print("\nadvice at C=0.256 GB, pagecache (median of 3 runs):")
    for label, recs in adv.items():
        med = statistics.median(r["seconds_per_iteration_median"] for r in recs)
        own = statistics.median(r["read_bytes_self"] or 0 for r in recs) / 1e6
        spread = max(r["seconds_per_iteration_median"] for r in recs) / min(r["seconds_per_iteration_median"] for r in recs) - 1
        line = f"  {label:15} {med:.4f} s/iter (max/min - 1 over runs {spread:.0%}), read (own) {own:,.1f} MB"
        a = recs[0].get("advice")
        if a:
            line += (f"; counters submitted {a['submitted']} = overwritten {a['overwritten']} + completed "
                     f"{a['completed']} + pending {a['pending']}; addressable misses {recs[0]['advice_addressable_misses']} "
                     f"of {recs[0]['demand_misses']}")
        print(line)
    print(f"\ntotal {seconds:.0f} s")


def _mb(x):
    return None if x is None else x / 1e6


if __name__ == "__main__":
    sys.exit(main())
