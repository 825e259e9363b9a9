"""The cost model on a real link: the predicted against the measured winner at three host modes.

Reads what ``expertcache calibrate --host H --json`` and ``expertcache eval --host H --repeats N
--json`` wrote for H = memory, mmap, direct (files ``cal-H.json`` and ``eval-H.jsonl`` in one
folder; the commands are in docs/offload.md, "Host tiers"), and for each host mode:

* predicted ms/token of each policy = ``c + rho * tau_H``: ``c`` and ``rho`` from the policy's
  ``host=memory`` run (the computation and the copies do not depend on where the experts come
  from: the copy counts are equal, a test checks it), ``tau_H`` the median ``calibrate --host H``;
* measured ms/token = the median round of the policy's ``host=H`` run, with its spread;
* the verdict with ``expertcache choose``'s own rule (:class:`expertcache.costmodel.choose.Check`:
  "tie (within noise)" when the measured lead is inside the runs' spread, else agree / DISAGREE),
  among the policies admissible at ``--tolerance`` by their memory run's dNLL.

``python benchmarks/host_modes.py DIR [--tolerance NATS] [--json]``; prints one table per host mode
and the summary line per mode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from expertcache.costmodel.choose import Check, fastest  # noqa: E402
from expertcache.costmodel.runs import Run  # noqa: E402

HOSTS = ("memory", "mmap", "direct")


def load(folder: Path, host: str):
    cal = json.loads((folder / f"cal-{host}.json").read_text().splitlines()[0])
    cal = cal[0] if isinstance(cal, list) else cal
    runs = [json.loads(line) for line in (folder / f"eval-{host}.jsonl").read_text().splitlines() if line.strip()]
    return cal, {r["policy"]: r for r in runs}


def check_host(base: dict, runs: dict, tau: float, tolerance: float) -> Check:
    both = [Run(p, b["c_ms"], b["rho"], b["dnll"]) for p, b in base.items() if p in runs]
    ok = [r for r in both if r.dnll <= tolerance]
    predict = {r.policy: r.c_ms + r.rho * tau for r in both}
    predicted = fastest(ok, lambda r: predict[r.policy])  # choose's own tie-break (dnll, rho, name)
    measured = fastest(ok, lambda r: runs[r.policy]["ms_per_token"])
    rows = [{"policy": r.policy, "admissible": r in ok, "ms_predicted": predict[r.policy],
             "ms_measured": runs[r.policy]["ms_per_token"]} for r in both]
    taus = sorted(r["tau_ms"] for r in runs.values() if isinstance(r.get("tau_ms"), float) and r["tau_ms"] > 0)
    return Check(1, tau, taus[len(taus) // 2] if taus else None, predicted.policy, measured.policy, rows, [],
                 {r.policy: runs[r.policy].get("ms_per_token_spread") for r in both})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.1, help="largest admissible dNLL, nats (default 0.1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    _, base = load(args.folder, "memory")
    out = []
    for host in HOSTS:
        cal, runs = load(args.folder, host)
        c = check_host(base, runs, cal["tau_ms"], args.tolerance)
        out.append({"host": host, "tau_ms": cal["tau_ms"], "tau_ms_p10": cal["tau_ms_p10"],
                    "tau_ms_p90": cal["tau_ms_p90"], "tau_tiers": cal.get("tau_tiers"), **c.to_dict(),
                    "runs": {p: {k: r.get(k) for k in ("c_ms", "rho", "dnll", "ms_per_token", "ms_per_token_spread",
                                                       "tier_hits", "read_bytes_self", "repeats")}
                             for p, r in runs.items()}})
        if args.json:
            continue
        print(f"host {host}: tau {cal['tau_ms']:.3f} ms (p10 {cal['tau_ms_p10']:.3f}, p90 {cal['tau_ms_p90']:.3f}; "
              f"calibrate --host {host}); runs measured tau {c.tau_ms_measured if c.tau_ms_measured is None else round(c.tau_ms_measured, 3)} ms")
        print(f"  {'policy':<12} {'adm':>3} {'c ms':>8} {'rho':>6} {'dnll':>7} {'pred ms':>9} {'meas ms':>9} {'spread':>7}"
              f" {'pagecache':>9} {'device':>6} {'read MB':>8}")
        for r in c.rows:
            run, b = runs[r["policy"]], base[r["policy"]]
            t = run["tier_hits"]
            read = run.get("read_bytes_self")
            print(f"  {r['policy']:<12} {'yes' if r['admissible'] else 'no':>3} {b['c_ms']:8.1f} {b['rho']:6.3f} "
                  f"{b['dnll']:7.4f} {r['ms_predicted']:9.1f} {r['ms_measured']:9.1f} "
                  f"{100 * (run.get('ms_per_token_spread') or 0):6.1f}% {t['page_cache']:>9} {t['device']:>6} "
                  f"{'n/a' if read is None else f'{read / 1e6:.0f}':>8}")
        lead = c.lead
        print(f"  predicted {c.predicted}, measured {c.measured}: {c.verdict}"
              + (f" (lead {100 * lead:.1f}%, noise {100 * (c.noise or 0):.1f}%)" if lead is not None else "") + "\n")
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
