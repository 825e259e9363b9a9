"""``expertcache sweep | foresight | compare-pools``: curves over one trace, as tables, JSON or plots.

* ``sweep``: miss-ratio curves, copies per token and hit rate against capacity (LRU's from one
  stack pass, exact), with the smallest capacity meeting a target (``--target-*``);
* ``foresight``: share of the LRU-to-Belady gap that h tokens of foresight recover, with other
  policies (by default the causal rules) as references;
* ``compare-pools``: one global pool against an equal per-layer split at the same total budget,
  under fair windows.

Vocabulary: ``-c/--capacity`` is always one value; lists and ranges are ``--capacities``. Records
name things as ``replay`` does (``capacity``, ``policy``, ``layers``, ``trace``, ``needs_future``).
"""

from __future__ import annotations

import argparse
import sys

from ..costmodel import FIGURES
from ..errors import ConfigError
from ..policies import available_policies, make_policy
from ..sim import StreamOptions, build_layout
from ..trace import Trace
from ..sim.curves import (
    CAUSAL_RULES, DEFAULT_HORIZONS, DEFAULT_POLICIES, FAIR_WARM, capacity_bounds, compare_pools,
    foresight_curve, sweep_layout,
)
from .._progress import progress
from .common import (
    add_json, add_parallel_options, add_replay_options, check_plot, describe, emit_json, future_mark,
    future_note, nonnegative_float, open_trace, open_trace_or_chunked, parallel_jobs, positive_int, require, seed_int,
    setup_line, table, wrote,
)
from .budget_opts import (add_tier_options, attach_profile, budget_capacities, budget_range, clamp_capacity,
                          clip_capacities, per_unit, print_budget_sweep)
from .sizing_opts import add_sizing_options, print_targets, resolve_sizing, target_records

POLICY_HELP = (
    f"repeatable; one of {', '.join(available_policies())}, with a parameter as in 'decayed:0.9', 'foresight:16'"
)
CAPACITIES_HELP = "'LO:HI' or 'LO:HI:STEP' (HI included) or a comma list '8,16,32'"


def add_parser(sub) -> None:
    p = _command(sub, "sweep", "miss-ratio curves: copies/token and hit rate against capacity", SWEEP_HELP)
    caps = p.add_mutually_exclusive_group()
    caps.add_argument("--capacities", type=capacity_list, default=None, metavar="SPEC",
                      help=CAPACITIES_HELP + " (default: every capacity from the widest group to E, or L*E in a "
                           "global pool; 1,024 evenly spaced ones when there are more)")
    caps.add_argument("--budgets", type=budget_range, default=None, metavar="RANGE",
                      help="byte budgets over all layers instead: '0.5GB:16GB:x2' (doubling), '1GB:4GB:+1GB' or "
                           "'0.5GB,1GB'; needs --expert-mb (or expert_bytes in the trace meta)")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=POLICY_HELP + " (default: lru and belady)")
    p.add_argument("--replay-lru", action="store_true",
                   help="replay LRU at each capacity instead of the one-pass stack computation (same numbers)")
    p.add_argument("--target-hit-rate", type=unit_fraction, default=None, metavar="X",
                   help="report, per policy, the smallest swept capacity with hit rate >= X (X in (0, 1])")
    p.add_argument("--target-copies", type=nonnegative_float, default=None, metavar="Y",
                   help="report, per policy, the smallest swept capacity with copies/token <= Y (Y >= 0); "
                        "with --target-hit-rate both must hold")
    sample = p.add_mutually_exclusive_group()
    sample.add_argument("--sample-rate", type=unit_fraction, default=None, metavar="R",
                        help="estimate the curves from the (layer, expert) items a hash keeps at rate R in (0, 1] "
                             "(SHARDS-style; needs --capacities; docs/scale.md says where it is accurate)")
    sample.add_argument("--target-error", type=unit_fraction, default=None, metavar="X",
                        help="sample at the smallest rate (1%%, 2%%, 4%%, ...) at which independent hashes agree on "
                             "the miss ratio within a standard error of X")
    p.add_argument("--sample-seed", type=seed_int, default=0, metavar="N", help="the hash's seed, a non-negative integer (default 0)")
    add_replay_options(p)
    add_tier_options(p)
    add_sizing_options(p)
    add_parallel_options(p)
    _outputs(p, "mrc.png", run_sweep)

    p = _command(sub, "foresight", "share of the LRU-to-Belady gap recovered against the foresight horizon",
                 FORESIGHT_HELP)
    p.add_argument("--capacity", "-c", type=positive_int, required=True, help="experts per pool (one value)")
    p.add_argument("--horizons", type=int_list, default=list(DEFAULT_HORIZONS), metavar="H,H,...",
                   help=f"tokens of foresight (default {','.join(map(str, DEFAULT_HORIZONS))})")
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=POLICY_HELP + f"; placed on the curve as a reference (default: {', '.join(CAUSAL_RULES)})")
    add_replay_options(p)
    _outputs(p, "foresight.png", run_foresight)

    p = _command(sub, "compare-pools", "global pool vs equal per-layer split at the same total budget", POOLS_HELP)
    caps = p.add_mutually_exclusive_group(required=True)
    caps.add_argument("--capacity", "-c", type=positive_int, default=None, metavar="C",
                      help="experts per layer, one value (the global pool gets L x C)")
    caps.add_argument("--capacities", type=capacity_list, default=None, metavar="SPEC",
                      help="several per-layer capacities: " + CAPACITIES_HELP)
    p.add_argument("--policy", "-p", action="append", dest="policies", metavar="POLICY",
                   help=POLICY_HELP + f" (default: {', '.join(DEFAULT_POLICIES)})")
    add_replay_options(p, pool=False, warm=FAIR_WARM)
    add_sizing_options(p)
    _outputs(p, "pools.png", run_pools)


def _command(sub, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    return p


def _outputs(p: argparse.ArgumentParser, example: str, func) -> None:
    p.add_argument("--plot", metavar="FILE", default=None,
                   help=f"also draw the curves into FILE, e.g. {example}; the format follows the extension: "
                        ".png, .pdf or .svg (the folder must exist)")
    add_json(p)
    p.set_defaults(func=func)


SWEEP_HELP = """Miss-ratio curves: steady copies per token and hit rate at each capacity, per policy.

Counts are defined in docs/semantics.md, exactly as 'expertcache replay' prints them at one
capacity. LRU's whole curve comes from one pass over the trace (LRU with co-requested experts
protected is a stack algorithm); other policies are replayed at each capacity on one shared layout.
With --target-hit-rate/--target-copies it reports, per policy, the smallest swept capacity that
meets the target, and says so when a larger capacity misses it again. The sizing options add
MB/token, GB/s, ms/token, tokens/s and cache memory (docs/sizing.md).

TRACE may be a chunked trace's folder ('expertcache synth --chunk-sequences'): it is swept one
chunk (or block of layers) at a time in bounded memory, with the same counts (docs/scale.md).
"""

FORESIGHT_HELP = """Limited foresight: the share of the LRU-to-Belady gap in steady copies that farthest-future
eviction recovers when it sees only the next h tokens ('foresight:h'), for each horizon, with other
policies (default: the causal rules) as reference values (0% = LRU, 100% = Belady). See
docs/curves.md; the 'future' column marks policies that read the recorded future.
"""

POOLS_HELP = """Global pool against an equal per-layer split at the same total budget: per-layer pools of C
experts each, or one pool of L x C (layer, expert) items shared by the L layers. Same policy, same
streams and the same fair window (default: warm on the first 60% of each sequence, score the rest).
Differences are global minus split (hit rate in percentage points). See docs/curves.md; the sizing
options add a table of MB/token, GB/s, ms/token, tokens/s and cache memory (docs/sizing.md).
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
        if (hi - lo) // step > 1_000_000:
            raise argparse.ArgumentTypeError(f"{text!r}: more than a million capacities")
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


def unit_fraction(text: str) -> float:
    """A hit rate, a sampling rate or an error: a number in (0, 1]."""
    x = _number(text)
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]")
    return x


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


# ------------------------------------------------------------------------------------ commands
def run_sweep(args) -> int:
    check_plot(args.plot)
    if args.sample_rate is not None or args.target_error is not None:
        return run_sampled(args)
    targeted = args.target_hit_rate is not None or args.target_copies is not None
    if targeted and args.budgets is not None:  # before any work or output
        raise ConfigError("--target-hit-rate/--target-copies work on --capacities; with --budgets read the table")
    trace = open_trace_or_chunked(args.trace)
    chunked = not isinstance(trace, Trace)
    setup = resolve_sizing(args, trace)
    policies = [make_policy(s) for s in (args.policies or ["lru", "belady"])]
    attach_profile(policies, args.profile)
    specs = [p if getattr(p, "takes_profile", False) else p.spec for p in policies]
    options = StreamOptions.from_args(args)
    if chunked:  # a chunked trace: unit by unit, in bounded memory (sim.chunked); the layout's shape only
        from ..sim.chunked import pool_shape

        require(not targeted, "--target-hit-rate/--target-copies need the whole trace's layout; a chunked trace "
                              "gives the curve (read the table)")
        layout = pool_shape(trace, options)
    else:
        layout = build_layout(trace, options)
    capacities, budgets, clipped = args.capacities, None, ""
    if capacities is not None:
        capacities, clipped = clip_capacities(capacities, int(layout.n_items), layout.pool)
        if clipped and args.json:
            print(f"expertcache sweep: note: {clipped}", file=sys.stderr)
    if args.budgets is not None:
        budgets = budget_capacities(args.budgets, layout, setup, lossless=any(p.admits for p in policies))
        capacities = sorted({c for _, c in budgets})
    lo, hi = capacity_bounds(layout)
    n_caps = len(capacities) if capacities else hi - lo + 1
    units = sum(1 if p.spec == "lru" and not args.replay_lru else n_caps for p in policies)
    if chunked:
        from ..sim.chunked import plan_units, sweep_chunked

        with progress(total=len(plan_units(trace, options)), desc="sweep", disable=args.json) as bar:
            curves = sweep_chunked(trace, capacities, specs, options, one_pass=not args.replay_lru, progress=bar.update,
                                   jobs=parallel_jobs(args), ray=args.ray)
    else:
        with progress(total=units, desc="sweep", disable=args.json) as bar:
            curves = sweep_layout(layout, capacities, specs, one_pass=not args.replay_lru, progress=bar.update,
                                  jobs=parallel_jobs(args), ray=args.ray)
    if args.plot:
        from ..report.plots import plot_mrc

        wrote(plot_mrc(curves, args.plot, trace=trace.name, budgets=budgets,
                       target_hit_rate=args.target_hit_rate, target_copies=args.target_copies))
    if budgets is not None:
        return print_budget_sweep(curves, budgets, layout, setup, trace, args)
    targets = target_records(curves, layout, trace, args, setup) if targeted else []
    if args.json:
        emit_json(r.to_dict() | {"trace": trace.name, "method": c.method, "unit": args.unit} | setup.result_record(r)
                  for c in curves for r in c.results)
        emit_json(targets)
        return 0
    print(describe(trace))
    print(setup_line(curves[0], "capacity = experts " + ("in the global pool" if args.pool == "global" else "per layer")))
    if clipped:
        print(clipped)
    with_gap = [c for c in curves if c.policy not in ("lru", "belady") and c.results[0].gap_recovered is not None]
    per = "copies/iter" if args.unit == "iteration" else "copies/tok"
    headers = ["capacity"] + [f"{c.policy} {col}" for c in curves for col in (per, "hit")]
    headers += [f"{c.policy} gap" for c in with_gap]
    rows = []
    for i, cap in enumerate(curves[0].capacities):
        row = [int(cap)]
        for c in curves:
            row += [per_unit(c.results[i], args.unit), c.results[i].hit_rate]
        row += [c.results[i].gap_recovered for c in with_gap]
        rows.append(row)
    table(rows, headers)
    note = future_note([c.policy for c in curves if c.needs_future])
    if note:
        print(note)
    if setup.active:  # one row per (capacity, policy), as compare-pools does: the wide table stays readable
        print("\n" + setup.describe())
        rows = [(int(cap), c.policy, future_mark(c.needs_future), *setup.result_cells(c.results[i]))
                for i, cap in enumerate(curves[0].capacities) for c in curves]
        table(rows, ["capacity", "policy", "future", *setup.headers()])
    if targets:
        print_targets(targets)
    return 0


def run_sampled(args) -> int:
    """``sweep --sample-rate R`` / ``--target-error X``: estimated curves from sampled items (sim.sampled)."""
    from ..sim.sampled import MIN_POOL_ITEMS, choose_rate, sampled_curve

    require(args.capacities is not None, "--sample-rate/--target-error need --capacities (the full trace's)")
    for flag, value in (("--budgets", args.budgets), ("--target-hit-rate", args.target_hit_rate),
                        ("--target-copies", args.target_copies), ("--plot", args.plot)):
        require(value is None, f"{flag} does not combine with a sampled sweep")
    trace = open_trace_or_chunked(args.trace)  # a chunked trace: sampled unit by unit (sim.sampled)
    options = StreamOptions.from_args(args)
    specs = args.policies or ["lru", "belady"]
    run = dict(options=options, jobs=parallel_jobs(args), ray=args.ray)
    curves, chosen = [], {}
    for spec in specs:
        rate, spread = (args.sample_rate, None) if args.sample_rate is not None else \
            choose_rate(trace, args.capacities, spec, args.target_error, **run)
        chosen[spec] = (rate, spread)
        curves.append(sampled_curve(trace, args.capacities, spec, rate, seed=args.sample_seed, **run))
    if args.json:
        emit_json(rec | {"trace": trace.name, "method": "sampled", "standard_error": chosen[spec][1]}
                  for spec, c in zip(specs, curves) for rec in c.records())
        return 0
    print(describe(trace))
    for spec, c in zip(specs, curves):
        rate, spread = chosen[spec]
        how = f", chosen for a standard error of {args.target_error:g} (measured {spread:.4f})" if spread is not None else ""
        print(f"{c.policy}: sampled at rate {rate:g}{how}: {c.kept:,} of {c.items:,} (layer, expert) items kept "
              f"({c.pool_kept:,.1f} a pool), {c.requests:,} requests replayed, {c.seconds:.2f} s")
        if c.pool_kept < MIN_POOL_ITEMS:
            print(f"  note: fewer than {MIN_POOL_ITEMS} items a pool: too few for an estimate (raise the rate)")
    headers = ["capacity"] + [f"{c.policy} {col}" for c in curves for col in ("copies/tok", "hit", "C sampled")]
    rows = [[int(cap)] + [x for c in curves for x in (c.copies_per_token[i], c.hit_rate[i], int(c.sampled_capacities[i]))]
            for i, cap in enumerate(curves[0].capacities)]
    table(rows, headers)
    print("estimates from a sample of the items (docs/scale.md): hit rate of the sample, copies scaled by the kept share")
    return 0


def run_foresight(args) -> int:
    check_plot(args.plot)
    trace = open_trace(args.trace)
    refs = [make_policy(s).spec for s in (args.policies or CAUSAL_RULES)]
    with progress(total=2 + len(args.horizons) + len(refs), desc="foresight", disable=args.json) as bar:
        curve = foresight_curve(trace, args.capacity, args.horizons, refs, pool=args.pool, reset=args.reset,
                                layers=args.layers, warm=args.warm, progress=bar.update)
    if args.plot:
        from ..report.plots import plot_foresight

        wrote(plot_foresight(curve, args.plot, trace=trace.name))
    if args.json:
        emit_json(rec | {"trace": trace.name} for rec in curve.records())
        return 0
    print(describe(trace))
    unit = "in the global pool" if args.pool == "global" else "per layer"
    print(setup_line(curve.lru, f"capacity {curve.capacity} {unit}"))
    rows = [(rec["policy"], future_mark(rec["needs_future"]), rec["role"], rec["horizon"], rec["copies_per_token"],
             rec["hit_rate"], rec["gap_recovered"]) for rec in curve.records()]
    table(rows, ["policy", "future", "role", "horizon", "copies/token", "hit rate", "gap recovered"])
    return 0


def run_pools(args) -> int:
    check_plot(args.plot)
    trace = open_trace(args.trace)
    setup = resolve_sizing(args, trace)
    specs = [make_policy(s).spec for s in (args.policies or DEFAULT_POLICIES)]
    capacities, note = _pool_capacities(args, trace)
    with progress(total=2 * len(specs) * len(capacities), desc="compare-pools", disable=args.json) as bar:
        comps = compare_pools(trace, capacities, specs, warm=args.warm, reset=args.reset, layers=args.layers,
                              progress=bar.update)
    if args.plot:
        from ..report.plots import plot_pools

        wrote(plot_pools(comps, args.plot, trace=trace.name))
    if args.json:
        emit_json(c.to_dict() | {"trace": trace.name} | _pools_sizing(setup, c) for c in comps)
        return 0
    L = len(comps[0].split.layers)
    print(describe(trace))
    if note:
        print(note)
    print(f"{L} layer(s); split = one pool of C per layer, global = one pool of {L} x C; scored tokens "
          f"{comps[0].split.tokens}" + (f" (warm fraction {args.warm:g})" if args.warm else ""))
    rows = [
        (c.capacity, c.shared.capacity, c.policy, future_mark(c.split.needs_future), c.split.hit_rate,
         c.shared.hit_rate, c.hit_rate_diff_pp, c.split.copies_per_token, c.shared.copies_per_token,
         c.copies_per_token_diff)
        for c in comps
    ]
    table(rows, ["C/layer", "global", "policy", "future", "hit split", "hit global", "diff pp",
                 "copies/tok split", "copies/tok global", "diff"])
    if setup.active:
        print("\n" + setup.describe())
        rows = [(c.capacity, c.policy, future_mark(r.needs_future), name, *setup.result_cells(r))
                for c in comps for name, r in (("split", c.split), ("global", c.shared))]
        table(rows, ["C/layer", "policy", "future", "pool", *setup.headers()])
    return 0


def _pool_capacities(args, trace) -> tuple[list[int], str]:
    """Per-layer capacities of compare-pools, clamped or clipped at E with a note."""
    E = trace.num_experts
    if args.capacity is not None:
        capacity, note = clamp_capacity(args.capacity, E)
        return [capacity], note
    return clip_capacities(args.capacities, E)


def _pools_sizing(setup, comp) -> dict:
    """Sizing fields of one comparison: inputs, ``cache_bytes`` (equal for both pools) and every
    other figure twice, suffixed ``_split`` and ``_global`` as the command's other fields are."""
    if not setup.active:
        return {}
    split, shared = setup.result_record(comp.split), setup.result_record(comp.shared)
    out = setup.sizing.inputs() | {"cache_bytes": split["cache_bytes"]}
    for key in FIGURES:
        if key != "cache_bytes":
            out[f"{key}_split"], out[f"{key}_global"] = split[key], shared[key]
    return out
