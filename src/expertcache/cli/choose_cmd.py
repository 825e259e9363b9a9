"""``expertcache choose``: the fastest policy within a quality tolerance, from measured runs.

The logic lives in :mod:`expertcache.costmodel.choose` (definitions) and
:mod:`expertcache.costmodel.runs` (the runs file); this module reads the options, adds replayed
rules, prints and plots. docs/choose.md defines every number.
"""

from __future__ import annotations

import argparse

from ..costmodel import (
    DEFAULT_REPLAY_POLICIES, FRONTIER_FACTORS, frontier, measured_tau, replayed_runs, validate,
)
import statistics

from ..costmodel.choose import choose, is_lossless
from ..costmodel.runs import HOSTS, base_host, check_unique, is_replay_record, read_records, replay_rows, run_from_record
from ..errors import ConfigError, PolicyError
from ..policies import make_policy
from .common import (add_json, check_plot, emit_json, future_mark, future_note, layer_ids, nonnegative_float, open_trace,
                     positive_int, table, wrote)
from .sizing_opts import compute_time, duration

HELP = """Choose the fastest policy within a quality tolerance, from measured runs (docs/choose.md).

RUNS is JSON lines or a JSON list, e.g. what 'expertcache eval --json' prints; every record needs
policy, c_ms (compute ms per token of that run: measured ms/token minus its copy time per token),
rho (steady expert copies per token, summed over the offloaded layers) and dnll (NLL minus the
all-resident NLL, nats). Optional: tau_ms (measured ms of one copy), ms_per_token (measured),
slow_copies (N: every copy repeated N times; default 1), needs_future, lossless, capacity, pool,
layers and host (memory, mmap or direct: where eval read the experts; default memory). Policies
are chosen among the slow_copies 1 runs at one host (--host; default memory, or the only host);
one run per policy, factor and host.
RUNS may also hold 'replay --json' or 'sweep --json' records (copies_per_token, no rho), alone
or beside eval runs: each is a lossless run with rho = copies_per_token, dnll = 0 and c = --c
(default: the median c_ms of the file's lossless eval runs), at --capacity (default: the eval
runs' capacity, or the one capacity the records hold); a policy the file also measures keeps
its measured run. Trace-only: 'choose replay.jsonl --tau 0.51ms --c 49tok/s'.

  admissible        dnll <= --tolerance
  ms/token          c + rho x tau (copies block compute); with --overlap also max(c, rho x tau)
  tok/s             1000 / ms/token
  winner            the admissible policy of least ms/token; ties (1e-9 relative) go to the
                    smaller dnll, then the smaller rho, then the name; with --overlap the winner
                    (and the crossovers) follow max(c, rho x tau)
  crossovers        each tau > 0 where the winner changes: a below, b above, at
                    tau_ab = (c_b - c_a) / (rho_a - rho_b)
  tau               --tau, else the median tau_ms of the slow_copies 1 runs

--add-replay TRACE adds lossless rules (--replay-policy, default belady and foresight:16):
rho from replaying TRACE at the runs' capacity and pool over --layers (default: the runs'
layers), c = the median c_ms of the file's lossless runs (field lossless, or |dnll| <= 5e-3
where absent), dnll = 0. Rules that need the future are an offline reference, not a policy a
causal cache can run.
--validate compares, for each condition other than the base (a slow_copies factor N > 1, or
another host mode), the winner predicted at N x tau_h (from the base runs' c and rho; tau_h is
the base tau at the base host, and the median measured tau_ms of a host's own slow_copies 1 runs
at another host) with the measured winner (least ms_per_token among that condition's runs), with each winner's lead over the runner-up
(runs timed with 'eval --repeats' carry their spread, (max - min) / median: a verdict whose
measured lead is inside the larger spread of the two runs it compares reads "tie (within
noise)", neither agree nor DISAGREE; one whose predicted winner among all the base runs has no run
in that condition reads "untested"); it also prints the tau the
slowed runs measured, which on a CPU is well below N x tau (repeated copies of a cached expert are
cheap). --plot draws dNLL against predicted
tokens/s at tau x1, x10 and x50.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("choose", help="the fastest policy within a quality tolerance, from measured runs",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", metavar="RUNS", help="runs file: JSON lines or a JSON list ('-': standard input)")
    p.add_argument("--tolerance", type=nonnegative_float, default=0.05, metavar="NATS",
                   help="largest dnll a policy may show to be admissible, in nats (default 0.05, the issue's "
                        "example; how much quality to trade is the deployment's decision: set it)")
    p.add_argument("--tau", type=duration, default=None, metavar="DURATION",
                   help="time of one expert copy, e.g. 0.51ms, 510us, 0.00051s (bare number: ms); "
                        "default: the median measured tau_ms of the runs")
    p.add_argument("--overlap", action="store_true",
                   help="also predict max(c, rho x tau) (copies overlapped with compute); the winner and the "
                        "crossovers follow it")
    p.add_argument("--add-replay", metavar="TRACE", default=None,
                   help="add lossless rules replayed on this trace (.npz, or a folder holding routing.npz)")
    p.add_argument("--replay-policy", action="append", dest="replay_policies", metavar="POLICY",
                   help=f"repeatable; a rule to replay with --add-replay (default: {', '.join(DEFAULT_REPLAY_POLICIES)})")
    p.add_argument("--layers", type=layer_ids, default=None, metavar="IDS",
                   help="with --add-replay: the trace's layer ids to replay, the offloaded ones, e.g. '4-8,11-13' "
                        "(default: the runs' layers when they record them, else all)")
    p.add_argument("--c", type=compute_time, default=None, metavar="DURATION",
                   help="with replay/sweep records in RUNS: compute ms/token with every expert resident, e.g. 20ms or "
                        "49tok/s (default: the median c_ms of the file's lossless eval runs)")
    p.add_argument("--capacity", type=positive_int, default=None, metavar="C",
                   help="with sweep records in RUNS: the capacity to choose at (default: the eval runs' capacity, or "
                        "the one capacity the records hold)")
    p.add_argument("--host", choices=HOSTS, default=None,
                   help="the host mode whose slow_copies 1 runs are chosen among (default: memory, or the only one)")
    p.add_argument("--validate", action="store_true",
                   help="compare the predicted with the measured winner of the slowed runs (slow_copies > 1)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw dNLL against predicted tokens/s at tau x1, x10, x50 into FILE, e.g. frontier.png; "
                        "the format follows the extension: .png, .pdf or .svg (the folder must exist)")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    check_plot(args.plot)
    if (args.replay_policies or args.layers is not None) and not args.add_replay:
        raise ConfigError("--replay-policy and --layers need --add-replay")
    for spec in args.replay_policies or []:
        try:
            make_policy(spec)
        except PolicyError as err:
            raise ConfigError(f"--replay-policy: {err}") from None
    runs, rows, skipped, rows_note = _file_runs(args)
    added = []
    if args.add_replay:
        trace = open_trace(args.add_replay)
        added, skipped_replay = replayed_runs(runs + rows, trace, args.replay_policies or DEFAULT_REPLAY_POLICIES,
                                              layers=args.layers, source=args.add_replay)
        skipped += skipped_replay
    host = base_host(runs + rows, args.host)
    base_tau = measured_tau(runs, host)
    choice = choose(runs + rows + added, args.tolerance, args.tau, args.overlap, host=host)
    checks = (validate(runs, args.tolerance, choice.tau_ms if base_tau is None else base_tau, args.overlap, host=host)
              if args.validate else [])
    if args.plot:
        _plot(args, choice)
    if args.json:
        out = choice.to_dict(replayed=bool(args.add_replay or rows))
        if args.validate:
            out["validate"] = [c.to_dict() for c in checks]
        emit_json([out])
        return 0
    _print(args, choice, added, rows, skipped, checks, base_tau, sum(r.host == host and r.slow_copies > 1 for r in runs),
           rows_note, host, sum(r.host != host for r in runs))
    return 0


def _file_runs(args) -> tuple[list, list, list[str], str]:
    """``(eval runs, lossless rows from replay/sweep records, policies left out)`` of RUNS: replay
    and sweep records (copies_per_token, no rho) become runs with ``c`` = ``--c`` (default: the
    median c_ms of the file's lossless eval runs), ``dnll`` 0; a policy the file also measures keeps
    its measured run."""
    records = read_records(args.runs)
    replays = [(r, w) for r, w in records if is_replay_record(r)]
    runs = [run_from_record(r, w) for r, w in records if not is_replay_record(r)
            and not (isinstance(r, dict) and r.get("record") == "target")]
    check_unique(runs)
    if not replays:
        if args.c is not None or args.capacity is not None:
            raise ConfigError(f"--c and --capacity apply to replay or sweep records, and {args.runs} holds none")
        return runs, [], [], ""
    c_ms, c_from = args.c, "--c"
    host = base_host(runs, args.host) if runs else (args.host or "memory")  # the replay rows are host memory
    if c_ms is None:
        lossless = [r.c_ms for r in runs if r.slow_copies == 1 and r.host == host and is_lossless(r)]
        if not lossless:
            raise ConfigError(f"{replays[0][1]}: a replay/sweep record (copies_per_token, no rho): give --c, the "
                              "compute ms/token with every expert resident (e.g. 20ms or 49tok/s), to choose from it")
        c_ms, c_from = statistics.median(lossless), "median c_ms of the lossless eval runs"
    capacity = args.capacity
    if capacity is None:
        caps = {r.capacity for r in runs if r.slow_copies == 1 and r.host == host and r.capacity is not None}
        capacity = caps.pop() if len(caps) == 1 else None
    rows = replay_rows(replays, c_ms=c_ms, capacity=capacity, name=args.runs)
    measured = {r.policy for r in runs if r.slow_copies == 1 and r.host == host}
    skipped = [r.policy for r in rows if r.policy in measured]
    note = (f"replay/sweep rows: rho = copies_per_token at capacity {rows[0].capacity if rows else capacity}, "
            f"c = {c_ms:.4g} ms ({c_from}), dnll = 0 (lossless rules compute what the all-resident model computes)")
    return runs, [r for r in rows if r.policy not in measured], skipped, note


def _plot(args, choice) -> None:
    from ..report.plots import plot_frontier

    model = "max(c, rho x tau)" if args.overlap else "c + rho x tau"
    winners = [choice.winners_at[n].policy for n in FRONTIER_FACTORS]
    wrote(plot_frontier(frontier(choice), args.plot, factors=FRONTIER_FACTORS, tau_ms=choice.tau_ms,
                        tolerance=args.tolerance, winners=winners, model=model,
                        title=f"{args.runs}: quality against predicted speed as copies get slower\n"
                              f"tau = {choice.tau_ms:.4g} ms per copy, ms/token = {model}"))


def _print(args, choice, added, file_rows, skipped, checks, base_tau, n_slow: int, rows_note: str, host: str,
           n_hosts: int) -> None:
    print(f"{args.runs}: {len(choice.runs) - len(added) - len(file_rows)} run(s) at slow_copies 1"
          + ("" if host == "memory" else f" on host {host}")
          + (f", {len(file_rows)} lossless row(s) from its replay/sweep records" if file_rows else "")
          + (f", {len(added)} replayed from {args.add_replay}" if added else "")
          + (f", {n_slow} slowed run(s) (for --validate)" if n_slow else "")
          + (f", {n_hosts} run(s) at other host modes (for --validate)" if n_hosts else ""))
    source = "--tau" if args.tau is not None else "median tau_ms of the slow_copies 1 runs"
    print(f"tau {choice.tau_ms:.4g} ms per copy ({source}); admissible: dnll <= {args.tolerance:g} nats")
    print("ms/tok = c + rho x tau (copies block compute)"
          + (", ovl = max(c, rho x tau) (copies overlapped)" if args.overlap else "") + ", tok/s = 1000 / ms/tok")
    ok = set(choice.admissible)
    headers = ["policy", "future", "c ms", "rho", "dnll", "admissible", "ms/tok", "tok/s"]
    if args.overlap:
        headers += ["ovl ms/tok", "ovl tok/s"]
    sourced = bool(added or file_rows)
    if sourced:
        headers.append("source")
    rows = []
    for r, p in zip(choice.runs, choice.predictions):
        row = [r.policy, future_mark(r.needs_future), r.c_ms, r.rho, r.dnll, "yes" if r.policy in ok else "no",
               p.ms_per_token, p.tokens_per_s]
        if args.overlap:
            row += [p.ms_per_token_overlapped, p.tokens_per_s_overlapped]
        if sourced:
            row.append("replayed" if r.replayed else "measured")
        rows.append(row)
    table(rows, headers)
    note = future_note([r.policy for r in choice.runs if r.needs_future])
    if note:
        print(note)
    if added:
        r = added[0]
        print(f"replayed: rho from {args.add_replay} at capacity {r.capacity} ({r.pool} pool, layers "
              f"{','.join(map(str, r.layers))}), c = {r.c_ms:.4g} ms (median c_ms of the lossless runs), dnll = 0")
    if rows_note:
        print(rows_note)
    if skipped:
        print(f"not replayed (the file measures them): {', '.join(skipped)}")
    model = "max(c, rho x tau)" if args.overlap else "c + rho x tau"
    w = choice.winner
    pred = dict(zip((r.policy for r in choice.runs), choice.predictions))[w.policy]
    ms = pred.ms_per_token_overlapped if args.overlap else pred.ms_per_token
    print(f"\nwinner: {w.policy} ({ms:.4g} ms/token, {1000 / ms if ms > 0 else float('inf'):.4g} tok/s predicted by "
          f"{model}), fastest of {len(choice.admissible)} admissible")
    if args.overlap and choice.winner_blocking is not w:
        print(f"  with blocking copies (c + rho x tau) the winner would be {choice.winner_blocking.policy}")
    print("  at " + ", ".join(f"tau x{n} ({n * choice.tau_ms:.4g} ms): {choice.winners_at[n].policy}"
                              for n in FRONTIER_FACTORS))
    if choice.crossovers:
        print(f"crossovers (tau where the fastest admissible policy changes, {model}):")
        table([(c.tau_ms, c.a, c.b) for c in choice.crossovers], ["tau ms", "fastest below", "fastest above"])
    else:
        print(f"crossovers: none; {w.policy} is the fastest admissible policy at every tau > 0 ({model})")
    for c in checks:
        margins = [(what, c.margin(key)) for what, key in (("predicted", "ms_predicted"), ("measured", "ms_measured"))]
        margin = ", ".join(f"{what} {100 * m:.1f}%" for what, m in margins if m is not None)
        noise = f"; run-to-run spread {100 * c.noise:.1f}%" if c.noise is not None else ""
        on = "" if c.host == host else f" on host {c.host}"
        if c.tested:
            print(f"\nvalidate slow_copies {c.slow_copies}{on}: predicted {c.predicted}, measured {c.measured}: "
                  f"{c.verdict}" + (f" (lead over the runner-up: {margin}{noise})" if margin else ""))
        else:
            print(f"\nvalidate slow_copies {c.slow_copies}{on}: untested: the base runs predict {c.not_run[0]} "
                  f"fastest here and it has no run at this condition (among the runs: predicted {c.predicted}, "
                  f"measured {c.measured})")
        base = c.tau_ms / c.slow_copies
        measured = (f"; these runs measured {c.tau_ms_measured:.4g} ms ({c.tau_ms_measured / base:.3g} x the base)"
                    if c.tau_ms_measured is not None and base > 0 else "")
        own = "" if c.host == host else f" (host {c.host}'s own tau, from its slow_copies 1 runs)"
        print(f"  predicted at tau = {c.slow_copies} x {base:.4g}{own} = {c.tau_ms:.4g} ms{measured}")
        table([(r["policy"], "yes" if r["admissible"] else "no", r["ms_predicted"], r["ms_measured"]) for r in c.rows],
              ["policy", "admissible", "predicted ms/tok", "measured ms/tok"])
        if c.unmatched:
            print(f"  left out (no slow_copies 1 run to predict from): {', '.join(c.unmatched)}")
        if len(c.not_run) > 1:
            print(f"  not run here, predicted at least as fast as {c.predicted}: {', '.join(c.not_run)}")
    if checks and base_tau is None:
        print("  (the prediction used --tau: no slow_copies 1 run records a measured tau_ms)")
