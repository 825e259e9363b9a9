"""The live part of ``expertcache demo``: set-holding against lossless rules on the small trained MoE,
and the policy the cost model chooses, checked against slowed copies.

Runs only where torch and transformers are installed and ``models/small-moe`` is beside the
checkout (the working directory's, or the source tree's); otherwise it says why it is skipped.
The first 64 tokens of two held-out sequences, capacity 8 of 16 experts per layer, copies at x1 and x50
(``eval --slow-copies``), each timed ``repeats`` times, interleaved (``eval --repeats``): a
verdict whose lead is inside the runs' spread is a tie. On a CPU a copy is a memcpy within RAM,
a small share of a step, so the timings rank policies by machine load as much as by copies; the
section says so, with the measured share.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

POLICIES = ("lru", "dwell:1:1", "dwell:4:32", "prefix:32")
FACTORS = (1, 50)
TOLERANCE = 0.15
CAPACITY = 8
REPEATS = 3
TOKENS = 64
"""Tokens of each held-out sequence used: half of each, so three interleaved rounds cost about
1.5 times the former single round of whole sequences."""


def small_model() -> Path | None:
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        folder = root / "models" / "small-moe"
        if (folder / "config.json").is_file() and (folder / "heldout_ids.npy").is_file():
            return folder
    return None


def copy_share(records, factor: int) -> float | None:
    """Median over the runs at ``factor`` of ``rho x tau / ms_per_token``: the share of a decode
    step spent copying experts (``None`` when no run there made a timed copy)."""
    shares = [r["rho"] * r["tau_ms"] / r["ms_per_token"] for r in records
              if r.get("slow_copies", 1) == factor and r.get("tau_ms") and r.get("ms_per_token")]
    return statistics.median(shares) if shares else None


def cpu_note(records) -> str:
    """What the live part can and cannot show on this machine, with the measured copy share."""
    shares = [(n, copy_share(records, n)) for n in sorted({r.get("slow_copies", 1) for r in records})]
    measured = ", ".join(f"{100 * s:.2g}% at x{n}" for n, s in shares if s is not None) or "not measured"
    return (f"  on this CPU copies take {measured} of a step (median over the policies): what it can show is "
            "measured, not modelled: lossless rules keep the NLL exact, set-holding rules trade NLL for fewer "
            "copies; what it cannot show is a GPU link's speed-up: with copies this cheap the timings rank the "
            "policies by machine load as much as by copies (x50 stands in for a slow link); for a deployment's "
            "figures give its tau and c to 'expertcache size' or 'expertcache choose --tau'")


def verdict_line(check) -> str:
    """One validation verdict: agree, DISAGREE or tie (within noise), with the lead and the spread."""
    lead = f"measured lead {100 * check.lead:.1f}%" if check.lead is not None else "no runner-up"
    noise = f", spread {100 * check.noise:.0f}%" if check.noise is not None else ", spread unknown (one run each)"
    return f"  at x{check.slow_copies}: predicted {check.predicted}, measured {check.measured}: {check.verdict} ({lead}{noise})"


def live_section(repeats: int = REPEATS) -> None:
    folder = small_model()
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing or folder is None:
        why = f"{' and '.join(missing)} not installed (pip install 'expertcache[hf]')" if missing else \
            "models/small-moe is not beside this checkout"
        print(f"\nlive part skipped: {why}")
        return
    from ..costmodel.choose import choose, validate
    from ..costmodel.runs import run_from_record
    from ..hf import evaluate, load_model
    from ..trace.npz import read_npy
    from .common import table

    model = load_model(folder, device="cpu")
    seqs = [s[:TOKENS] for s in read_npy(folder / "heldout_ids.npy", "heldout_ids.npy")[:2]]
    print(f"\nlive: {folder.name} (a small OLMoE-class model trained here), {len(seqs)} held-out sequences "
          f"of {TOKENS} tokens, "
          f"capacity {CAPACITY} of 16 experts per layer, copies at x{' and x'.join(map(str, FACTORS))}, "
          f"{repeats} interleaved run(s) each (median shown)")
    records = []
    for n in FACTORS:
        ev = evaluate(model, seqs, CAPACITY, POLICIES, slow_copies=n, repeats=repeats, progress=True)
        records += [r.to_dict() | {"needs_future": False} for r in ev.results]
    runs = [run_from_record(r, f"{r['policy']} x{r['slow_copies']}") for r in records]
    by = {(r["policy"], r["slow_copies"]): r for r in records}
    spread = [f"spread x{n}" for n in FACTORS] if repeats > 1 else []
    table([(p, by[p, 1]["dnll"], "lossless" if by[p, 1]["lossless"] else "set-holding", by[p, 1]["rho"],
            by[p, 1]["switch_rate"], *(by[p, n]["ms_per_token"] for n in FACTORS),
            *(by[p, n].get("ms_per_token_spread") for n in FACTORS if repeats > 1)) for p in POLICIES],
          ["policy", "dnll", "kind", "copies/token", "switch rate", *(f"ms/token x{n}" for n in FACTORS), *spread])
    choice = choose([r for r in runs if r.slow_copies == 1], TOLERANCE)
    print(f"choose --tolerance {TOLERANCE}: tau {choice.tau_ms:.4f} ms measured; fastest admissible "
          f"{choice.winner.policy}; crossovers: "
          + (", ".join(f"{c.a} -> {c.b} at tau {c.tau_ms:.3g} ms" for c in choice.crossovers) or "none"))
    for check in validate(runs, TOLERANCE, choice.tau_ms):
        print(verdict_line(check))
    print("  (set-holding rules copy less and pay in NLL; which wins depends on tau: docs/choose.md)")
    print(cpu_note(records))
