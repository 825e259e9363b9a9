"""Options of the tiering paper's trace side, shared by ``replay`` and ``sweep``.

``--budget BYTES`` / ``--budgets RANGE`` (a capacity from a byte budget and the expert size:
:mod:`expertcache.sim.budget`), ``--profile TRACE`` (the off-domain frequency table of ``static``),
``--admission all|second`` and ``--unit token|iteration`` (the unit of the per-x column).
"""

from __future__ import annotations

import argparse
import functools

from .._units import format_bytes, parse_byte_range, parse_bytes
from ..errors import ConfigError
from ..sim.budget import Budget
from ..sim.options import ADMISSIONS
from .common import describe, emit_json, future_mark, open_trace, positive_int, setup_line, table
from .sizing_opts import SizingSetup

UNITS = ("token", "iteration")


def _arg(parse, text: str):
    try:
        return parse(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).split(": ", 1)[-1]) from None


budget_bytes = functools.partial(_arg, lambda t: parse_bytes(t, "--budget"))
budget_range = functools.partial(_arg, lambda t: parse_byte_range(t, "--budgets"))


def add_capacity_or_budget(p: argparse.ArgumentParser) -> None:
    """``--capacity C`` or ``--budget BYTES`` (exactly one)."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--capacity", "-c", type=positive_int, help="experts per pool")
    g.add_argument("--budget", type=budget_bytes, metavar="BYTES",
                   help="memory for experts over all layers, e.g. 12GB (decimal; GiB binary): floor(B / expert size) "
                        "experts, split equally over the layers for per-layer pools; needs --expert-mb or the trace "
                        "meta's expert_bytes")


def add_tier_options(p: argparse.ArgumentParser) -> None:
    """``--profile``, ``--admission`` and ``--unit``."""
    p.add_argument("--profile", metavar="TRACE", default=None,
                   help="static's frequency table from this whole trace (off-domain) instead of the warm window")
    p.add_argument("--admission", choices=ADMISSIONS, default="all",
                   help="lossless rules: 'all' inserts every miss (default, the tiering paper's Rule 1); 'second' "
                        "streams an expert's first request in a stream and admits it from its second on")
    p.add_argument("--unit", choices=UNITS, default="token",
                   help="denominator of the per-x column: accepted tokens (default) or engine iterations "
                        "(they differ on engine traces with speculative decoding; docs/semantics.md)")


def expert_bytes(setup, option: str) -> int:
    """The expert size a byte budget divides by (``--expert-mb``, ``--model-config`` or the trace meta)."""
    S = setup.sizing.expert_bytes
    if S is None:
        raise ConfigError(f"{option} needs the size of one expert: give --expert-mb MB (or --model-config, "
                          "or a trace whose meta has expert_bytes)")
    return int(S)


def pool_items_text(pool: str, n_items: int) -> str:
    """``'E=64 per layer'`` or ``'L x E = 256 (layer, expert) items in the global pool'``."""
    return f"E={n_items} per layer" if pool != "global" else f"L x E = {n_items} (layer, expert) items in the global pool"


def clamp_capacity(capacity: int, n_items: int, pool: str = "layer", option: str = "capacity") -> tuple[int, str]:
    """``(capacity, note)``: a capacity at or above the pool's ``n_items`` holds every expert, so it
    is clamped to ``n_items`` and the note says so in one line (empty note when below)."""
    if capacity < n_items:
        return capacity, ""
    if capacity == n_items:
        return capacity, f"{option} {capacity} = {pool_items_text(pool, n_items)}: every expert fits, zero steady copies"
    return n_items, (f"{option} {capacity} is above {pool_items_text(pool, n_items)}: every expert fits; clamped to "
                     f"{n_items}, zero steady copies")


def clip_capacities(capacities: list[int], n_items: int, pool: str = "layer") -> tuple[list[int], str]:
    """``(capacities, note)``: those above ``n_items`` dropped, ``n_items`` kept in their place (every
    expert fits there and beyond); the note says how many were clipped (empty when none)."""
    above = [c for c in capacities if c > n_items]
    if not above:
        return capacities, ""
    kept = sorted({c for c in capacities if c <= n_items} | {n_items})
    return kept, (f"capacities above {pool_items_text(pool, n_items)} clipped ({len(above):,} of them, up to "
                  f"{above[-1]:,}): every expert fits from {n_items} on, with zero steady copies")


def budget_capacity(args, layout, setup) -> tuple[int, Budget | None, str]:
    """``(capacity per pool, the Budget or None, a note)`` from ``--capacity`` or ``--budget``; a
    capacity or budget beyond the whole pool is clamped to it and the note says so."""
    if getattr(args, "budget", None) is None:
        capacity, note = clamp_capacity(args.capacity, int(layout.n_items), layout.pool)
        return capacity, None, note
    budget = Budget(args.budget, expert_bytes(setup, "--budget"), int(layout.n_items))
    return budget.capacity(layout.pool, len(layout.layer_ids)), budget, ""


def budget_capacities(budgets: list[int], layout, setup, *, lossless: bool) -> list[tuple[int, int]]:
    """``[(budget bytes, capacity per pool)]`` for ``--budgets``; a lossless rule needs each capacity
    to hold the widest group."""
    S = expert_bytes(setup, "--budgets")
    L = len(layout.layer_ids)
    out = [(b, Budget(b, S, int(layout.n_items)).capacity(layout.pool, L)) for b in budgets]
    if lossless:
        low = [(b, c) for b, c in out if c < layout.widest]
        if low:
            b, c = low[-1]
            per = "" if layout.pool == "global" else " per layer"
            raise ConfigError(f"--budgets: {format_bytes(b)} holds {c} experts{per}, fewer than the {layout.widest} "
                              "one step requests at a layer (a lossless rule needs them resident at once): "
                              "start the range higher")
    return out


def attach_profile(policies, path: str | None) -> None:
    """Give ``--profile``'s trace to every policy that takes one (``static``); refuse it when none does."""
    if path is None:
        return
    takers = [p for p in policies if getattr(p, "takes_profile", False)]
    if not takers:
        raise ConfigError("--profile: it is the frequency table of -p static, and no static policy is given")
    profile = open_trace(path)
    for p in takers:
        p.use_profile(profile)


def per_unit(r, unit: str) -> float:
    """Copies per accepted token or per engine iteration."""
    return r.copies_per_iteration if unit == "iteration" else r.copies_per_token


def per_unit_header(unit: str) -> str:
    return "copies/iter" if unit == "iteration" else "copies/token"


def print_budget_sweep(curves, budgets, layout, setup, trace, args) -> int:
    """``sweep --budgets``: one row per budget (bytes, capacity per pool), hit rate and copies per
    unit per policy; ``--json``: one replay record per (budget, policy) with the budget fields."""
    if args.target_hit_rate is not None or args.target_copies is not None:
        raise ConfigError("--target-hit-rate/--target-copies work on --capacities; with --budgets read the table")
    L = len(layout.layer_ids)
    S = expert_bytes(setup, "--budgets")
    rows, records = [], []
    for b, cap in budgets:
        budget = Budget(b, S, int(layout.n_items))
        row = [b / 1e9, cap]
        for c in curves:
            r = c.at(cap)
            row += [r.hit_rate, per_unit(r, args.unit)]
            records.append(r.to_dict() | budget.record(layout.pool, L)
                           | {"trace": trace.name, "method": c.method, "unit": args.unit} | setup.result_record(r))
        rows.append(row)
    if args.json:
        emit_json(records)
        return 0
    print(describe(trace))
    where = "capacity = experts in the global pool" if layout.pool == "global" else "capacity = experts per layer"
    print(setup_line(curves[0], f"budget over all layers / {format_bytes(S)} per expert, {where}"))
    headers = ["budget GB", "capacity"]
    for c in curves:
        mark = " (future)" if c.needs_future else ""
        headers += [f"{c.policy}{mark} hit", f"{c.policy} {per_unit_header(args.unit)}"]
    table(rows, headers)
    full = [b for b, _ in budgets if Budget(b, S, int(layout.n_items)).holds_everything(layout.pool, L)]
    if full:
        print(f"from {format_bytes(full[0])} on the budget holds every expert ({pool_items_text(layout.pool, layout.n_items)}): "
              "capacity clamped there, zero steady copies")
    return 0


# ------------------------------------------------------------------------------ sequence selection
def sequence_positions(text: str):
    """argparse type: ``'all'``, ``'heldout'`` or sequence positions such as ``'0-7'`` / ``'0,2,4'``."""
    from ..trace import parse_layers

    t = text.strip()
    if t in ("all", "heldout"):
        return t
    try:
        out = parse_layers(t)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).replace("--layers: ", "").replace("layer", "sequence")) from None
    if out is None:
        return "all"
    return out


def check_positions(positions, trace) -> list[int]:
    """Sequence positions, each below the trace's sequence count (one line otherwise)."""
    if isinstance(positions, str):
        raise ConfigError(f"--sequences: {positions!r} is not a list of positions here (e.g. '0-7')")
    bad = [p for p in positions if p >= trace.num_sequences]
    if bad:
        raise ConfigError(f"--sequences: position {bad[0]} is beyond the {trace.num_sequences} sequence(s) of "
                          f"{trace.source}")
    return sorted(positions)


def select_sequences(trace, spec, policies):
    """The trace to replay for ``--sequences``: all of it, the given positions, or ``heldout``: the
    sequences the ``learned:`` scorers among ``policies`` were not trained on (their files record the
    positions and the trace they came from; all must agree)."""
    if spec is None or spec == "all":
        return trace
    if spec != "heldout":
        return trace.select_sequences(check_positions(spec, trace))
    scorers = [p for p in policies if getattr(p, "scorer", None) is not None]
    if not scorers:
        raise ConfigError("--sequences heldout: it means the sequences a learned:PATH scorer was not trained on, "
                          "and no learned policy is given")
    trained = set()
    for p in scorers:
        meta = p.scorer.meta
        seqs, total = meta.get("sequences"), meta.get("trace_sequences")
        if not isinstance(seqs, list) or not isinstance(total, int):
            raise ConfigError(f"--sequences heldout: scorer {p.path} does not record its training sequences "
                              "(train it from 'learn dataset --sequences ...' with this version)")
        if total != trace.num_sequences:
            raise ConfigError(f"--sequences heldout: scorer {p.path} was trained on a trace of {total} sequence(s), "
                              f"{trace.source} has {trace.num_sequences}")
        trained |= {int(s) for s in seqs}
    held = [s for s in range(trace.num_sequences) if s not in trained]
    if not held:
        raise ConfigError("--sequences heldout: the scorers were trained on every sequence of this trace; "
                          "train on a subset ('learn dataset --sequences 0-7')")
    return trace.select_sequences(held)


def print_results(results, setup: SizingSetup | None = None, *, unit: str = "token") -> None:
    """The policy table: copies per accepted token (or per engine iteration), steady and total
    copies, hit rate, gap recovered, whether the policy needs the future, and the sizing figures
    (per accepted token) when ``setup`` is active."""
    setup = setup or SizingSetup()
    if setup.active:
        print(setup.describe())
    rows = [
        (r.policy, future_mark(r.needs_future), per_unit(r, unit), r.copies_steady, r.copies_total, r.hit_rate,
         r.gap_recovered, *setup.result_cells(r))
        for r in results
    ]
    table(rows, ["policy", "future", per_unit_header(unit), "steady", "total", "hit rate", "gap recovered",
                 *setup.headers()])
