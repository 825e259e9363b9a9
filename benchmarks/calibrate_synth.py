"""Fit the synthetic presets to their published targets, or report how close they are.

    .venv/bin/python benchmarks/calibrate_synth.py --report            # achieved vs targets, all presets
    .venv/bin/python benchmarks/calibrate_synth.py --fit kimi-k3 --evals 300

Targets are measured by :func:`expertcache.analysis.calibration.measure_targets` (the calibration
contract that tests/test_synth.py asserts). The fit is a random search around the current
parameters (wide steps for the first half of the evaluations, narrow ones after), keeping
``zipf_last >= zipf_first`` so concentration never falls with depth. The loss sums, over targets,
seeds and measured values, the squared distance outside the target range in units of its
tolerance plus a small pull towards the range's centre. The winner is printed as a
``SynthParams(...)`` to paste into ``PRESETS``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace

import numpy as np

from expertcache.analysis.calibration import check_targets, measure_targets
from expertcache.trace.synth import PRESETS, Preset, SynthParams, synthesize

SEARCH_BOX = {  # name: (low, high, log scale)
    "zipf_first": (0.0, 2.0, False),
    "zipf_last": (0.0, 2.0, False),
    "depth_power": (0.2, 3.0, True),
    "zipf_cutoff": (0.03, 4.0, True),
    "cutoff_power": (0.5, 8.0, True),
    "reuse_prob": (0.0, 0.95, False),
    "lag_exponent": (0.3, 3.0, False),
    "max_lag": (4, 512, True),
    "drift_rate": (0.005, 2.0, True),
    "domain_shuffle": (0.0, 1.0, False),
}


def loss(preset: Preset, params: SynthParams, seeds: list[int]) -> float:
    total = 0.0
    for seed in seeds:
        measured = measure_targets(preset, synthesize(params, seed, preset=preset.name))
        for name, target in preset.targets.items():
            unit = target.tol or 0.01
            centre = (target.lo + target.hi) / 2
            for v in measured[name]:
                if v is None or math.isnan(v):
                    total += 100.0
                    continue
                outside = max(0.0, target.lo - v, v - target.hi) / unit
                total += outside**2 + 0.05 * ((v - centre) / unit) ** 2
    return total


def _step(rng: np.random.Generator, params: SynthParams, spread: float, names: list[str]) -> SynthParams:
    changes = {}
    for name in names:
        lo, hi, log = SEARCH_BOX[name]
        cur = getattr(params, name)
        if log:
            val = math.exp(math.log(max(cur, lo)) + rng.normal(0, spread * math.log(hi / lo) / 4))
        else:
            val = cur + rng.normal(0, spread * (hi - lo) / 4)
        val = min(max(val, lo), hi)
        changes[name] = int(round(val)) if name == "max_lag" else round(float(val), 3)
    out = replace(params, **changes)
    if out.zipf_last < out.zipf_first:
        out = replace(out, zipf_last=out.zipf_first)
    return out


def fit(preset: Preset, evals: int, seeds: list[int], names: list[str], spread: float = 1.0,
        rng_seed: int = 0) -> SynthParams:
    rng = np.random.default_rng(rng_seed)
    best, best_loss = preset.params, loss(preset, preset.params, seeds)
    print(f"start loss {best_loss:.3f}", flush=True)
    for i in range(evals):
        cand = _step(rng, best, spread if i < evals // 2 else 0.3 * spread, names)
        cand_loss = loss(preset, cand, seeds)
        if cand_loss < best_loss:
            best, best_loss = cand, cand_loss
            print(f"[{i}] loss {best_loss:.3f}  {best}", flush=True)
    return best


def report(preset: Preset, seeds: list[int]) -> None:
    print(f"== {preset.name}: {preset.description}  (seeds {', '.join(map(str, seeds))})")
    checks = [check_targets(preset, synthesize(preset.params, s, preset=preset.name)) for s in seeds]
    for i, name in enumerate(preset.targets):
        target = checks[0][i].target
        vals = [v for c in checks for v in c[i].values]
        ok = all(c[i].ok for c in checks)
        print(f"  {name:28s} target {str(target):>11s} +- {target.tol:<6g} measured mean {np.mean(vals):8.4f}"
              f"  range {min(vals):.4f} .. {max(vals):.4f}  {'ok' if ok else 'OUTSIDE'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", metavar="PRESET", help="search parameters for this preset")
    ap.add_argument("--report", action="store_true", help="print achieved statistics vs targets")
    ap.add_argument("--evals", type=int, default=200)
    ap.add_argument("--seeds", default="0", help="generator seeds the fit / report uses (comma-separated)")
    ap.add_argument("--params", default=",".join(SEARCH_BOX), help="parameters the fit may change")
    ap.add_argument("--spread", type=float, default=1.0, help="step size of the first half (1: a quarter of the box)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.fit:
        t0 = time.perf_counter()
        best = fit(PRESETS[args.fit], args.evals, seeds, args.params.split(","), args.spread)
        print(f"best ({time.perf_counter() - t0:.0f} s): {best}")
        report(replace(PRESETS[args.fit], params=best), seeds)
    if args.report or not args.fit:
        for preset in PRESETS.values():
            if preset.targets:
                report(preset, seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
