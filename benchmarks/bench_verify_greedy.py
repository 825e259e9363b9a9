"""Where verify-greedy spends its time, as ratios against references measured in the same run.

* per instance: generation, belady replay, flattened MIN (3 orders), the exact program; each as a
  multiple of the belady replay (the reference: one compiled replay of the same stream);
* the compiled exact program against the same demand-fetch program written with Python sets;
* the parallel run against one process (speed-up; at most the number of cores).

Run: ``.venv/bin/python benchmarks/bench_verify_greedy.py [instances]``. Prints a plain report;
nothing is asserted.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import numpy as np

from expertcache.bounds import flat_min_totals, make_instance, optimal_total, verify_greedy
from expertcache.bounds.streams import bare_layout, stream_totals


def python_demand_dp(groups: np.ndarray, capacity: int) -> int:
    """The exact program's recursion with frozensets and a dict (no bitmasks, no compilation)."""
    stream = [frozenset(int(e) for e in row if e >= 0) for row in groups]
    later = [frozenset().union(*stream[t + 1:]) for t in range(len(stream))]
    best = {frozenset(): 0}
    for t, demand in enumerate(stream):
        nxt: dict = {}
        for r, cost in best.items():
            u = r | demand
            over = len(u) - capacity
            cost += len(demand - r)
            victims = itertools.combinations(sorted(r - demand), over) if over > 0 else [()]
            for v in victims:
                s = (u - set(v)) & later[t]
                if cost < nxt.get(s, 1 << 30):
                    nxt[s] = cost
        best = nxt
    return min(best.values())


def timed(fn, items):
    t0 = time.perf_counter()
    out = [fn(x) for x in items]
    return time.perf_counter() - t0, out


def main(n: int) -> None:
    check = make_instance(0, 0)  # compile everything once
    optimal_total(check.groups, check.capacity)
    flat_min_totals(bare_layout(check.groups, np.array([0, check.tokens]), check.n_items), check.capacity)

    t_gen, insts = timed(lambda i: make_instance(0, i), range(n))
    layouts = [bare_layout(x.groups, np.array([0, x.tokens]), x.n_items) for x in insts]
    pairs = list(zip(insts, layouts))
    t_greedy, greedy = timed(lambda p: stream_totals(p[1], p[0].capacity, "belady")[0], pairs)
    t_flat, _ = timed(lambda p: flat_min_totals(p[1], p[0].capacity).max(), pairs)
    t_exact, exact = timed(lambda x: optimal_total(x.groups, x.capacity).total, insts)
    sub = insts[: max(1, n // 10)]
    t_py, py = timed(lambda x: python_demand_dp(x.groups, x.capacity), sub)
    t_nb, nb = timed(lambda x: optimal_total(x.groups, x.capacity).total, sub)
    assert py == nb and all(g >= e for g, e in zip(greedy, exact))

    print(f"{n} instances, per instance (ratio to one compiled belady replay = {1e3 * t_greedy / n:.3f} ms):")
    for name, t in [("generate", t_gen), ("belady replay", t_greedy), ("flattened MIN, 3 orders", t_flat),
                    ("exact program", t_exact)]:
        print(f"  {name:<24} {1e3 * t / n:8.3f} ms  {t / t_greedy:6.2f}x")
    print(f"exact program: compiled bitmask DP is {t_py / t_nb:.0f}x faster than the Python-set DP "
          f"({len(sub)} instances, same answers)")

    jobs = os.cpu_count() or 1
    one = verify_greedy(n, seed=1, jobs=1)
    many = verify_greedy(n, seed=1, jobs=jobs)
    print(f"verify_greedy({n}): 1 job {one.seconds:.2f} s, {jobs} jobs {many.seconds:.2f} s, "
          f"speed-up {one.seconds / many.seconds:.2f}x; 42,000 instances would take about "
          f"{42_000 / n * many.seconds:.0f} s on {jobs} jobs")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
