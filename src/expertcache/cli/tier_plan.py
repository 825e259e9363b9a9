"""``expertcache tier plan``: breakeven reuse between tiers, the placement it implies, and the
smallest DRAM capacity that meets a target iterations/s (docs/tier.md, "Sizing: tier plan")."""

from __future__ import annotations

import argparse
import math

from .._units import format_bytes, parse_bytes
from ..errors import ConfigError
from ..tier import plan as P
from .common import add_json, emit_json, open_trace, positive_number, table

HELP = """Size the tiers of a file-backed expert pool (paper section 8).

k* = (1/copy) / (1/slow - 1/fast) is the number of reuses after which promoting an expert to the
faster tier pays, for HBM <- host DRAM (coherent link, and the same pair over PCIe) and host DRAM
<- NVMe. The placement owns in HBM the experts whose reuse over the trace (requests - 1) exceeds
the coherent-link k*, most requested first (cut to --hbm-capacity), and leaves the rest to the
kernel page cache; adopt (read host pages in place) or stream (copy per use) is decided by their
per-byte times. Given a T(C) curve (--curve: the lines 'tier sweep --json' prints) it answers the
smallest measured capacity whose median iterations/s meets --target-iters-per-s, and the linear
interpolation between the bracketing points. Every number is defined in docs/tier.md.
"""


def _gbps(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a bandwidth in GB/s, got {text[:40]!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive bandwidth in GB/s, got {text[:40]!r}")
    return x


def add_plan_parser(tier_sub) -> None:
    """Register ``tier plan`` under the ``tier`` command's subparsers."""
    p = tier_sub.add_parser("plan", help="breakeven reuse, placement and capacity for a target rate",
                            description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="canonical trace (.npz, or a folder holding routing.npz)")
    p.add_argument("--hbm-gbps", type=_gbps, default=None, help="accelerator read rate of its own HBM (k*, placement)")
    p.add_argument("--host-gbps", type=_gbps, default=None,
                   help="accelerator direct (zero-copy) read rate of host DRAM / page-cache pages (k*, placement)")
    p.add_argument("--pcie-gbps", type=_gbps, default=None,
                   help="host-to-accelerator rate without a coherent read path (the PCIe k* row)")
    p.add_argument("--nvme-gbps", type=_gbps, default=None, help="read rate of the pool's storage (the host<-nvme row)")
    p.add_argument("--copy-gbps", type=_gbps, default=None,
                   help="overlapped host-to-HBM copy rate (default: --host-gbps; the paper measured 346)")
    p.add_argument("--expert-mb", type=positive_number, default=None,
                   help="bytes per expert in MB (1 MB = 1e6 bytes); taken from the pool's manifest with --pool")
    p.add_argument("--pool", metavar="DIR", default=None, help="a pool from 'tier write': the expert size comes from it")
    p.add_argument("--target-iters-per-s", type=positive_number, default=None,
                   help="iterations per second to meet (the capacity answer, with --curve)")
    p.add_argument("--hbm-capacity", default=None, metavar="SIZE",
                   help="HBM available for owned experts, e.g. 40GB (default: no cut)")
    p.add_argument("--curve", default=None, metavar="SWEEP.jsonl", help="T(C) points: the output of 'tier sweep --json'")
    p.add_argument("--tie-band", type=float, default=P.DEFAULT_TIE_BAND,
                   help=f"adopt and stream tie within this relative gap (default {P.DEFAULT_TIE_BAND:g})")
    add_json(p)
    p.set_defaults(func=run)


def _expert_bytes(args) -> int:
    """The expert size: the pool manifest's with --pool (an --expert-mb that disagrees is refused)."""
    if args.pool is not None:
        from ..tier.pool import open_pool
        size = open_pool(args.pool).expert_bytes
        if args.expert_mb is not None and int(round(args.expert_mb * 1e6)) != size:
            raise ConfigError(f"--expert-mb {args.expert_mb:g}: the pool {args.pool} holds experts of {size} bytes")
        return size
    if args.expert_mb is None:
        raise ConfigError("--expert-mb: give the expert size in MB, or --pool DIR to take it from a pool")
    return int(round(args.expert_mb * 1e6))


def compute(args) -> dict:
    """The whole answer as one JSON-able object (what ``--json`` prints). Only the rates a question
    needs are required: k* rows need their pair's rates, the placement the coherent pair's, the
    capacity answer a curve and a target; asking nothing is an error."""
    rates = P.Rates(args.hbm_gbps, args.host_gbps, args.pcie_gbps, args.nvme_gbps,
                    args.copy_gbps or args.host_gbps, args.copy_gbps is not None).check()
    if args.curve is None and not (args.hbm_gbps and args.host_gbps) and not P.tier_pairs(rates):
        raise ConfigError("tier plan: nothing to answer: give --hbm-gbps and --host-gbps (k* and placement), "
                          "or --curve SWEEP.jsonl with --target-iters-per-s (capacity)")
    if args.curve is not None and args.target_iters_per_s is None:
        raise ConfigError("--curve: give --target-iters-per-s, the rate the capacity must meet")
    expert_bytes = _expert_bytes(args)
    hbm_bytes = None if args.hbm_capacity is None else parse_bytes(args.hbm_capacity, "--hbm-capacity")
    curve = None if args.curve is None else P.read_curve(args.curve)  # bad input fails before the trace loads
    pairs = P.tier_pairs(rates)
    trace = open_trace(args.trace)
    counts, iterations = P.request_counts(trace)
    coherent = next((p for p in pairs if p["link"] == "coherent"), None)
    place = P.placement(counts, iterations, coherent["k_star"] if coherent else math.inf, expert_bytes, hbm_bytes)
    per_iter = (place["requests_per_iteration"] or 0) * expert_bytes
    out = {"trace": trace.name, "expert_bytes": expert_bytes,
           "rates_gbps": {k: getattr(rates, k) for k in ("hbm", "host", "pcie", "nvme", "copy")},
           "copy_rate_given": rates.copy_given, "tier_pairs": pairs, "pairs_left_out": P.missing_pairs(rates),
           "adopt_or_stream": P.adopt_or_stream(rates.host, rates.copy, args.tie_band) if rates.host else None,
           "placement": place, "placement_note": None if coherent else
           "no coherent-link k* (give --hbm-gbps and --host-gbps): nothing is owned in HBM",
           "demand_bytes_per_iteration": per_iter,
           "iters_per_s_all_from_nvme": rates.nvme * 1e9 / per_iter if per_iter and rates.nvme else None,
           "iters_per_s_all_from_host": rates.host * 1e9 / per_iter if per_iter and rates.host else None,
           "target_iters_per_s": args.target_iters_per_s}
    if curve is None:
        out.update(capacity=None, capacity_note="give --curve SWEEP.jsonl (from 'tier sweep --json') for the capacity answer")
    else:
        points, skipped = curve
        note = P.check_curve(points, expert_bytes, trace.name, args.curve)
        out.update(capacity=P.capacity_for_target(points, args.target_iters_per_s), curve_skipped=skipped,
                   capacity_note=note)
    return out


def run(args) -> int:
    out = compute(args)
    if args.json:
        emit_json([out])
        return 0
    r = out["rates_gbps"]
    print(f"trace {out['trace']}: {out['placement']['iterations']} iterations, "
          f"{out['placement']['requests_per_iteration'] or 0:.4g} expert requests per iteration of "
          f"{format_bytes(out['expert_bytes'])} ({format_bytes(out['demand_bytes_per_iteration'])} per iteration)")
    if not out["copy_rate_given"] and r["host"]:
        print(f"copy rate: not given, taken as --host-gbps {r['host']:g} (give --copy-gbps to use a measured one)")
    if out["tier_pairs"]:
        print("\nbreakeven reuse k* = (1/copy) / (1/slow - 1/fast):")
        table([[p["pair"], p["link"], f"{p['copy_gbps']:g}", f"{p['slow_gbps']:g}", f"{p['fast_gbps']:g}", p["k_star"]]
               for p in out["tier_pairs"]],
              ["pair", "link", "copy GB/s", "slow GB/s", "fast GB/s", "k*"])
    if any(p["pair"] == "host<-nvme" for p in out["tier_pairs"]):
        print("  host<-nvme: admission on a miss through the page cache costs no extra read (k* = 0, Rule 1)")
    for line in out["pairs_left_out"]:
        print(f"  left out: {line}")
    a = out["adopt_or_stream"]
    if a is not None:
        print(f"\nadopt (read host pages in place, {r['host']:g} GB/s) vs stream (copy per use, {r['copy']:g} GB/s): "
              f"gap {a['gap']:.1%} of their mean (adopt slower by {a['adopt_slower_by']:.1%}, stream faster by "
              f"{a['stream_faster_by']:.1%}); tie band {a['tie_band']:.0%} -> {a['choice']}")
    _print_placement(out)
    if out["capacity"] is None:
        print(f"\ncapacity: {out['capacity_note']}")
        return 0
    print(f"\ncapacity for {out['target_iters_per_s']:g} it/s:")
    table([[c["mode"], _cap(c["measured_capacity_bytes"]), _cap(c["interpolated_capacity_bytes"]), c["note"]]
           for c in out["capacity"]], ["mode", "measured", "interpolated", "note"])
    if out["capacity_note"]:
        print(f"note: {out['capacity_note']}")
    return 0


def _print_placement(out: dict) -> None:
    if out["placement_note"]:
        print(f"\nplacement: {out['placement_note']}")
        return
    p = out["placement"]
    k = next(x["k_star"] for x in out["tier_pairs"] if x["link"] == "coherent")
    print(f"\nplacement at k* = {k:.3g} (coherent link): "
          f"{p['candidates_above_k_star']} of {p['experts_touched']} touched experts are reused more than k* times "
          f"({format_bytes(p['candidate_bytes'])})")
    cut = "" if p["hbm_slots"] is None else f" (HBM holds {p['hbm_slots']} experts)"
    print(f"  own in HBM: {p['pinned']}{cut}, {format_bytes(p['pinned_bytes'])}, "
          f"{(p['pinned_request_share'] or 0):.1%} of requests")
    print(f"  leave to the page cache: {p['left_to_page_cache']}, {format_bytes(p['left_bytes'])}, "
          f"{(p['left_request_share'] or 0):.1%} of requests")
    print(f"\nall requests from NVMe: {_num(out['iters_per_s_all_from_nvme'])} it/s; "
          f"all from host DRAM: {_num(out['iters_per_s_all_from_host'])} it/s (transfer time only)")


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _cap(x) -> str:
    return "-" if x is None else format_bytes(x)
