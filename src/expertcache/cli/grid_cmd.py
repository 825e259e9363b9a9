"""``expertcache grid SPEC --out DIR`` and ``expertcache grid report DIR``: resumable grids of
replays with results as Parquet parts (docs/grid.md)."""

from __future__ import annotations

import argparse
import sys

from .._progress import progress
from .common import add_json, check_local_jobs, emit_json, positive_int, table

HELP = """Run a grid of replays from a TOML spec, or report on its results (docs/grid.md).

  expertcache grid grid.toml --out results/ [--jobs N] [--ray auto|ADDRESS] [--force] [--json]
  expertcache grid report results/ [--plot DIR] [--json]

The spec names traces (paths or globs, or synth = [{preset = "olmoe", seed = 0, tokens = 200}]),
policies, capacities (experts per pool) or budgets (bytes, e.g. "1GB", with expert_mb or the trace
meta's expert_bytes), pools, warm fractions, layers and reset. Every cell (trace x policy x size x
pool x warm x reset) is one row of the results: every replay field (docs/semantics.md) plus the
cell's inputs and its key (a hash of the inputs, the trace's checksum and the expertcache
version). Rows are written as Parquet parts, one per finished batch, atomically; a rerun skips
finished cells (--force recomputes them), so a killed run resumes losing nothing. --ray runs the
cells on Ray (each trace put once into its object store) with the same rows as the process pool.

'grid report' prints, per trace, pool, reset and warm fraction, a policy x size table of the hit
rate and of copies/token, and with --plot writes one PNG per table into DIR.
Needs pyarrow: pip install 'expertcache[grid]'.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("grid", help="run a resumable grid of replays (or 'grid report DIR')", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC|report", help="the grid spec (.toml), or 'report'")
    p.add_argument("results", nargs="?", metavar="DIR", help="with 'report': the results folder")
    p.add_argument("--out", "-o", metavar="DIR", help="results folder (created when missing; its parent must exist)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="N",
                   help="worker processes (default: the cores here; 1 runs here; at most 4 per core without --ray)")
    p.add_argument("--ray", metavar="auto|ADDRESS", default=None,
                   help="run the cells as Ray tasks: 'auto' joins this machine's Ray or starts a local one with "
                        "--jobs CPUs, ADDRESS joins a cluster (pip install 'expertcache[ray]')")
    p.add_argument("--force", action="store_true", help="recompute cells already in the results; also: write into an existing folder that holds "
                        "no grid results")
    p.add_argument("--plot", metavar="DIR", help="with 'report': write one PNG per table into DIR")
    add_json(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import ConfigError

    if args.spec == "report":
        if args.results is None:
            raise ConfigError("grid report: give the results folder, e.g. 'expertcache grid report results/'")
        for opt, val in (("--out", args.out), ("--jobs", args.jobs), ("--force", args.force), ("--ray", args.ray)):
            if val:
                raise ConfigError(f"grid report: {opt} belongs to running a grid, not to 'grid report'")
        return run_report(args)
    if args.results is not None:
        raise ConfigError(f"grid: unexpected argument {args.results!r} (the results folder is --out)")
    if args.plot is not None:
        raise ConfigError("grid: --plot belongs to 'grid report'")
    if args.out is None:
        raise ConfigError("grid: --out DIR is required (the results folder)")
    return run_grid_cmd(args)


def run_grid_cmd(args) -> int:
    from ..grid import load_spec
    from ..grid.runner import run_grid
    from ..grid.store import require_pyarrow

    check_local_jobs(args.jobs, args.ray)
    require_pyarrow()
    _check_results_folder(args.out, args.force)
    spec = load_spec(args.spec)
    with progress(desc="grid cells", disable=args.json) as bar:  # its total is known once run_grid starts
        summary = run_grid(spec, args.out, jobs=args.jobs, force=args.force, ray=args.ray,
                           on_start=lambda n: bar.reset(total=n), on_cells=bar.update)
    if args.json:
        emit_json([summary])
    else:
        print(f"grid {args.spec}: {summary['cells']} cells, {summary['skipped']} already done, "
              f"{summary['computed']} computed in {summary['parts']} part(s) -> {summary['out']}")
    return 0


def _check_results_folder(out: str, force: bool) -> None:
    """A grid writes into a new or empty folder, or resumes one holding its results (part-*.parquet);
    writing into any other existing folder needs --force."""
    from pathlib import Path

    from ..errors import ConfigError

    folder = Path(out)
    if force or not folder.is_dir() or any(folder.glob("part-*.parquet")):
        return
    others = sorted(p.name for p in folder.iterdir())
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ConfigError(f"--out {out}: an existing folder holding no grid results ({shown}); name a new or empty "
                          "folder, or pass --force to write into it")


def run_report(args) -> int:
    from pathlib import Path

    from ..errors import ConfigError
    from ..grid.report import METRICS, json_records, panels, plot_panels, title
    from ..grid.store import Store

    if not Path(args.results).is_dir():
        raise ConfigError(f"grid report: {args.results}: no such folder")
    rows = Store(args.results, read_only=True).read_rows()  # a report changes nothing in its folder
    if not rows:
        raise ConfigError(f"grid report: {args.results}: no results (run 'expertcache grid SPEC --out DIR' first)")
    ps = panels(rows)
    if args.json:
        emit_json(json_records(ps))
    else:
        for i, p in enumerate(ps):
            if i:
                print()
            print(title(p))
            for m, label in METRICS:
                print(f"{label} (rows: policy, columns: {p['unit']})")
                table([(pol, *(p["values"][m][pol].get(s) for s in p["sizes"])) for pol in p["policies"]],
                      ["policy", *p["sizes"]])
    if args.plot is not None:
        for path in plot_panels(ps, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0
