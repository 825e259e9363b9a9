"""Replay speed of ``learned:`` scorers against ``decayed``, measured in the same run.

The trace: ``--trace PATH`` (default: the shared FLAME-MoE trace, ``../shared/traces/
flame-moe-290m-teacher-forced/routing.npz``, when it is beside the checkout; otherwise a synthetic
olmoe-like trace, ``--tokens`` per sequence, 4 sequences, 16 layers, E=64, k=8), at ``--capacity``
per layer (default 32), ``--pool`` layer or global (a global pool gets ``capacity x layers``).
A linear and an MLP scorer (``--features``, default every group the trace has: reuse, the routing
priors, gate weights where the trace has ``probs``) are trained on its events in lru states, then the trace is replayed by ``decayed`` and both scorers,
each through its compiled plan and through the Python engine (the reference cache driving the
policy object). Printed per row: seconds (median and range of ``--repeat`` rounds, every row once per round, after a
warm-up round, which also compiles), requests/s at the median, the ratio of its median to compiled ``decayed``'s and to
``decayed``'s on the same engine, and steady copies (every row of a scorer must print the same
count). The python-engine rows are the live harness's cache step (``ExpertCache`` driving the
policy): the scorer's compiled feature state, then FeatureState, the Python reference it replaced.

Then learning, same run (``--learn-repeat`` rounds, interleaved, after a warm-up): event collection
in lru states with the compiled feature state against FeatureState (the events must be the same
bits), and the MLP step's products (``h = Z[rows] @ W1 + b1``; ``Z[rows].T @ dh``, ``dh``'s sum
and ``a.T @ ds`` with ``dh = ds w2 (h > 0)``, on one minibatch of the trace's events, 256 events,
32 hidden) compiled against ``numpy.einsum`` and numpy's sum (how they were computed before; the
same bits).
Run: ``python benchmarks/bench_learned.py [--trace PATH] [--capacity C] [--pool P] [--repeat R] [--features GROUPS]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from expertcache.learn.dataset import build_dataset, collect
from expertcache.policies import make_policy
from expertcache.scorer.features import TABLED
from expertcache.scorer.kernels_train import mlp_backward, pre_activation
from expertcache.scorer.models import fit
from expertcache.scorer.signals import halved
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout
from expertcache.trace import load_trace
from expertcache.trace.synth import synthesize_preset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces" / "flame-moe-290m-teacher-forced" / "routing.npz"


def timed(fns, repeat):
    """Seconds of ``repeat`` rounds of every call of ``fns`` (interleaved, so a change of load falls on
    all of them alike) after a warm-up round (which also compiles), and each one's last result."""
    outs = [fn() for fn in fns]
    secs = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[i] = fn()
            secs[i].append(time.perf_counter() - t0)
    return secs, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(SHARED) if SHARED.is_file() else None)
    ap.add_argument("--tokens", type=int, default=250, help="synthetic trace only")
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--pool", choices=("layer", "global"), default="layer")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--features", default=None, help="feature groups, e.g. reuse or reuse,prior (default: all the trace has)")
    ap.add_argument("--learn-repeat", type=int, default=3, help="rounds of the learning table")
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
        ref = Learned(pol.scorer, pol.path, reference=True)
        runs += [(f"learned {kind} (compiled)", pol, "compiled"), (f"learned {kind} (python engine)", pol, "python"),
                 (f"learned {kind} (python, FeatureState)", ref, "python")]
    requests = int((layout.groups >= 0).sum())
    print(f"trace: {trace.name}, {trace.num_tokens} tokens x {trace.num_layers} layers, k={trace.top_k}, "
          f"E={trace.num_experts}, {args.pool} pool C={C}; {requests} requests; {ev.X.shape[1]} features "
          f"({', '.join(ev.features)}); {args.repeat} repeats each")
    base = {}
    print(f"{'policy':40s} {'seconds median [min-max]':>28s} {'requests/s':>11s} {'x decayed':>10s} "
          f"{'x decayed, same engine':>23s} {'steady copies':>14s}")
    all_secs, results = timed([lambda pol=pol, engine=engine: replay_layout(layout, C, pol, engine=engine)
                               for _, pol, engine in runs], args.repeat)
    for (name, pol, engine), secs, res in zip(runs, all_secs, results):
        assert res.engine == engine
        med = statistics.median(secs)
        base.setdefault(engine, med)
        spread = f"{med:.4f} [{min(secs):.4f}-{max(secs):.4f}]"
        print(f"{name:40s} {spread:>28s} {requests / med:11.0f} {med / base['compiled']:10.1f} "
              f"{med / base[engine]:23.2f} {res.copies_steady:14d}")
    learning(trace, ev, C, args)


def learning(trace, ev, C, args) -> None:
    """The learning table: collection and the MLP step's products, each compiled against its reference."""
    tabled = bool(set(ev.features) & set(TABLED))  # build_dataset fitted the tables on the halved trace
    lay = build_layout(halved(trace) if tabled else trace, pool=args.pool)
    rows_of = [lambda ref=ref: collect(lay, C, make_policy("lru"), ev.features, 0, ev.tables, reference=ref)
               for ref in (False, True)]
    secs, (fast, ref) = timed(rows_of, args.learn_repeat)
    same = all(np.array_equal(getattr(fast, f), getattr(ref, f)) for f in ("X", "victim", "offsets", "item", "step"))
    X = np.asarray(ev.X, dtype=np.float64)
    Z = (X - X.mean(axis=0)) / np.where(X.std(axis=0) > 1e-9, X.std(axis=0), 1.0)
    rows = np.arange(ev.offsets[min(256, ev.num_events)], dtype=np.int64)  # the first 256 events' rows
    rng = np.random.default_rng(0)
    W1, b1, w2 = rng.normal(size=(Z.shape[1], 32)), rng.normal(size=32), rng.normal(size=32)
    ds = rng.normal(size=rows.size)
    steps = 50

    def compiled():
        for _ in range(steps):
            h = pre_activation(Z, rows, W1, b1)
            out = (h, *mlp_backward(Z, rows, h, np.maximum(h, 0.0), ds, w2))
        return out

    def einsum():
        for _ in range(steps):
            Zr = Z[rows]
            h = np.einsum("nf,fh->nh", Zr, W1) + b1
            a = np.maximum(h, 0.0)
            dh = ds[:, None] * w2[None, :] * (h > 0)
            out = h, np.einsum("nf,nh->fh", Zr, dh), dh.sum(axis=0), np.einsum("nh,n->h", a, ds)
        return out

    psecs, (pc, pe) = timed([compiled, einsum], args.learn_repeat)
    same_p = all(np.array_equal(a, b) for a, b in zip(pc, pe))
    print(f"\nlearning: {len(ev.features)} features; {fast.num_events} events in lru states "
          f"(same bits: {same}); products of one step on {rows.size} rows (same bits: {same_p}); "
          f"{args.learn_repeat} repeats each")
    print(f"{'part':52s} {'seconds median [min-max]':>28s} {'x reference':>12s}")
    for part, ss, unit in (("collection, compiled feature state", secs[0], 1), ("collection, FeatureState (reference)",
                           secs[1], 1), ("MLP step products, compiled (ms per step)", psecs[0], steps),
                           ("MLP step products, einsum (ms per step)", psecs[1], steps)):
        scale = 1e3 / unit if unit > 1 else 1.0
        med = statistics.median(ss) * scale
        refmed = statistics.median(secs[1] if unit == 1 else psecs[1]) * scale
        print(f"{part:52s} {f'{med:.4f} [{min(ss) * scale:.4f}-{max(ss) * scale:.4f}]':>28s} {med / refmed:12.2f}")


if __name__ == "__main__":
    main()
