#!/usr/bin/env python
"""The learned set controller against simple policies on the small trained MoE (issue 13, item 1).

1. Training text: the training files of ``models/small-moe`` (tools/train_small_moe.py's corpus
   without its held-out files), cut to ``--train-kb``; the evaluation text is ``heldout_ids.npy``
   (held-out files only), so the heads never see it.
2. ``expertcache controller train`` with the differentiable objective, REINFORCE, and the priced
   variant (differentiable, copy penalty = exchange x tau with the paper's tau = 0.51 ms and
   e = 0.02, its "smooth control" setting), all at C = 8 on layers 0-3, seed 0.
3. One ``expertcache eval`` (decode mode, batch 1, C = 8 of 16 experts in all 4 layers, the first
   ``--sequences`` held-out rows of 128 tokens) of lru, belady (the oracle), dwell:1:8, dwell:2:16,
   dwell:4:32, dwell:16:64, static:32 and every controller at thresholds 0.4 .. 0.9, into
   runs.jsonl; then ``expertcache choose`` on it.
4. A table: policy, switch rate, refreshes/token/layer, copies/token (rho), dNLL, tokens/s; the
   choose frontier plot (frontier.png) and dNLL against copies/token (traffic.png).

Run (one thread; 40 steps per objective and 8 sequences take about 7 minutes on the shared
2-core machine)::

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/controller_frontier.py --out controller-out
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "small-moe"
BASELINES = ["lru", "belady", "dwell:1:8", "dwell:2:16", "dwell:4:32", "dwell:16:64", "static:32"]


def cli(*argv: str, out: Path | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"expertcache {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    if out is not None:
        out.write_text(done.stdout)
    return done.stdout


def training_text(path: Path, kb: int) -> dict:
    sys.path.insert(0, str(REPO / "tools"))
    from train_small_moe import build_corpus

    build = json.loads((MODEL / "build.json").read_text())["args"]
    train, heldout, info = build_corpus(build["corpus_mb"], build["max_file_kb"], build["holdout_every"])
    taken, parts = 0, []
    for doc in train:  # in corpus order; held-out files are not in `train`
        if taken >= kb * 1000:
            break
        parts.append(doc)
        taken += len(doc.encode("utf-8"))
    path.write_text("<|endoftext|>".join(parts), encoding="utf-8")
    return {"files": len(parts), "bytes": taken, "corpus_sha256": info["sha256"], "heldout_files": len(heldout)}


def plot_traffic(records: list[dict], path: Path, prefix: str) -> None:
    """dNLL against copies/token: one line per controller across its thresholds, a point per simple policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    lines: dict[str, list] = {}
    for r in records:
        name = r["policy"].replace(prefix, "")
        if name.startswith("controller:"):
            heads, thr = name.removeprefix("controller:").rsplit(":", 1)
            lines.setdefault(heads.removesuffix(".pt"), []).append((r["rho"], r["dnll"], thr))
        else:
            marker = "*" if r.get("needs_future") else "o"
            ax.plot(r["rho"], r["dnll"], marker, color="black", ms=8 if marker == "*" else 6)
            ax.annotate(name + (" (oracle)" if marker == "*" else ""), (r["rho"], r["dnll"]), textcoords="offset points",
                        xytext=(5, 4), fontsize=8)
    for heads, pts in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-s", ms=4, label=f"controller {heads}, thr {pts[0][2]}..{pts[-1][2]}")
        ax.annotate(pts[0][2], (pts[0][0], pts[0][1]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xlabel("steady copies per token over the 4 offloaded layers (rho)")
    ax.set_ylabel("dNLL (nats per token)")
    ax.set_title("small-moe, C = 8 of 16: traffic against quality", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("controller-out"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--train-kb", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--thresholds", default="0.4,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--tolerance", type=float, default=0.1)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    text = args.out / "train.txt"
    info = training_text(text, args.train_kb)
    print(f"training text: {info['files']} training files of the small model's corpus, {info['bytes']:,} bytes "
          f"(corpus sha256 {info['corpus_sha256'][:16]}; its {info['heldout_files']} held-out files, the eval text, excluded)")
    variants = {
        "diff": ["--objective", "differentiable"],
        "rf": ["--objective", "reinforce"],
        "priced": ["--objective", "differentiable", "--price-tau", "0.51ms", "--exchange", "0.02"],
    }
    for name, extra in variants.items():
        rec = json.loads(cli("controller", "train", "--model", str(MODEL), "--text", str(text), "--layers", "0-3",
                             "-c", "8", "--steps", str(args.steps), "--seed", "0", "--threads", "1", *extra,
                             "--out", str(args.out / f"{name}.pt"), "--json"))
        finals = ", ".join(f"{k.removeprefix('final_')} {v:.3f}" for k, v in rec.items() if k.startswith("final_"))
        print(f"trained {name}: {rec['objective']}, {rec['steps']} steps in {rec['seconds']:.0f}s, copy penalty "
              f"{rec['copy_weight']:g} nats, {rec['bytes']:,} bytes; last 10 steps: {finals}")
    thresholds = [t.strip() for t in args.thresholds.split(",")]
    policies = BASELINES + [f"controller:{args.out / name}.pt:{t}" for name in variants for t in thresholds]
    runs = args.out / "runs.jsonl"
    argv = ["eval", "--model", str(MODEL), "--tokens", str(MODEL / "heldout_ids.npy"), "--max-sequences",
            str(args.sequences), "-c", "8", "--layers", "0-3", "--json"]
    for p in policies:
        argv += ["-p", p]
    cli(*argv, out=runs)
    records = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
    print(f"\neval: {records[0]['sequences']} held-out sequences, {records[0]['tokens']} tokens, decode mode, C = 8 of 16 "
          f"in layers 0-3; reference NLL {records[0]['nll_reference']:.4f}, {records[0]['tokens_per_s_reference']:.0f} tok/s")
    header = f"{'policy':28} {'switch':>7} {'refr/tok':>8} {'copies/tok':>10} {'dNLL':>8} {'tok/s':>7}"
    print(header)
    print("-" * len(header))
    for r in records:
        name = r["policy"].replace(str(args.out) + "/", "")
        refr = r["refreshes"] / max(r["tokens"] * len(r["layers"]), 1)
        print(f"{name:28} {r['switch_rate']:7.3f} {refr:8.3f} {r['rho']:10.3f} {r['dnll']:8.4f} {r['tokens_per_s']:7.0f}")
    plot_traffic(records, args.out / "traffic.png", str(args.out) + "/")
    print()
    print(cli("choose", str(runs), "--tolerance", str(args.tolerance), "--plot", str(args.out / "frontier.png")))
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
