"""Helpers shared by the subcommands: output formats, argument types, trace loading."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Iterable, Sequence

from .._io import check_not_input, check_special, check_writable
from .._resample import MAX_RESAMPLES
from ..costmodel.runs import MAX_SAMPLES, MAX_SLOW_COPIES
from ..errors import ConfigError, is_int, max_threads
from ..report.plots import plot_format
from ..trace import Trace, load_trace, parse_layers

MAX_INT = 2**62
"""Largest integer an option takes (counts, capacities): beyond it no array could be indexed."""


def add_subcommands(p: argparse.ArgumentParser, dest: str, metavar: str = "SUBCOMMAND"):
    """A group of subcommands under ``p`` that one of must be named (argparse makes them optional)."""
    sub = p.add_subparsers(dest=dest, metavar=metavar)
    sub.required = True
    return sub


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (one object per line) instead of a table")


def add_replay_options(p: argparse.ArgumentParser, *, pool: bool = True, warm: float | None = 0.0) -> None:
    """Options that shape the streams a replay serves (docs/semantics.md). ``pool=False`` leaves out
    ``--pool``; ``warm`` is the default of ``--warm`` (``None`` leaves the option out)."""
    if pool:
        p.add_argument("--pool", choices=("layer", "global"), default="layer",
                       help="'layer': one pool of CAPACITY per layer (default); 'global': one pool of CAPACITY (layer, expert) items")
    p.add_argument("--reset", choices=("sequence", "none"), default="sequence",
                   help="empty the pools at each sequence (default) or carry them over")
    add_layers(p, "layer ids to replay")
    if warm is not None:
        p.add_argument("--warm", type=fraction, default=warm, metavar="W",
                       help=f"unscored warm-up fraction of each stream, e.g. 0.6 (default {warm:g})")


def float_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False, name: str = "a number"):
    """An argparse type: a float in the interval ``[lo, hi]`` (either end open), else one line."""
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name} in {span}, got {_short(text)}") from None
        if not ((lo < x) if lo_open else (lo <= x)) or not ((x < hi) if hi_open else (x <= hi)):
            raise argparse.ArgumentTypeError(f"{text} is outside {span}")
        return x

    parse.__name__ = f"float in {span}"
    return parse


fraction = float_in(0, 1, hi_open=True)
"""A fraction in [0, 1) (warm-up windows)."""


def _int_in(text: str, lo: int, hi: int, what: str, span: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {_short(text)}") from None
    if not lo <= x <= hi:
        raise argparse.ArgumentTypeError(f"expected {what} {span}, got {_short(text)}")
    return x


def add_parallel_options(p: argparse.ArgumentParser) -> None:
    """``--jobs N`` and ``--ray auto|ADDRESS``: split one trace's independent streams over workers
    (:mod:`expertcache.sim.parallel`); read them back with :func:`parallel_jobs`."""
    p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="N",
                   help="split the independent streams over N processes (default 1, at most 4 per core here; with "
                        "--ray, N tasks, default the number of cores here); same counts as serial")
    p.add_argument("--ray", metavar="auto|ADDRESS", default=None,
                   help="run the split streams as Ray tasks: 'auto' joins this machine's Ray or starts a local "
                        "one, ADDRESS joins a cluster (pip install 'expertcache[ray]'; docs/grid.md)")


def parallel_jobs(args) -> int:
    """The workers ``--jobs`` / ``--ray`` ask for (1: serial in this process), after
    :func:`check_local_jobs`."""
    check_local_jobs(args.jobs, args.ray)
    return args.jobs or ((os.cpu_count() or 1) if args.ray else 1)


def check_local_jobs(jobs: int | None, ray: str | None = None) -> None:
    """``--jobs N`` without ``--ray`` starts up to N worker processes here: at most
    :func:`max_threads`. Each is a Python with numpy and numba (about 130 MB resident); ``replay
    --jobs 1000`` on a trace of 256 streams (16 sequences x 16 layers) started 256 of them, more than
    this 24 GB machine holds, and it stalled in memory reclaim. With ``--ray`` N counts a cluster's
    tasks and is not bounded here."""
    if jobs is not None and ray is None and jobs > max_threads():
        raise ConfigError(f"--jobs {jobs}: at most {max_threads()} local worker processes (4 per core here; each "
                          "holds about 130 MB, and more replay no faster); for more cores use --ray ADDRESS")


def positive_int(text: str) -> int:
    """A count or capacity: an integer in [1, 2**62]."""
    return _int_in(text, 1, MAX_INT, "a positive integer", "up to 2**62")


def threads_int(text: str) -> int:
    """A thread count: an integer in [1, :func:`max_threads`]."""
    return _int_in(text, 1, max_threads(), "a positive integer", f"at most {max_threads()} (4 per core here)")


def slow_copies_int(text: str) -> int:
    """``--slow-copies N``: an integer in [1, :data:`MAX_SLOW_COPIES`]."""
    return _int_in(text, 1, MAX_SLOW_COPIES, "a positive integer", f"at most {MAX_SLOW_COPIES:,}")


def samples_int(text: str) -> int:
    """A number of timed samples: an integer in [1, :data:`MAX_SAMPLES`]."""
    return _int_in(text, 1, MAX_SAMPLES, "a positive integer", f"at most {MAX_SAMPLES:,}")


def resamples_int(text: str) -> int:
    """A number of bootstrap resamples, 0 (none) to :data:`MAX_RESAMPLES`."""
    return _int_in(text, 0, MAX_RESAMPLES, "an integer", f"from 0 to {MAX_RESAMPLES:,} (bootstrap resamples)")


def seed_int(text: str) -> int:
    """A random seed: an integer in [0, 2**63)."""
    return _int_in(text, 0, 2**63 - 1, "a non-negative integer", "below 2**63")


def byte_size(what: str):
    """An argparse type for a byte size (``400MB``, ``1.5GiB``; expertcache._units.parse_bytes),
    its errors in one line naming ``what``."""
    from .._units import parse_bytes

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, what)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{what}: ")) from None
    return parse


def positive_number(text: str) -> float:
    """A finite real number > 0 (a size in MB, a rate, a target)."""
    return _finite(text, positive=True)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (no nan, no inf)."""
    return _finite(text, positive=False)


def _finite(text: str, *, positive: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        what = "a positive number" if positive else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {_short(text)}") from None
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        what = "a positive finite number" if positive else "a finite number >= 0"
        raise argparse.ArgumentTypeError(f"expected {what}, got {_short(text)}")
    return x


def seconds_in(lo: float, hi: float):
    """argparse type: a number of seconds in ``[lo, hi]`` (a timeout beyond ``hi`` would overflow
    the clocks it is added to: ``--timeout inf`` was an OverflowError)."""
    def parse(text: str) -> float:
        x = nonnegative_float(text)
        if not lo <= x <= hi:
            raise argparse.ArgumentTypeError(f"{_short(text)}: expected a positive number of seconds in {lo:g}..{hi:g}")
        return x

    return parse


TIMEOUT_SECONDS = seconds_in(0.001, 1e6)
"""``--timeout S`` of the commands that kill a run after S seconds (at most about 11 days)."""


def layer_ids(text: str) -> list[int] | None:
    """argparse type of ``--layers``: layer ids such as '4-8' or '4,5,11' ('all': every layer; an
    empty value is refused, not taken as all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give layer ids such as '4-8' or '4,5,11', or 'all'")
    try:
        return parse_layers(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--layers: ")) from None


def add_layers(p: argparse.ArgumentParser, what: str) -> None:
    """``--layers IDS``: always layer ids, in every command."""
    p.add_argument("--layers", type=layer_ids, default=None, metavar="IDS",
                   help=f"{what}, e.g. '4-8' or '4,5,11' (default: all)")


def add_out(p: argparse.ArgumentParser, what: str, *, required: bool = True) -> None:
    """``--out/-o PATH``: the file a command writes (its folder must exist)."""
    p.add_argument("--out", "-o", required=required, metavar="PATH", help=what)


def check_out(path: str | None, option: str = "--out") -> None:
    """Refuse an output path whose folder does not exist before any work is done."""
    if path is not None:
        check_writable(path, option)


OUTPUT_OPTIONS = ("out", "plot", "capture")
"""The options (argparse dests) naming a file a command writes; every other string is a possible input."""


def refuse_overwriting_inputs(args: argparse.Namespace) -> None:
    """Before any command runs: none of its outputs (``--out``, ``--plot``, ``--capture``) may be
    a file it was given (the same path, a hard link, a symbolic link; also a trace folder's
    routing.npz or a checkpoint's config and weights). Inputs are every other string option:
    paths, comma lists (``--traces A,B``) and ``NAME:PATH`` values (``-p learned:PATH``)."""
    values = vars(args)
    inputs = list(dict.fromkeys(s for k, v in values.items() if k not in OUTPUT_OPTIONS for s in _paths_in(v)))
    for dest in OUTPUT_OPTIONS:
        if isinstance(values.get(dest), str):
            check_not_input(values[dest], inputs, "--" + dest)
            check_special(values[dest], "--" + dest)


def _paths_in(value) -> Iterable[str]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _paths_in(v)
        return
    if not isinstance(value, (str, os.PathLike)) or not isinstance(text := os.fspath(value), str):
        return
    yield text
    for part in text.split(","):
        yield part.strip()
        if ":" in part:
            yield part.split(":", 1)[1].strip()


def open_trace(path: str) -> Trace:
    """:func:`~expertcache.trace.load_trace`, saying on stderr when E was inferred (by the loader for a
    file without ``meta``, or by the importer for a log that does not record it: E is the largest
    expert id + 1, which a figure per expert such as coverage divides by)."""
    trace = load_trace(path)
    if trace.meta.get("num_experts_inferred"):
        print(f"note: {path}: E = {trace.num_experts} was inferred from its largest expert id, the model's "
              "experts not being recorded (give the trace a meta with num_experts where the model has more)",
              file=sys.stderr)
    return trace


def open_trace_or_chunked(path: str):
    """A :class:`~expertcache.trace.Trace` (:func:`open_trace`), or a
    :class:`~expertcache.trace.chunked.ChunkedTrace` when ``path`` is a folder holding
    ``chunks.json`` (the commands that stream one: replay, sweep)."""
    from ..trace.chunked import is_chunked, open_chunked

    return open_chunked(path) if is_chunked(path) else open_trace(path)


def describe_chunked(ct) -> str:
    """The :func:`describe` line of a chunked trace (from its manifest: no chunk is read)."""
    return (f"trace {ct.name}: T={ct.num_tokens} tokens in {ct.num_sequences} sequence(s), {ct.num_chunks} chunk(s) "
            f"on disk, L={ct.num_layers} layers, k={ct.top_k} of E={ct.num_experts}, "
            f"phase {ct.meta.get('phase', 'unknown')}")


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def emit_json(records: Iterable[dict], out=None) -> None:
    """One compact JSON object per line; NaN and infinities become null."""
    out = out or sys.stdout
    for rec in records:
        out.write(json.dumps(_clean(rec), allow_nan=False) + "\n")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalar
        return _clean(x.item())
    return x


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], out=None) -> None:
    """Print a plain aligned table: text left-aligned, numbers right-aligned."""
    out = out or sys.stdout
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(_is_num(r[i]) for r in rows) if rows else False for i in range(len(headers))]

    def line(vals):
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, numeric)).rstrip()

    out.write(line(headers) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in cells:
        out.write(line(r) + "\n")


def _is_num(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.0f}"
    if is_int(v):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return str(v)


def describe(trace: Trace) -> str:
    """One line: the trace's name and shape (a chunked trace's from its manifest)."""
    if not isinstance(trace, Trace):
        return describe_chunked(trace)
    rows = f"T={trace.num_tokens} tokens"
    if "iteration" in trace.extras or "accepted" in trace.extras:  # an engine trace: rows are router passes
        from ..trace.units import accepted_tokens, iterations

        rows = (f"T={trace.num_tokens} passes ({iterations(trace)} engine iterations, "
                f"{accepted_tokens(trace)} accepted tokens)")
    return (
        f"trace {trace.name}: {rows} in {trace.num_sequences} sequence(s), "
        f"L={trace.num_layers} layers, k={_k(trace)} of E={trace.num_experts}, phase {trace.meta.get('phase', 'unknown')}"
    )


def _k(trace: Trace) -> str:
    """The router's k; rows wider than k (speculative or batch unions) say their width too."""
    k = trace.meta.get("router_top_k")
    return str(trace.top_k) if not isinstance(k, int) or k == trace.top_k else f"{k} (rows up to {trace.top_k} wide)"


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def setup_line(run, what: str) -> str:
    """``run``: a ReplayResult or MissRatioCurve (both carry layers, reset, tokens and warm)."""
    return (
        f"{what}, {len(run.layers)} layer(s), reset at {'each sequence' if run.reset == 'sequence' else 'no point'}, "
        f"scored tokens {run.tokens}"
        + (f", scored engine iterations {run.iterations}" if getattr(run, "iterations", 0) not in (0, run.tokens) else "")
        + (f" (warm fraction {run.warm:g})" if run.warm else "")
    )


def check_plot(path: str | None) -> None:
    """Refuse a ``--plot`` path with an unknown extension or a missing folder, before any work."""
    if path is not None:
        plot_format(path)
        check_out(path, "--plot")


def wrote(path) -> None:
    print(f"wrote {path}", file=sys.stderr)


def future_note(names: list[str]) -> str:
    """The line under a table naming the policies that need the future (empty when none)."""
    return f"needs the future (clairvoyant, an offline reference): {', '.join(names)}" if names else ""


def future_mark(needs_future: bool) -> str:
    """The 'future' column: ``yes`` for a policy that reads the recorded future (clairvoyant)."""
    return "yes" if needs_future else ""
