"""``expertcache sweep | foresight | compare-pools``: curves over one trace, as tables, JSON or PNG.

* ``sweep``: miss-ratio curves, copies per token and hit rate against capacity (LRU's from one
  stack pass, exact);
* ``foresight``: share of the LRU-to-Belady gap that h tokens of foresight recover, with the
  causal rules as references (seed 001, Fig. 2);
* ``compare-pools``: one global pool against an equal per-layer split at the same total budget,
  under fair windows (seed 004, section 3).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator

from ..policies import available_policies, make_policy
from ..sim import build_layout
from ..sim.curves import (
    CAUSAL_RULES, DEFAULT_HORIZONS, DEFAULT_POLICIES, FAIR_WARM, capacity_bounds, compare_pools, foresight_curve,
    sweep_layout,
)
from .common import add_json, add_replay_options, describe, emit_json, open_trace, positive_int, setup_line, table

POLICY_HELP = (
    f"repeatable; one of {', '.join(available_policies())}, with a parameter as in 'decayed:0.9', 'foresight:16'"
)


def add_parser(sub) -> None:
    p = _command(sub, "sweep", "miss-ratio curves: copies/token and hit rate against capacity", SWEEP_HELP)
    p.add_argument("--capacities", "-c", type=capacity_list, default=None, metavar="SPEC",
                   help="'LO:HI' or 'LO:HI:STEP' (HI included) or a comma list '8,16,32' "
                        "(default: every capacity from the widest group to E, or L*E in a global pool)")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=POLICY_HELP + " (default: lru and belady)")
    p.add_argument("--replay-lru", action="store_true",
                   help="replay LRU at each capacity instead of the one-pass stack computation (same numbers)")
    add_replay_options(p)
    _outputs(p, "mrc.png", run_sweep)

    p = _command(sub, "foresight", "share of the LRU-to-Belady gap recovered against the foresight horizon",
                 FORESIGHT_HELP)
    p.add_argument("--capacity", "-c", type=positive_int, required=True, help="experts per pool")
    p.add_argument("--horizons", type=int_list, default=list(DEFAULT_HORIZONS), metavar="H,H,...",
                   help=f"tokens of foresight (default {','.join(map(str, DEFAULT_HORIZONS))})")
    p.add_argument("--reference", action="append", dest="references", metavar="POLICY",
                   help=f"repeatable causal rule to place on the curve (default: {', '.join(CAUSAL_RULES)})")
    add_replay_options(p)
    _outputs(p, "foresight.png", run_foresight)

    p = _command(sub, "compare-pools", "global pool vs equal per-layer split at the same total budget", POOLS_HELP)
    p.add_argument("--capacity", "-c", type=capacity_list, required=True, metavar="C",
                   help="experts per layer (the global pool gets L x C); several as 'LO:HI[:STEP]' or '8,16,32'")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=POLICY_HELP + f" (default: {', '.join(DEFAULT_POLICIES)})")
    add_replay_options(p, pool=False, warm=FAIR_WARM)
    _outputs(p, "pools.png", run_pools)


def _command(sub, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    return p


def _outputs(p: argparse.ArgumentParser, example: str, func) -> None:
    p.add_argument("--plot", metavar="PNG", default=None, help=f"also draw the curves into this PNG file, e.g. {example}")
    add_json(p)
    p.set_defaults(func=func)


SWEEP_HELP = """Miss-ratio curves: steady copies per token and hit rate at each capacity, per policy.

Counts follow DESIGN section 2, exactly as 'expertcache replay' prints them at one capacity. LRU's
whole curve comes from one pass over the trace (LRU with co-requested experts protected is a
stack algorithm); other policies are replayed at each capacity on one shared layout.
"""

FORESIGHT_HELP = """Limited foresight: the share of the LRU-to-Belady gap in steady copies that farthest-future
eviction recovers when it sees only the next h tokens ('foresight:h'), for each horizon, with the
causal rules as reference values (0% = LRU, 100% = Belady).
"""

POOLS_HELP = """Global pool against an equal per-layer split at the same total budget: per-layer pools of C
experts each, or one pool of L x C (layer, expert) items shared by the L layers. Same policy, same
streams and the same fair window (default: warm on the first 60% of each sequence, score the rest).
Differences are global minus split (hit rate in percentage points).
"""


# ------------------------------------------------------------------------------------ options
def capacity_list(text: str) -> list[int]:
    """``'8:64'`` / ``'8:64:8'`` (stop included) or ``'8,16,32'`` -> sorted distinct positive ints."""
    try:
        parts = [int(x) for x in text.split(":")] if ":" in text else None
        out = [int(x) for x in text.split(",") if x.strip()] if parts is None else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} (expected e.g. '8:64', '8:64:8' or '8,16,32')") from None
    if parts is not None:
        if len(parts) not in (2, 3):
            raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI or LO:HI:STEP")
        lo, hi, step = parts[0], parts[1], parts[2] if len(parts) == 3 else 1
        if hi < lo or step < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: need LO <= HI and STEP >= 1")
        out = list(range(lo, hi + 1, step))
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: capacities must be positive integers")
    return sorted(set(out))


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} (expected e.g. '1,2,4,8')") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers")
    return sorted(set(out))


@contextlib.contextmanager
def progress(total: int, what: str) -> Iterator:
    """A callable advancing a progress bar on stderr (tqdm, when installed and stderr is a
    terminal); a no-op otherwise, so pipes and JSON output stay clean."""
    bar = None
    if sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            bar = tqdm(total=total, desc=what, unit="replay", leave=False, file=sys.stderr)
    try:
        yield (bar.update if bar is not None else (lambda n: None))
    finally:
        if bar is not None:
            bar.close()


def wrote(path) -> None:
    print(f"wrote {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------ commands
def run_sweep(args) -> int:
    trace = open_trace(args.trace)
    specs = [make_policy(s).spec for s in (args.policies or ["lru", "belady"])]
    layout = build_layout(trace, pool=args.pool, reset=args.reset, layers=args.layers, warm=args.warm)
    lo, hi = capacity_bounds(layout)
    n_caps = len(args.capacities) if args.capacities else hi - lo + 1
    units = sum(1 if s == "lru" and not args.replay_lru else n_caps for s in specs)
    with progress(units, "sweep") as tick:
        curves = sweep_layout(layout, args.capacities, specs, one_pass=not args.replay_lru, progress=tick)
    if args.plot:
        from ..report.plots import plot_mrc

        wrote(plot_mrc(curves, args.plot, trace=trace.name))
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name, "method": c.method} for c in curves for r in c.results)
        return 0
    print(describe(trace))
    print(setup_line(curves[0], "capacity = experts " + ("in the global pool" if args.pool == "global" else "per layer")))
    with_gap = [c for c in curves if c.policy not in ("lru", "belady") and c.results[0].gap_recovered is not None]
    headers = ["capacity"] + [f"{c.policy} {col}" for c in curves for col in ("copies/tok", "hit")]
    headers += [f"{c.policy} gap" for c in with_gap]
    rows = []
    for i, cap in enumerate(curves[0].capacities):
        row = [int(cap)]
        for c in curves:
            row += [c.results[i].copies_per_token, c.results[i].hit_rate]
        row += [c.results[i].gap_recovered for c in with_gap]
        rows.append(row)
    table(rows, headers)
    return 0


def run_foresight(args) -> int:
    trace = open_trace(args.trace)
    refs = [make_policy(s).spec for s in (args.references or CAUSAL_RULES)]
    with progress(2 + len(args.horizons) + len(refs), "foresight") as tick:
        curve = foresight_curve(trace, args.capacity, args.horizons, refs, pool=args.pool, reset=args.reset,
                                layers=args.layers, warm=args.warm, progress=tick)
    if args.plot:
        from ..report.plots import plot_foresight

        wrote(plot_foresight(curve, args.plot, trace=trace.name))
    if args.json:
        emit_json(rec | {"trace": trace.name} for rec in curve.records())
        return 0
    print(describe(trace))
    unit = "in the global pool" if args.pool == "global" else "per layer"
    print(setup_line(curve.lru, f"capacity {curve.capacity} {unit}"))
    rows = [(rec["policy"], rec["role"], rec["horizon"], rec["copies_per_token"], rec["hit_rate"], rec["gap_recovered"])
            for rec in curve.records()]
    table(rows, ["policy", "role", "horizon", "copies/token", "hit rate", "gap recovered"])
    return 0


def run_pools(args) -> int:
    trace = open_trace(args.trace)
    specs = [make_policy(s).spec for s in (args.policies or DEFAULT_POLICIES)]
    with progress(2 * len(specs) * len(args.capacity), "compare-pools") as tick:
        comps = compare_pools(trace, args.capacity, specs, warm=args.warm, reset=args.reset, layers=args.layers,
                              progress=tick)
    if args.plot:
        from ..report.plots import plot_pools

        wrote(plot_pools(comps, args.plot, trace=trace.name))
    if args.json:
        emit_json(c.to_dict() | {"trace": trace.name} for c in comps)
        return 0
    L = len(comps[0].split.layers)
    print(describe(trace))
    print(f"{L} layer(s); split = one pool of C per layer, global = one pool of {L} x C; scored tokens "
          f"{comps[0].split.tokens}" + (f" (warm fraction {args.warm:g})" if args.warm else ""))
    rows = [
        (c.capacity, c.shared.capacity, c.policy, c.split.hit_rate, c.shared.hit_rate, c.hit_rate_diff_pp,
         c.split.copies_per_token, c.shared.copies_per_token, c.copies_per_token_diff)
        for c in comps
    ]
    table(rows, ["C/layer", "global", "policy", "hit split", "hit global", "diff pp",
                 "copies/tok split", "copies/tok global", "diff"])
    return 0
