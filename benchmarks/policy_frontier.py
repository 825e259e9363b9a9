"""The eviction paper's first question on the project's small trained MoE: does holding an expert set
fixed make decoding faster at matched quality? And does the cost model pick the measured winner?

On ``models/small-moe`` (a real OLMoE-class model trained here; see its README), teacher-forced
decoding of held-out text at capacity C, once per copy slow-down factor (``eval --slow-copies N``,
default 1, 10 and 50, as the paper did), for lossless rules (lru, decayed) and set-holding ones
(dwell, static; ``dwell:1:1`` is the exactness check), then ``expertcache choose`` over the runs:
the fastest admissible policy at the measured tau, the crossovers, the lossless rules added from
replay (belady, foresight:16), ``--validate`` (the predicted winner at N x tau against the
measured winner of the slowed runs) and the frontier plot.

Run: ``python benchmarks/policy_frontier.py [--out DIR] [--sequences 8] [--capacity 8]
[--tolerance 0.1] [--factors 1,10,50]``. Writes DIR/runs.jsonl, DIR/reference.npz,
DIR/frontier.png and prints every table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

from expertcache.cli.main import main as cli

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["lru", "decayed:0.9", "dwell:1:1", "dwell:4:32", "dwell:16:64", "prefix:32"]


def run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli([str(a) for a in argv])
    if code != 0:
        sys.exit(f"policy_frontier: {' '.join(map(str, argv))} exited {code}")
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "small-moe"))
    ap.add_argument("--out", default="frontier-out", help="folder for runs.jsonl, reference.npz, frontier.png")
    ap.add_argument("--sequences", type=int, default=8, help="held-out sequences of 128 tokens (default 8)")
    ap.add_argument("--capacity", type=int, default=8, help="slots per layer (default 8 of 16 experts)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="admissible dNLL, nats (default 0.1)")
    ap.add_argument("--factors", default="1,10,50", help="copy slow-down factors (default 1,10,50)")
    ap.add_argument("--policy", "-p", action="append", dest="policies", help=f"default: {' '.join(POLICIES)}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = Path(args.model) / "heldout_ids.npy"
    policies = args.policies or POLICIES
    runs = out / "runs.jsonl"
    lines = []
    t0 = time.perf_counter()
    for n in [int(f) for f in args.factors.split(",")]:
        argv = ["eval", "--model", args.model, "--tokens", tokens, "--max-sequences", args.sequences,
                "-c", args.capacity, "--slow-copies", n, "--json"]
        for p in policies:
            argv += ["-p", p]
        if n == 1:
            argv += ["--capture", out / "reference.npz"]
        records = [json.loads(line) for line in run(argv).splitlines()]
        print(f"slow-copies {n}: " + ", ".join(
            f"{r['policy']} dnll {r['dnll']:.4f} rho {r['rho']:.3f} switch {r['switch_rate']:.3f} "
            f"ms/token {r['ms_per_token']:.3f} tau {r['tau_ms']:.4f}" for r in records), flush=True)
        lines += [json.dumps(r) for r in records]
    runs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"\n{len(lines)} runs in {time.perf_counter() - t0:.0f} s -> {runs}\n")
    print(run(["choose", runs, "--tolerance", args.tolerance, "--add-replay", out / "reference.npz", "--validate",
               "--plot", out / "frontier.png"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
