"""``expertcache learn eval --split``: options, the run over traces and capacities, and its output (docs/learn.md)."""

from __future__ import annotations

from .._progress import progress
from .common import _int_in, emit_json, resamples_int, seed_int, table
from ..errors import ConfigError


def _parts(text: str) -> int:
    return _int_in(text, 3, 1000, "an integer", "from 3 to 1000 (parts a one-sequence trace is cut into)")


def add_split_arguments(p) -> None:
    p.add_argument("--split", default=None, metavar="TRAIN,VAL,TEST",
                   help="instead of --folds: one split of the sequences (fractions, e.g. 0.5,0.25,0.25, or counts, "
                        "e.g. 8,4,4): scorers fit on TRAIN, decayed's beta and the reported learned kind chosen on "
                        "VAL, TEST scored once at the end")
    p.add_argument("--split-seed", type=seed_int, default=0, help="seed of the split's sequence permutation (default 0)")
    p.add_argument("--parts", type=_parts, default=8,
                   help="with --split: a trace of one sequence is cut into this many contiguous parts first (default 8)")
    p.add_argument("--bootstrap", type=resamples_int, default=0, metavar="N",
                   help="with --split: N bootstrap resamples of the test sequences give 95%% intervals for each "
                        "policy's gap recovered and its difference to tuned decayed (default 0: none)")
    p.add_argument("--bootstrap-seed", type=seed_int, default=0, help="seed of the resamples (default 0)")


def unusable(trace, capacity: int, folds: int) -> str | None:
    """Why ``learn eval`` / ``--split`` cannot learn on ``trace`` at ``capacity`` (None: it can)."""
    if trace.num_sequences < 2 and trace.num_tokens < 2 * max(folds, 2):
        return (f"{trace.num_sequences} sequence of {trace.num_tokens} tokens; holding out needs 2 sequences, "
                f"or one of at least {2 * max(folds, 2)} tokens to cut into {max(folds, 2)} parts")
    if capacity >= trace.num_experts:
        return f"capacity {capacity} is not below E={trace.num_experts}: nothing is ever evicted"
    if capacity < trace.top_k:
        return f"capacity {capacity} is below top-k={trace.top_k}"
    return None


def _skip_reason(trace, capacity: int, spec, parts: int) -> str | None:
    from ..learn.split import part_sizes

    why = unusable(trace, capacity, 2)
    if why:
        return why
    n = parts if trace.num_sequences == 1 else trace.num_sequences
    try:
        part_sizes(spec, n)
    except ConfigError as err:
        return str(err)
    return None


def run_split(args, traces, states, rounds, tables_from) -> int:
    from ..learn.protocol import evaluate_split
    from ..learn.split import parse_split

    if args.split is None:
        raise ConfigError("--bootstrap needs --split: intervals are over the test sequences of one split")
    spec = parse_split(args.split)
    results, notes, todo = [], [], []
    for path, trace in traces:
        for c in args.capacity:
            why = _skip_reason(trace, c, spec, args.parts)
            if why:
                notes.append({"trace": trace.name, "path": path, "capacity": c, "skipped": why})
            else:
                todo.append((path, trace, c))
    with progress(total=len(todo) * len(args.seeds), desc="learn eval", disable=args.json) as bar:
        for path, trace, c in todo:
            bar.set_postfix_str(f"{trace.name} C={c}", refresh=False)
            res = evaluate_split(trace, c, spec, split_seed=args.split_seed, parts=args.parts, seeds=args.seeds,
                                 states=states, rounds=rounds, pool=args.pool, layers=args.layers,
                                 features=args.features, tables_from=tables_from, bootstrap=args.bootstrap,
                                 bootstrap_seed=args.bootstrap_seed, progress=lambda _msg: bar.update(1))
            res["path"] = path
            results.append(res)
    if args.json:
        keys = ("trace", "path", "capacity", "tokens", "split", "beta", "chosen", "cut", "rounds", "bootstrap",
                "bootstrap_seed", "resamples_used")
        emit_json([{**{k: r[k] for k in keys}, "seeds": r["seed_list"], **row} for r in results for row in r["rows"]]
                  + notes)
        return 0
    for r in results:
        _print(r)
    for n in notes:
        print(f"skipped {n['trace']} at C={n['capacity']}: {n['skipped']}")
    return 0


def _print(r: dict) -> None:
    sp = r["split"]
    cut = f" (its one sequence cut into {r['cut']} parts)" if r["cut"] else ""
    print(f"{r['trace']}  C={r['capacity']}  split {sp['spec']} (seed {sp['seed']}){cut}: train {len(sp['train'])}, "
          f"validation {len(sp['validation'])}, test {len(sp['test'])} sequences; seeds {r['seed_list']}, "
          f"rounds {r['rounds']}; on validation: decayed beta {r['beta']:g}, learned kind {r['chosen'].split()[-1]}")
    boot = (f"{r['bootstrap']} bootstrap resamples of the test sequences (seed {r['bootstrap_seed']}, "
            f"{r['resamples_used']} with a gap), 95% intervals" if r["bootstrap"] else "no bootstrap")
    print(f"test: {r['tokens']} tokens, read once after every choice; {boot}")

    def ci(v):
        return "" if v is None else f"[{v[0]:.3f}, {v[1]:.3f}]"

    if r["bootstrap"] and len(sp["test"]) < 5:
        print(f"note: {len(sp['test'])} test sequence(s): the intervals can show only their spread")
    rows = [(x["policy"], _count(x["copies_steady"]), x["copies_per_token"], x["gap_recovered"], ci(x["gap_recovered_ci"]),
             x["diff_vs_decayed"], ci(x["diff_vs_decayed_ci"]), x["validation_gap_recovered"]) for x in r["rows"]]
    table(rows, ["policy", "steady copies", "copies/token", "gap recovered", "95% CI", "- decayed", "95% CI",
                 "validation gap"])
    print()


def _count(v: float):
    """A whole count as an int (printed with separators), a mean over seeds as it is."""
    return int(v) if float(v).is_integer() else v
