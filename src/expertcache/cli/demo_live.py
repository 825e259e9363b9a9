"""The live part of ``expertcache demo``: set-holding against lossless rules on the small trained MoE,
and the policy the cost model chooses, checked against slowed copies.

Runs only where torch and transformers are installed and ``models/small-moe`` is beside the
checkout (the working directory's, or the source tree's); otherwise it says why it is skipped.
Two held-out sequences, capacity 8 of 16 experts per layer, copies at x1 and x50
(``eval --slow-copies``): about 15-30 s on a 2-core CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path



POLICIES = ("lru", "dwell:1:1", "dwell:4:32", "static:32")
FACTORS = (1, 50)
TOLERANCE = 0.15
CAPACITY = 8


def small_model() -> Path | None:
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        folder = root / "models" / "small-moe"
        if (folder / "config.json").is_file() and (folder / "heldout_ids.npy").is_file():
            return folder
    return None


def live_section() -> None:
    folder = small_model()
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing or folder is None:
        why = f"{' and '.join(missing)} not installed (pip install 'expertcache[hf]')" if missing else \
            "models/small-moe is not beside this checkout"
        print(f"\nlive part skipped: {why}")
        return
    from ..costmodel.choose import choose, validate
    from ..costmodel.runs import run_from_record
    from ..offload import evaluate, load_model
    from ..trace.npz import read_npy
    from .common import table

    model = load_model(folder, device="cpu")
    seqs = list(read_npy(folder / "heldout_ids.npy", "heldout_ids.npy")[:2])
    print(f"\nlive: {folder.name} (a small OLMoE-class model trained here), {len(seqs)} held-out sequences, "
          f"capacity {CAPACITY} of 16 experts per layer, copies at x{' and x'.join(map(str, FACTORS))}")
    records = []
    for n in FACTORS:
        ev = evaluate(model, seqs, CAPACITY, POLICIES, slow_copies=n)
        records += [r.to_dict() | {"needs_future": False} for r in ev.results]
    runs = [run_from_record(r, f"{r['policy']} x{r['slow_copies']}") for r in records]
    by = {(r["policy"], r["slow_copies"]): r for r in records}
    table([(p, by[p, 1]["dnll"], "lossless" if by[p, 1]["lossless"] else "set-holding", by[p, 1]["rho"], by[p, 1]["switch_rate"],
            *(by[p, n]["ms_per_token"] for n in FACTORS)) for p in POLICIES],
          ["policy", "dnll", "kind", "copies/token", "switch rate", *(f"ms/token x{n}" for n in FACTORS)])
    choice = choose([r for r in runs if r.slow_copies == 1], TOLERANCE)
    print(f"choose --tolerance {TOLERANCE}: tau {choice.tau_ms:.4f} ms measured; fastest admissible "
          f"{choice.winner.policy}; crossovers: "
          + (", ".join(f"{c.a} -> {c.b} at tau {c.tau_ms:.3g} ms" for c in choice.crossovers) or "none"))
    for check in validate(runs, TOLERANCE, choice.tau_ms):
        print(f"  at x{check.slow_copies}: predicted {check.predicted}, measured {check.measured}: "
              f"{'agree' if check.agree else 'DISAGREE'}")
    print("  (set-holding rules copy less and pay in NLL; which wins depends on tau: docs/choose.md)")

