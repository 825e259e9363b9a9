"""``expertcache learn``: eviction events, scorers, and the held-out protocol (docs/learn.md)."""

from __future__ import annotations

import argparse

from .._progress import progress
from ..errors import ConfigError
from .learn_split import add_split_arguments, run_split, unusable
from .budget_opts import check_positions, sequence_positions
from .common import (_int_in, add_json, add_layers, add_out, add_subcommands, check_out, emit_json, open_trace, positive_int,
                     seed_int, table)

HELP = """Learned eviction: imitate the farthest-future victim from causal features (docs/learn.md).

  dataset  eviction events of a trace: each candidate's causal features and the victim set
           (the candidates whose next request is farthest ahead on the recorded trace), collected
           in causal rules' caches (--states) and then the learner's own (--rounds, DAgger)
  train    fit a linear or MLP scorer (listwise softmax loss) -> a small .npz that replays as
           -p learned:PATH (expertcache replay)
  eval     the protocol: split by sequence into folds, train on the others, replay the held-out
           sequences; copies of lru, tuned decayed, learned, a shuffled-label control,
           foresight:1/2/4 and belady, and the share of the LRU-to-Belady gap recovered
"""


def add_parser(sub) -> None:
    p = sub.add_parser("learn", help="learned eviction: events, scorers, held-out protocol", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    lsub = add_subcommands(p, "learn_command")

    d = lsub.add_parser("dataset", help="eviction events (features + farthest-future victims) of a trace",
                        description="Collect eviction events of TRACE at --capacity: per eviction, every candidate's "
                                    "causal features and whether it is a farthest-future victim. States come from the "
                                    "causal rules in --states, then --rounds rounds of the learner's own closed loop "
                                    "(a --model scorer trained on the events so far). Written as a .npz (no pickle).")
    d.add_argument("trace", help="canonical trace (.npz, or a folder holding routing.npz)")
    d.add_argument("--capacity", "-c", type=positive_int, required=True, help="experts per pool")
    _add_common(d)
    d.add_argument("--rounds", type=_rounds, default=None, metavar="N",
                   help="DAgger rounds: N times, train on the events so far and add the learner's own states (default 0)")
    d.add_argument("--sequences", type=sequence_positions, default=None, metavar="POS",
                   help="train on these sequences only (positions in the trace, e.g. '0-7' or '0,2,4'; default all): "
                        "'replay --sequences heldout' then replays the others")
    d.add_argument("--model", choices=("linear", "mlp"), default="linear", help="the learner of the rounds (default linear)")
    d.add_argument("--seed", type=seed_int, default=0, help="seed of the rounds' training (default 0)")
    add_out(d, "events file to write (.npz)")
    add_json(d)
    d.set_defaults(func=run_dataset, default_rounds=0)

    t = lsub.add_parser("train", help="fit a scorer on an events file",
                        description="Fit a scorer on EVENTS (from 'learn dataset'): listwise softmax cross-entropy "
                                    "over each eviction's candidates against its victim set; deterministic under --seed. "
                                    "--shuffle-labels trains the control: victim flags permuted within each event.")
    t.add_argument("events", help="events file from 'expertcache learn dataset'")
    t.add_argument("--model", choices=("linear", "mlp"), default="linear", help="scorer kind (default linear)")
    t.add_argument("--shuffle-labels", action="store_true", help="train the shuffled-label control")
    t.add_argument("--seed", type=seed_int, default=0, help="seed of weights and minibatch order (default 0)")
    add_out(t, "scorer file to write (.npz); replay it with -p learned:PATH")
    add_json(t)
    t.set_defaults(func=run_train)

    e = lsub.add_parser("eval", help="the held-out protocol on one or more traces",
                        description="For each trace and capacity: split the sequences into --folds contiguous folds; "
                                    "for each fold, collect events and train on the other sequences (decayed's beta "
                                    "is tuned there too), then replay the held-out ones. Steady copies are summed over "
                                    "folds; learned rows give mean and sd over --seeds. Capacities a trace cannot use "
                                    "(below top-k, or not below E) are skipped with a note; a trace of one sequence is cut "
                                    "into --folds contiguous parts (pools restart at each cut).")
    e.add_argument("--traces", required=True, metavar="A,B,...", help="comma-separated traces")
    e.add_argument("--capacity", "-c", type=_capacities, required=True, metavar="C[,C...]", help="experts per pool")
    _add_common(e)
    e.add_argument("--rounds", type=_rounds, default=None, metavar="N", help="DAgger rounds per learner (default 1)")
    e.add_argument("--folds", type=_folds, default=2,
                   help="sequence folds, at least 2 (default 2); a trace of one sequence is cut into this many "
                        "contiguous parts")
    e.add_argument("--seeds", type=_seeds, default=[0, 1, 2], metavar="S,S,...", help="training seeds (default 0,1,2)")
    add_split_arguments(e)
    add_json(e)
    e.set_defaults(func=run_eval, default_rounds=1)


def _add_common(p) -> None:
    p.add_argument("--states", type=_states, default=("lru", "decayed"), metavar="RULES",
                   help="causal rules whose caches give the states (default lru,decayed); 'self' is the learner's "
                        "own (same as --rounds 2 when --rounds is not given)")
    p.add_argument("--features", default=None, metavar="GROUPS",
                   help="feature groups: reuse, gate (needs probs), router (needs router_probs), online (the "
                        "stream's own transitions; any trace), prior (routing tables fitted on training sequences; any "
                        "trace), token, next, hidden, ahead (need capture --record signals; ahead reads later input "
                        "ids) (default: all the trace has, but ahead and late, and the fitted-table groups only with "
                        "two sequences or more)")
    p.add_argument("--pool", choices=("layer", "global"), default="layer", help="per-layer pools (default) or one global pool")
    p.add_argument("--tables-from", default=None, metavar="TRACE",
                   help="fit the model-side routing tables on this capture (with token_ids; text disjoint from the "
                        "evaluated sequences) instead of on the training sequences")
    add_layers(p, "layer ids to use")


def _rounds(text: str) -> int:
    return _int_in(text, 0, 20, "an integer", "from 0 to 20 (rounds)")


def _folds(text: str) -> int:
    return _int_in(text, 2, 1000, "an integer", "from 2 to 1000 (each fold is held out while the others train)")


def _states(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise argparse.ArgumentTypeError("name at least one rule, e.g. lru,decayed")
    return items


def _capacities(text: str) -> list[int]:
    return [positive_int(s.strip()) for s in text.split(",") if s.strip()] or [positive_int("")]


def _seeds(text: str) -> list[int]:
    return [seed_int(s.strip()) for s in text.split(",") if s.strip()] or [seed_int("")]


def _split_self(args) -> tuple[tuple[str, ...], int]:
    states = tuple(s for s in args.states if s != "self")
    rounds = args.rounds
    if rounds is None:
        rounds = 2 if "self" in args.states else args.default_rounds
    if not states:
        raise ConfigError("--states: 'self' needs at least one causal rule to start from, e.g. lru,decayed,self")
    return states, rounds


def run_dataset(args) -> int:
    from ..learn.dataset import build_dataset, save_events

    check_out(args.out)
    states, rounds = _split_self(args)
    trace = open_trace(args.trace)
    n_source = trace.num_sequences
    positions = check_positions(args.sequences, trace) if args.sequences is not None else list(range(n_source))
    if args.sequences is not None:
        trace = trace.select_sequences(positions)
    ev = build_dataset(trace, args.capacity, states=states, rounds=rounds, model=args.model, seed=args.seed,
                       pool=args.pool, layers=args.layers, features=args.features, tables=_tables_from(args))
    ev.meta["sequences"], ev.meta["trace_sequences"] = positions, n_source  # positions in the source trace
    save_events(ev, args.out)
    rec = {"out": args.out, "events": ev.num_events, "rows": int(ev.X.shape[0]), "features": list(ev.features),
           **ev.meta}
    if args.json:
        emit_json([rec])
    else:
        print(f"{args.out}: {ev.num_events} eviction events, {ev.X.shape[0]} candidate rows, "
              f"{len(ev.features)} features ({', '.join(ev.features)})")
        print("states: " + ", ".join(f"{s} ({n} events)" for s, n in zip(ev.meta["states"], ev.meta["events_per_state"])))
    return 0


def run_train(args) -> int:
    from ..learn.dataset import load_events
    from ..scorer.models import fit, mean_loss
    from ..scorer.file import save_scorer

    check_out(args.out)
    ev = load_events(args.events)
    if ev.num_events == 0:
        raise ConfigError(f"events {args.events}: no eviction events (capacity not below the experts in use?)")
    sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind=args.model, seed=args.seed, shuffled=args.shuffle_labels)
    sc.tables = ev.tables  # model-side routing tables, when the features need them
    sc.meta.update({"events_file": str(args.events), "trace": ev.meta.get("trace"), "capacity": ev.meta.get("capacity"),
                    "states": ev.meta.get("states"), "sequences": ev.meta.get("sequences"),
                    "trace_sequences": ev.meta.get("trace_sequences")})
    save_scorer(sc, args.out)
    loss = mean_loss(sc, ev.X, ev.victim, ev.offsets)
    rec = {"out": args.out, "model": args.model, "seed": args.seed, "shuffled_labels": args.shuffle_labels,
           "features": list(sc.features), "train_loss": loss, "steps": sc.meta["steps"],
           "informative_events": sc.meta["informative_events"]}
    if args.json:
        emit_json([rec])
    else:
        print(f"{args.out}: {args.model} scorer on {len(sc.features)} features, {sc.meta['steps']} steps, "
              f"training loss {loss:.4f} over {sc.meta['informative_events']} informative events")
    return 0


def run_eval(args) -> int:
    from ..learn.protocol import evaluate

    states, rounds = _split_self(args)
    paths = [s.strip() for s in args.traces.split(",") if s.strip()]
    if not paths:
        raise ConfigError("--traces: name at least one trace")
    traces = [(p, open_trace(p)) for p in paths]
    tables_from = open_trace(args.tables_from) if args.tables_from else None
    if args.split is not None or args.bootstrap:
        return run_split(args, traces, states, rounds, tables_from)
    results, notes, todo = [], [], []
    for path, trace in traces:
        for c in args.capacity:
            why = unusable(trace, c, args.folds)
            if why:
                notes.append({"trace": trace.name, "path": path, "capacity": c, "skipped": why})
            else:
                todo.append((path, trace, c))
    steps = sum(_fold_count(t, args.folds) * len(args.seeds) for _, t, _ in todo)
    with progress(total=steps, desc="learn eval", disable=args.json) as bar:
        for path, trace, c in todo:
            bar.set_postfix_str(f"{trace.name} C={c}", refresh=False)
            res = evaluate(trace, c, folds=args.folds, seeds=args.seeds, states=states, rounds=rounds,
                           pool=args.pool, layers=args.layers, features=args.features,
                           tables_from=tables_from, progress=lambda _msg: bar.update(1))
            res["path"] = path
            results.append(res)
    if args.json:
        emit_json([{"trace": r["trace"], "path": r["path"], "capacity": r["capacity"], "tokens": r["tokens"],
                    "seeds": r["seed_list"], "rounds": r["rounds"], "cut": r["cut"], "folds": r["folds"], **row}
                   for r in results for row in r["rows"]] + notes)
        return 0
    for r in results:
        betas = ",".join(f"{f['beta']:g}" for f in r["folds"])
        cut = f" (its one sequence cut into {r['cut']} contiguous parts)" if r["cut"] else ""
        print(f"{r['trace']}  C={r['capacity']}  {len(r['folds'])} folds{cut}, seeds {r['seed_list']}, "
              f"rounds {r['rounds']}, held-out tokens {r['tokens']}, decayed beta per fold {betas}")
        rows = [(x["policy"], x["copies_steady"], x["copies_steady_sd"] if x["seeds"] else None, x["copies_per_token"],
                 x["gap_recovered"], x["gap_recovered_sd"] if x["seeds"] else None) for x in r["rows"]]
        table(rows, ["policy", "steady copies", "sd", "copies/token", "gap recovered", "sd"])
        print()
    for n in notes:
        print(f"skipped {n['trace']} at C={n['capacity']}: {n['skipped']}")
    return 0


def _fold_count(trace, folds: int) -> int:
    """The folds :func:`~expertcache.learn.protocol.evaluate` makes of ``trace`` (progress steps = this x seeds)."""
    return max(folds, 2) if trace.num_sequences == 1 else min(folds, trace.num_sequences)


def _tables_from(args):
    from ..scorer.signals import external_tables

    return external_tables(open_trace(args.tables_from)) if args.tables_from else None
