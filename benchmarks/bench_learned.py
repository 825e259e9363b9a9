"""Replay speed of ``learned:`` scorers against ``decayed``, measured in the same run.

The trace: ``--trace PATH`` (default: the shared FLAME-MoE trace, ``../shared/traces/
flame-moe-290m-teacher-forced/routing.npz``, when it is beside the checkout; otherwise a synthetic
olmoe-like trace, ``--tokens`` per sequence, 4 sequences, 16 layers, E=64, k=8), at ``--capacity``
per layer (default 32), ``--pool`` layer or global (a global pool gets ``capacity x layers``).
A linear and an MLP scorer (``--features``, default every group the trace has: reuse, the routing
priors, gate weights where the trace has ``probs``) are trained on its events in lru states, then the trace is replayed by ``decayed`` and both scorers,
each through its compiled plan and through the Python engine (the reference cache driving the
policy object). Printed per row: seconds (best of ``--repeat`` after a warm-up, which also
compiles), requests/s, the ratio of its seconds to compiled ``decayed``'s, and steady copies (a
compiled row and its Python row must print the same count).
Run: ``python benchmarks/bench_learned.py [--trace PATH] [--capacity C] [--pool P] [--repeat R] [--features GROUPS]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from expertcache.learn.dataset import build_dataset
from expertcache.learn.models import fit
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout
from expertcache.trace import load_trace
from expertcache.trace.synth import synthesize_preset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces" / "flame-moe-290m-teacher-forced" / "routing.npz"


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
    ap.add_argument("--trace", default=str(SHARED) if SHARED.is_file() else None)
    ap.add_argument("--tokens", type=int, default=250, help="synthetic trace only")
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--pool", choices=("layer", "global"), default="layer")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--features", default=None, help="feature groups, e.g. reuse or reuse,prior (default: all the trace has)")
    args = ap.parse_args()
    trace = load_trace(args.trace) if args.trace else synthesize_preset("olmoe", tokens=args.tokens, sequences=4, seed=0)
    C = args.capacity * (trace.num_layers if args.pool == "global" else 1)
    ev = build_dataset(trace, C, states=("lru",), pool=args.pool, features=args.features)
    scorers = {}
    for kind in ("linear", "mlp"):
        sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind=kind, seed=0)
        sc.tables = None if ev.tables is None else ev.tables.full  # the routing tables the prior group reads
        scorers[kind] = Learned(sc, kind)
    layout = build_layout(trace, pool=args.pool)
    runs = [("decayed (compiled)", "decayed", "compiled"), ("decayed (python engine)", "decayed", "python")]
    for kind, pol in scorers.items():
        runs += [(f"learned {kind} (compiled)", pol, "compiled"), (f"learned {kind} (python engine)", pol, "python")]
    requests = int((layout.groups >= 0).sum())
    print(f"trace: {trace.name}, {trace.num_tokens} tokens x {trace.num_layers} layers, k={trace.top_k}, "
          f"E={trace.num_experts}, {args.pool} pool C={C}; {requests} requests; {ev.X.shape[1]} features "
          f"({', '.join(ev.features)})")
    base = None
    print(f"{'policy':32s} {'seconds':>9s} {'requests/s':>12s} {'x decayed':>10s} {'steady copies':>14s}")
    for name, pol, engine in runs:
        sec, res = best_of(lambda: replay_layout(layout, C, pol, engine=engine), args.repeat)
        assert res.engine == engine
        base = base or sec
        print(f"{name:32s} {sec:9.4f} {requests / sec:12.0f} {sec / base:10.1f} {res.copies_steady:14d}")


if __name__ == "__main__":
    main()
