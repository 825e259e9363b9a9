#!/usr/bin/env python
"""The learned set controller against simple policies on a trained MoE of the repository (issues 13 and 25).

1. Training text: the training files of ``models/small-moe`` (tools/train_small_moe.py's corpus
   without its held-out files), cut to ``--train-kb``; the evaluation text is ``heldout_ids.npy``
   (held-out files only), so the heads never see it.
2. ``expertcache controller train`` with the differentiable objective, REINFORCE, and the priced
   variant (differentiable, copy penalty = exchange x tau with the paper's tau = 0.51 ms and
   e = 0.02, its "smooth control" setting), all at C = 8 on layers 0-3, seed 0.
3. One ``expertcache eval`` (decode mode, batch 1, C = 8 of 16 experts in all 4 layers, the first
   ``--sequences`` held-out rows of 128 tokens) of lru, belady (the oracle), dwell:1:8, dwell:2:16,
   dwell:4:32, dwell:16:64, prefix:32 and every controller at thresholds 0.4 .. 0.9, into
   runs.jsonl; then ``expertcache choose`` on it.
4. A table: policy, switch rate, refreshes/token/layer, copies/token (rho), dNLL, tokens/s; the
   choose frontier plot (frontier.png) and dNLL against copies/token (traffic.png).

Run (one thread; 40 steps per objective and 8 sequences take about 7 minutes on the shared
2-core machine)::

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/controller_frontier.py --out controller-out

At OLMoE's geometry (issue 25: ``models/olmoe-64x8``, C = 32 of 64 in all 8 layers, held-out rows
of its three domains, heads trained with several seeds; the table then adds each variant's mean
and sd over the seeds)::

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/controller_frontier.py --model models/olmoe-64x8 \
        -c 32 --layers 0-7 --seeds 0,1,2 --variants diff,rf --thresholds 0.5,0.7,0.9 --sequences 6 --out DIR
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
BASELINES = ["lru", "belady", "dwell:1:8", "dwell:2:16", "dwell:4:32", "dwell:16:64", "prefix:32"]


def cli(*argv: str, out: Path | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"expertcache {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    if out is not None:
        out.write_text(done.stdout)
    return done.stdout


def training_text(model: Path, path: Path, kb: int) -> dict:
    """The first ``kb`` KB of the model's training documents (never its held-out ones), written to ``path``.

    ``models/small-moe``: its corpus in order (tools/train_small_moe.py); ``models/olmoe-64x8``:
    its three domains (tools/train_olmoe64.py, rebuilt from the Debian packages) taken in turn, one
    document of each at a time, so the heads see docs, man pages and code alike."""
    sys.path.insert(0, str(REPO / "tools"))
    build = json.loads((model / "build.json").read_text())
    if (model / "heldout_rows.json").is_file():
        import train_olmoe64

        args = train_olmoe64.make_parser().parse_args([])
        train, heldout, info = train_olmoe64.build_corpus(args)
        counts = [d["files"] - d["heldout_files"] for d in info["domains"].values()]
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
        per = [train[a:b] for a, b in zip(bounds, bounds[1:])]
        docs = [d[i] for i in range(max(map(len, per))) for d in per if i < len(d)]
    else:
        from train_small_moe import build_corpus

        a = build["args"]
        docs, heldout, info = build_corpus(a["corpus_mb"], a["max_file_kb"], a["holdout_every"])
    taken, parts = 0, []
    for doc in docs:  # held-out files are not among them
        if taken >= kb * 1000:
            break
        parts.append(doc)
        taken += len(doc.encode("utf-8"))
    path.write_text("<|endoftext|>".join(parts), encoding="utf-8")
    return {"files": len(parts), "bytes": taken, "corpus_sha256": info["sha256"], "heldout_files": len(heldout)}


def eval_rows(model: Path, n: int, out: Path) -> Path:
    """The held-out rows eval reads: the first ``n`` (small-moe), or for a model with
    ``heldout_rows.json`` (olmoe-64x8) the first ``n / domains`` rows of each domain, written to ``out``."""
    import numpy as np

    ids = np.load(model / "heldout_ids.npy")
    meta = model / "heldout_rows.json"
    if not meta.is_file():
        np.save(out, ids[:n])
        return out
    rows = json.loads(meta.read_text())
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    each = max(n // len(domains), 1)
    np.save(out, ids[[r["row"] for d in domains for r in [x for x in rows if x["domain"] == d][:each]]])
    return out


def plot_traffic(records: list[dict], path: Path, prefix: str, model: str = "small-moe", C: str = "8") -> None:
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
            lines.setdefault(heads.removesuffix(".pt"), []).append((r["rho"], r["dnll"], thr))  # one line per heads file
        else:
            marker = "*" if r.get("needs_future") else "o"
            ax.plot(r["rho"], r["dnll"], marker, color="black", ms=8 if marker == "*" else 6)
            ax.annotate(name + (" (oracle)" if marker == "*" else ""), (r["rho"], r["dnll"]), textcoords="offset points",
                        xytext=(5, 4), fontsize=8)
    for heads, pts in lines.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-s", ms=4, label=f"controller {heads}, thr {pts[0][2]}..{pts[-1][2]}")
        ax.annotate(pts[0][2], (pts[0][0], pts[0][1]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xlabel("steady copies per token over the offloaded layers (rho)")
    ax.set_ylabel("dNLL (nats per token)")
    ax.set_title(f"{model}, C = {C}: traffic against quality", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(records: list[dict], out: str) -> list[str]:
    """Mean and sd over seeds of each controller variant and threshold (names ``VARIANT-sSEED.pt``)."""
    import statistics

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        name = r["policy"].replace(out + "/", "")
        if name.startswith("controller:"):
            heads, thr = name.removeprefix("controller:").rsplit(":", 1)
            groups.setdefault((heads.removesuffix(".pt").rsplit("-s", 1)[0], thr), []).append(r)
    lines = [f"{'controller':16} {'thr':>4} {'seeds':>5} {'copies/tok mean (sd)':>22} {'dNLL mean (sd)':>18} "
             f"{'dNLL min-max':>16}"]
    for (variant, thr), rs in sorted(groups.items()):
        rho, d = [r["rho"] for r in rs], [r["dnll"] for r in rs]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        lines.append(f"{variant:16} {thr:>4} {len(rs):5d} {statistics.mean(rho):12.3f} ({sd(rho):6.3f}) "
                     f"{statistics.mean(d):10.4f} ({sd(d):6.4f}) {min(d):+8.4f}..{max(d):+.4f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("controller-out"))
    ap.add_argument("--model", type=Path, default=MODEL, help="models/small-moe (default) or models/olmoe-64x8")
    ap.add_argument("--capacity", "-c", type=int, default=8)
    ap.add_argument("--layers", default="0-3", help="offloaded layers (default 0-3)")
    ap.add_argument("--seeds", default="0", help="training seeds of the heads, e.g. 0,1,2 (default 0)")
    ap.add_argument("--variants", default="diff,rf,priced", help="of diff, rf, priced")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--train-kb", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=0, help="eval --max-len (default: the rows' length)")
    ap.add_argument("--thresholds", default="0.4,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--tolerance", type=float, default=0.1)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, C = args.model.resolve(), str(args.capacity)
    seeds = [s.strip() for s in args.seeds.split(",") if s.strip()]
    t0 = time.perf_counter()
    text = args.out / "train.txt"
    info = training_text(model, text, args.train_kb)
    print(f"training text: {info['files']} training files of {model.name}'s corpus, {info['bytes']:,} bytes "
          f"(corpus sha256 {info['corpus_sha256'][:16]}; its {info['heldout_files']} held-out files, the eval text, excluded)")
    known = {
        "diff": ["--objective", "differentiable"],
        "rf": ["--objective", "reinforce"],
        "priced": ["--objective", "differentiable", "--price-tau", "0.51ms", "--exchange", "0.02"],
    }
    variants = {v: known[v] for v in args.variants.split(",")}
    heads = []
    for name, extra in variants.items():
        for seed in seeds:
            path = args.out / f"{name}-s{seed}.pt"
            rec = json.loads(cli("controller", "train", "--model", str(model), "--text", str(text), "--layers",
                                 args.layers, "-c", C, "--steps", str(args.steps), "--seed", seed, "--threads", "1",
                                 *extra, "--out", str(path), "--json"))
            heads.append(path)
            finals = ", ".join(f"{k.removeprefix('final_')} {v:.3f}" for k, v in rec.items() if k.startswith("final_"))
            print(f"trained {path.name}: {rec['objective']}, {rec['steps']} steps in {rec['seconds']:.0f}s, copy "
                  f"penalty {rec['copy_weight']:g} nats, {rec['bytes']:,} bytes; last 10 steps: {finals}", flush=True)
    thresholds = [t.strip() for t in args.thresholds.split(",")]
    policies = BASELINES + [f"controller:{h}:{t}" for h in heads for t in thresholds]
    runs = args.out / "runs.jsonl"
    rows = eval_rows(model, args.sequences, args.out / "rows.npy")
    argv = ["eval", "--model", str(model), "--tokens", str(rows), "-c", C, "--layers", args.layers, "--json"]
    if args.max_len:
        argv += ["--max-len", str(args.max_len)]
    for p in policies:
        argv += ["-p", p]
    cli(*argv, out=runs)
    records = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
    print(f"\neval: {records[0]['sequences']} held-out sequences, {records[0]['tokens']} tokens, decode mode, "
          f"C = {C} in layers {args.layers}; reference NLL {records[0]['nll_reference']:.4f}, "
          f"{records[0]['tokens_per_s_reference']:.0f} tok/s")
    header = f"{'policy':28} {'switch':>7} {'refr/tok':>8} {'copies/tok':>10} {'dNLL':>8} {'tok/s':>7}"
    print(header)
    print("-" * len(header))
    for r in records:
        name = r["policy"].replace(str(args.out) + "/", "")
        refr = r["refreshes"] / max(r["tokens"] * len(r["layers"]), 1)
        print(f"{name:28} {r['switch_rate']:7.3f} {refr:8.3f} {r['rho']:10.3f} {r['dnll']:8.4f} {r['tokens_per_s']:7.0f}")
    if len(seeds) > 1:
        print("\nover training seeds " + ", ".join(seeds) + ":")
        print("\n".join(summary(records, str(args.out))))
    plot_traffic(records, args.out / "traffic.png", str(args.out) + "/", model.name, C)
    print()
    print(cli("choose", str(runs), "--tolerance", str(args.tolerance), "--plot", str(args.out / "frontier.png")))
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
