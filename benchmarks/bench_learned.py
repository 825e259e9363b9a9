"""Replay speed of ``learned:`` scorers against ``decayed``, measured in the same run.

A synthetic olmoe-like trace (``--tokens`` per sequence, 4 sequences, 16 layers, E=64, k=8) at
capacity 32 per layer. A linear and an MLP scorer are trained on its events (lru states), then the
trace is replayed by: ``decayed`` (compiled plan), ``decayed`` through the Python engine (the
reference cache driving the policy object: the path ``learned:`` takes), ``learned`` linear and
``learned`` mlp (Python engine, one vectorised scoring call per eviction). Printed: seconds (best
of ``--repeat`` after a warm-up), requests/s, and each row's slowdown relative to compiled decayed.
Run: ``python benchmarks/bench_learned.py [--tokens N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import time

from expertcache.learn.dataset import build_dataset
from expertcache.learn.models import fit
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout
from expertcache.trace.synth import synthesize_preset


def best_of(fn, repeat):
    fn()
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    trace = synthesize_preset("olmoe", tokens=args.tokens, sequences=4, seed=0)
    C = 32
    ev = build_dataset(trace, C, states=("lru",))
    scorers = {k: fit(ev.X, ev.victim, ev.offsets, ev.features, kind=k, seed=0) for k in ("linear", "mlp")}
    layout = build_layout(trace)
    runs = [("decayed (compiled)", lambda: replay_layout(layout, C, "decayed")),
            ("decayed (python engine)", lambda: replay_layout(layout, C, "decayed", engine="python")),
            ("learned linear (python)", lambda: replay_layout(layout, C, Learned(scorers["linear"], "linear"))),
            ("learned mlp (python)", lambda: replay_layout(layout, C, Learned(scorers["mlp"], "mlp")))]
    requests = int((layout.groups >= 0).sum())
    print(f"trace: {trace.num_tokens} tokens x {trace.num_layers} layers, k={trace.top_k}, E={trace.num_experts}, "
          f"C={C}; {requests} requests; {ev.X.shape[1]} features")
    base = None
    print(f"{'policy':26s} {'seconds':>9s} {'requests/s':>12s} {'x decayed':>10s} {'steady copies':>14s}")
    for name, fn in runs:
        sec, res = best_of(fn, args.repeat)
        base = base or sec
        print(f"{name:26s} {sec:9.3f} {requests / sec:12.0f} {sec / base:10.1f} {res.copies_steady:14d}")


if __name__ == "__main__":
    main()
