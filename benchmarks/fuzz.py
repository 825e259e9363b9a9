"""Fuzz the CLI with hostile trace files and routing logs: 10,000 cases by default.

    python benchmarks/fuzz.py                     # 10,000 cases: trace files, JSONL routing logs, SGLang dumps
    python benchmarks/fuzz.py --cases 3000 --kinds args       # hostile option values on a valid trace
    python benchmarks/fuzz.py --cases 500 --seed 7 --kinds trace

Each case is built and judged by ``tests/fuzzing.py`` (its docstring says how): it prints the
number of cases, how many were refused / accepted, by expectation, the failures (tracebacks,
internal errors, hangs, memory above the bound, invalid inputs accepted, valid ones refused,
commands disagreeing) and the slowest command. Exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fuzzing import make_case, run_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="trace,log,sglang",
                    help="comma list of trace, log, sglang (needs torch), args (default: the three input files)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per command before it counts as a hang")
    ap.add_argument("--memory-mb", type=int, default=256, help="peak traced memory per command (default 256 MB)")
    args = ap.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    rng = random.Random(args.seed)
    failures: list[str] = []
    by_expect: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    verdicts: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="expertcache-fuzz-") as tmp:
        for i in range(args.cases):
            case = make_case(rng, kinds)
            root = Path(tmp) / f"c{i}"
            got, ok = run_case(case, root, timeout=args.timeout, memory_limit=args.memory_mb << 20)
            by_kind[case.kind] += 1
            by_expect[case.expect] += 1
            verdicts[(case.expect, {True: "accepted", False: "refused", None: "failed"}[ok])] += 1
            failures += [f"case {i}: {f}" for f in got]
            shutil.rmtree(root, ignore_errors=True)
            if (i + 1) % 1000 == 0:
                print(f"  {i + 1:,} cases, {len(failures)} failure(s), {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    seconds = time.perf_counter() - t0
    print(f"fuzz: {args.cases:,} cases (seed {args.seed}) in {seconds:.0f} s: "
          + ", ".join(f"{n:,} {k}" for k, n in sorted(by_kind.items())))
    for e in ("invalid", "valid", "any"):
        print(f"  built {e:8} {by_expect[e]:6,}: " + ", ".join(
            f"{verdicts[(e, v)]:,} {v}" for v in ("refused", "accepted", "failed")))
    print(f"  failures: {len(failures)} (tracebacks, internal errors, hangs, memory, wrong acceptance, disagreement)")
    for line in failures[:50]:
        print("   ", line[:400])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
