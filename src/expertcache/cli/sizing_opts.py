"""Sizing options shared by the commands that print copies (replay, sweep, compare-pools, demo).

``--expert-mb MB`` | ``--model-config PATH``, ``--tau DURATION``, ``--c DURATION`` and
``--tokens-per-s N`` turn copies per token into MB/token, GB/s, ms/token, tokens/s and cache memory
(definitions: :mod:`expertcache.costmodel.sizing`, docs/sizing.md). Without any of them a command's
output keeps its sizing-free form. The expert size comes from ``--expert-mb`` or
``--model-config`` when given, else from the trace meta key ``expert_bytes``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

from ..costmodel import FIGURES, GB, LIMITS, MB, Sizing, SizingFigures, cache_bytes, expert_bytes_from_config, parse_duration_ms
from ..costmodel.sizing import MIN_DURATION_MS
from ..errors import ConfigError
from .common import positive_number

SIZING_OPTIONS = ("expert_mb", "model_config", "tau", "c", "tokens_per_s")


def add_sizing_options(p: argparse.ArgumentParser) -> None:
    """Add the sizing options in their own help group."""
    g = p.add_argument_group("sizing (docs/sizing.md; decimal units: 1 MB = 1e6 bytes, 1 GB = 1e9 bytes)")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--expert-mb", type=positive_number, default=None, metavar="MB",
                      help="bytes of one expert in decimal MB, e.g. 12.6 for OLMoE bf16 "
                           "(default: the trace meta key expert_bytes, when present)")
    size.add_argument("--model-config", default=None, metavar="PATH",
                      help="expert size from a Hugging Face config.json (or a folder holding one): "
                           "3 x hidden_size x (moe_)intermediate_size x dtype bytes")
    g.add_argument("--tau", type=duration, default=None, metavar="DURATION",
                   help="time to copy one expert host-to-device, e.g. 0.51ms, 510us, 0.00051s (bare number: ms)")
    g.add_argument("--c", type=compute_time, default=None, metavar="DURATION",
                   help="compute time per token with every expert resident, e.g. 20.4ms (bare number: ms), "
                        "or that decode rate, e.g. 49tok/s for c = 1000/49 ms")
    g.add_argument("--tokens-per-s", type=positive_number, default=None, metavar="N",
                   help="decode rate to size the link for (GB/s needed); default: the predicted blocking rate")


def duration(text: str) -> float:
    """Argparse type: a duration in milliseconds (see :func:`~expertcache.costmodel.parse_duration_ms`)."""
    try:
        return parse_duration_ms(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def compute_time(text: str) -> float:
    """Argparse type of ``--c``: a duration in milliseconds, or ``'N tok/s'``, the all-resident
    decode rate, for ``1000 / N`` ms."""
    head, sep, _ = str(text).strip().lower().partition("tok/s")
    if not sep:
        return duration(text)
    if _ or not head.strip():
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a rate (e.g. '49tok/s')")
    ms = 1000.0 / positive_number(head.strip())
    if not math.isfinite(ms):
        raise argparse.ArgumentTypeError(f"{text!r}: the rate is too small")
    if ms < MIN_DURATION_MS:
        raise argparse.ArgumentTypeError(f"{text!r}: above 1e9 tok/s (1 ns a token), not a plausible rate")
    return ms


def sizing_requested(args) -> bool:
    """True when any sizing option was given."""
    return any(getattr(args, name, None) is not None for name in SIZING_OPTIONS)


@dataclass(frozen=True)
class SizingSetup:
    """The inputs a command sizes with, where each came from, and whether to show the figures
    (``active``: a sizing option was given, or the command supplies defaults, as the demo does)."""

    sizing: Sizing = field(default_factory=Sizing)
    sources: dict = field(default_factory=dict)
    active: bool = False

    # ------------------------------------------------------------------------ records and rows
    def record(self, copies_per_token: float, *, capacity: int | None, num_layers: int, pool: str) -> dict:
        """The JSON fields (inputs and figures; ``{}`` when not active)."""
        if not self.active:
            return {}
        return self.sizing.record(copies_per_token, capacity=capacity, num_layers=num_layers, pool=pool)

    def result_record(self, r) -> dict:
        """:meth:`record` for a ReplayResult."""
        return self.record(r.copies_per_token, capacity=r.capacity, num_layers=len(r.layers), pool=r.pool)

    def columns(self, *, cache: bool = True) -> list[tuple[str, str, float]]:
        """``(header, figure, divisor)`` of every figure the known inputs give (none when not active)."""
        if not self.active:
            return []
        s = self.sizing
        timed = s.tau_ms is not None and s.c_ms is not None
        cols = []
        if s.expert_bytes is not None:
            cols.append(("MB/tok", "bytes_per_token", MB))
            if s.tokens_per_s is not None or timed:
                cols.append(("GB/s", "gbps_needed", 1.0))
        if timed:
            cols += [("ms/tok", "ms_per_token", 1.0), ("ms/tok ovl", "ms_per_token_overlapped", 1.0),
                     ("tok/s", "tokens_per_s_predicted", 1.0)]
        elif s.tau_ms is not None:
            cols.append(("copy ms/tok", "copy_ms_per_token", 1.0))
        if cache and s.expert_bytes is not None:
            cols.append(("cache GB", "cache_bytes", GB))
        return cols

    def headers(self, *, cache: bool = True, prefix: str = "") -> list[str]:
        return [prefix + h for h, _, _ in self.columns(cache=cache)]

    def cells(self, figures: SizingFigures | dict, *, cache: bool = True) -> list[Any]:
        d = figures.to_dict() if isinstance(figures, SizingFigures) else figures
        return [None if d.get(key) is None else d[key] / div for _, key, div in self.columns(cache=cache)]

    def result_cells(self, r, *, cache: bool = True) -> list[Any]:
        """Table cells of a ReplayResult, in :meth:`columns` order."""
        if not self.active:
            return []
        fig = self.sizing.figures(r.copies_per_token, capacity=r.capacity, num_layers=len(r.layers), pool=r.pool)
        return self.cells(fig, cache=cache)

    def describe(self) -> str:
        """A line naming each input and its source, and one saying how the figures are computed."""
        if not self.active:
            return ""
        s, src = self.sizing, self.sources
        parts = []
        if s.expert_bytes is not None:
            parts.append(f"expert {s.expert_bytes / MB:.4g} MB ({s.expert_bytes:,.0f} bytes, {src['expert_bytes']})")
        if s.tau_ms is not None:
            parts.append(f"tau {s.tau_ms:.4g} ms per copy ({src['tau_ms']})")
        if s.c_ms is not None:
            parts.append(f"c {s.c_ms:.4g} ms/token compute ({src['c_ms']})")
        if s.tokens_per_s is not None:
            parts.append(f"{s.tokens_per_s:g} tok/s ({src['tokens_per_s']})")
        how = []
        if s.tau_ms is not None and s.c_ms is not None:
            how.append("ms/tok = c + copies/token x tau (copies block), ovl = max(c, copies/token x tau) "
                       "(copies overlapped), tok/s = 1000 / ms/tok")
        elif s.tau_ms is not None:
            how.append("copy ms/tok = copies/token x tau (copy time only: add --c for ms/token and tok/s)")
        elif s.c_ms is not None:
            how.append("add --tau for time per token")
        if s.expert_bytes is not None:
            if s.tokens_per_s is not None:
                how.append(f"GB/s needed at {s.tokens_per_s:g} tok/s")
            elif s.tau_ms is not None and s.c_ms is not None:
                how.append("GB/s needed at each row's predicted tok/s")
            else:
                how.append("add --tokens-per-s (or --tau and --c) for the GB/s needed")
        else:
            how.append("add --expert-mb or --model-config for MB/token, GB/s and cache memory")
        return "sizing: " + ", ".join(parts) + ("\n  " + "; ".join(how) if how else "")


def resolve_sizing(args, trace=None, *, defaults: Sizing | None = None, default_source: str = "") -> SizingSetup:
    """The setup from ``args`` (the options of :func:`add_sizing_options`), the trace meta key
    ``expert_bytes`` and, for inputs still unknown, ``defaults`` (labelled ``default_source``).

    The expert size is looked up even when no option is given (``--target-*`` reports memory with
    it), but the figures are shown only when ``active``: an option was given or ``defaults`` is set.
    """
    active = sizing_requested(args) or defaults is not None
    sources: dict = {}
    values: dict = {}
    mb = getattr(args, "expert_mb", None)
    config = getattr(args, "model_config", None)
    if mb is not None:
        if not 1 <= mb * MB <= LIMITS["expert_bytes"]:  # checked before rounding to whole bytes
            raise ConfigError(f"--expert-mb: {mb:g} MB is not between one byte and 10 TB")
        values["expert_bytes"], sources["expert_bytes"] = round(mb * MB), "--expert-mb"
    elif config is not None:
        values["expert_bytes"], sources["expert_bytes"] = expert_bytes_from_config(config), f"from {config}"
    elif trace is not None and trace.meta.get("expert_bytes") is not None:  # validated when the trace was loaded
        values["expert_bytes"], sources["expert_bytes"] = trace.meta["expert_bytes"], "trace meta expert_bytes"
    for name, option in (("tau_ms", "tau"), ("c_ms", "c"), ("tokens_per_s", "tokens_per_s")):
        value = getattr(args, option, None)
        if value is not None:
            values[name], sources[name] = value, "--" + option.replace("_", "-")
    if defaults is not None:
        for name, value in defaults.inputs().items():
            if value is not None and name not in values:
                values[name], sources[name] = value, default_source
    return SizingSetup(Sizing(**values), sources, active=active)


# ------------------------------------------------------------------------ sweep --target-*
def target_records(curves, layout, trace, args, setup) -> list[dict]:
    """One ``"record": "target"`` object per curve; with ``--target-hit-rate``, one not reached carries
    the ceiling every lossless rule shares (``hit_rate_ceiling``: every expert resident, only cold
    fills miss) and the same on a fair window (``hit_rate_ceiling_fair``, ``null`` when the sweep
    already warms at least that much)."""
    from dataclasses import replace

    from ..sim import StreamOptions, build_layout
    from ..sim.curves import FAIR_WARM, curve_target
    from ..sim.curves.targets import hit_rate_ceiling

    ceiling = None
    if args.target_hit_rate is not None and layout.admission == "all":
        opts = StreamOptions.from_args(args)
        fair = build_layout(trace, replace(opts, warm=FAIR_WARM)) if opts.warm < FAIR_WARM else None
        ceiling = hit_rate_ceiling(layout, fair_layout=fair)
    out = []
    for c in curves:
        rec = target_record(c, curve_target(c, target_hit_rate=args.target_hit_rate, target_copies=args.target_copies),
                            setup, trace.name)
        if ceiling is not None and not rec["reached"]:  # why not: the ceiling every lossless rule shares
            rec |= {"hit_rate_ceiling": ceiling.hit_rate, "hit_rate_ceiling_fair": ceiling.fair,
                    "note": ceiling.note(args.target_hit_rate)}
        out.append(rec)
    return out


def target_record(curve, target, setup, trace_name: str) -> dict:
    """The ``"record": "target"`` JSON object of one policy (see docs/sizing.md)."""
    r = curve.at(target.capacity) if target.reached else None
    S = setup.sizing.expert_bytes
    memory = (cache_bytes(target.capacity, S, pool=curve.pool, num_layers=len(curve.layers))
              if r is not None and S is not None else None)
    rec = {
        "record": "target", "policy": curve.policy, "needs_future": curve.needs_future,
        "target_hit_rate": target.target_hit_rate, "target_copies": target.target_copies,
        "capacity": target.capacity, "reached": target.reached, "cache_bytes": memory,
        "hit_rate": r.hit_rate if r else None, "copies_per_token": r.copies_per_token if r else None,
        "max_capacity": target.max_capacity, "misses_again_at": list(target.misses_again_at),
        "pool": curve.pool, "layers": list(curve.layers), "trace": trace_name,
    }
    if setup.active:
        sized = setup.result_record(r) if r is not None else setup.sizing.inputs() | dict.fromkeys(FIGURES)
        rec |= sized | {"cache_bytes": memory}
    return rec


def print_targets(records: list[dict]) -> None:
    """The target lines, one per policy, from the ``"record": "target"`` objects."""
    r0 = records[0]
    want = []
    if r0["target_hit_rate"] is not None:
        want.append(f"hit rate >= {r0['target_hit_rate']:g}")
    if r0["target_copies"] is not None:
        want.append(f"copies/token <= {r0['target_copies']:g}")
    unit = "in the global pool" if r0["pool"] == "global" else "per layer"
    print(f"\nsmallest swept capacity with {' and '.join(want)} (experts {unit}):")
    width = max(len(r["policy"]) for r in records)
    for r in records:
        mark = " (needs future)" if r["needs_future"] else ""
        if not r["reached"]:
            print(f"  {r['policy']:<{width}}  not reached up to C={r['max_capacity']}{mark}")
            continue
        line = (f"  {r['policy']:<{width}}  C={r['capacity']}: hit rate {r['hit_rate']:.4f}, "
                f"{r['copies_per_token']:.4f} copies/token")
        if r["cache_bytes"] is not None:
            line += f", cache {r['cache_bytes'] / GB:.4g} GB"
        if r.get("ms_per_token") is not None:
            line += f", {r['ms_per_token']:.4g} ms/token ({r['tokens_per_s_predicted']:.4g} tok/s)"
        line += mark
        again = r["misses_again_at"]
        if again:
            shown = ", ".join(map(str, again[:8])) + (", ..." if len(again) > 8 else "")
            line += f"; not monotone: misses the target again at C={shown}"
        print(line)
    notes = {r.get("note") for r in records if r.get("note")}
    for note in notes:
        print("  " + note)


# ------------------------------------------------------------------------ size --memory
def auto_or_rate(unit: str):
    """Argparse type of ``--disk-bandwidth`` / ``--compute``: ``auto``, or a positive number in
    ``unit`` (the unit may be written after it: ``1.78``, ``1.78GB/s``; ``34``, ``34tok/s``)."""

    def parse(text: str):
        t = str(text).strip()
        if t.lower() == "auto":
            return "auto"
        if t.lower().endswith(unit.lower()):
            t = t[: -len(unit)].strip()
        try:
            x = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected auto or a number in {unit}, got {str(text)[:40]!r}") from None
        if not (math.isfinite(x) and 1e-6 <= x <= 1e9):  # below 1e-6 a forecast would print 1e-298 tok/s
            raise argparse.ArgumentTypeError(f"expected auto or a positive number in {unit} from 1e-6 to 1e9, "
                                             f"got {str(text)[:40]!r}")
        return x

    return parse
