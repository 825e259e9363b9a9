"""Reproduce the tiering paper's section 3 (policy under fair windows) on the synthetic presets and
the shared real traces: hit rate against budget for LRU, LFU, static (same- and off-domain) and
Belady, per-layer and global pools, warm on the first 60% of each stream, scored on the rest.

    .venv/bin/python benchmarks/section3.py [--plots docs/img] [--json]

Domains: each sequence of a preset is one domain (the presets model the paper's four domains as
four sequences, calibrated to its domain Jaccard); "same-domain" static profiles each stream's own
warm window, "off-domain" static profiles the whole next domain (sequence d+1, cyclically; for the
one-sequence Mixtral HumanEval trace, the other Mixtral trace). Budgets are in experts per layer
(the paper's B) and in GB over all layers for the models whose expert size is known.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import expertcache as ec
from expertcache.policies import make_policy
from expertcache.sim import build_layout, replay_layout
from expertcache.trace.synth import PRESETS, synthesize

WARM = 0.6
SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"

# bytes of one expert: Kimi-K3 1.45 TB / 82,432 experts (the paper's int4 pool: 17.5 MB); Qwen3-30B-A3B
# 17.6 GB / (48 x 128) (the paper's figure); DeepSeek-V3 3 x 7168 x 2048 weights at fp8; Mixtral-8x7B
# 3 x 4096 x 14336 weights at bf16.
EXPERT_BYTES = {"kimi-k3": 17_500_000, "qwen3-30b-a3b": 2_864_583, "deepseek-v3": 44_040_192,
                "mixtral-8x7b-humaneval": 352_321_536, "mixtral-8x7b-inferred-align": 352_321_536}
BUDGETS = (8, 16, 32, 64, 128, 256)


def hit(trace, capacity, policy, pool="layer"):
    layout = build_layout(trace, pool=pool, warm=WARM)
    return replay_layout(layout, capacity, make_policy(policy) if isinstance(policy, str) else policy)


def off_domain_static(trace, capacity, pool, profile_of):
    """Static with every domain profiled on another one; counts summed over the domains."""
    req = miss = 0
    for d in range(trace.num_sequences):
        part = trace.select_sequences([d])
        p = make_policy("static").use_profile(profile_of(d))
        r = replay_layout(build_layout(part, pool=pool, warm=WARM), capacity, p)
        req, miss = req + r.requests, miss + r.copies_total
    return 1 - miss / req


def study(name, trace, profile_of):
    E, L, k = trace.num_experts, trace.num_layers, int(np.count_nonzero(trace.experts[0, 0] >= 0))
    rows = []
    for B in ([b for b in BUDGETS if b < E] if E > 8 else [2, 4, 6]):
        row = {"model": name, "E": E, "k": k, "L": L, "B": B}
        S = EXPERT_BYTES.get(name)
        row["budget_gb"] = B * L * S / 1e9 if S else None
        for pool, cap in (("layer", B), ("global", B * L)):
            for pol in ("lru", "lfu", "static", "belady"):
                if pol != "static" and cap < trace.top_k:
                    row[f"{pool}:{pol}"] = None
                    continue
                row[f"{pool}:{pol}"] = hit(trace, cap, pol, pool).hit_rate
            row[f"{pool}:static-off"] = off_domain_static(trace, cap, pool, profile_of)
        rows.append(row)
    return rows


def traces():
    for preset in ("qwen3-30b-a3b", "deepseek-v3", "kimi-k3"):
        t = synthesize(PRESETS[preset].params, 0, preset=preset)
        S = t.num_sequences
        yield preset, t, (lambda d, t=t, S=S: t.select_sequences([(d + 1) % S]))
    if SHARED.is_dir():
        humaneval = ec.load_trace(SHARED / "mixtral-8x7b-humaneval")
        align = ec.load_trace(SHARED / "mixtral-8x7b-inferred-align")
        yield "mixtral-8x7b-humaneval", humaneval, (lambda d: align)
        for name in ("mixtral-8x7b-inferred-align", "flame-moe-290m-teacher-forced"):
            t = ec.load_trace(SHARED / name)
            S = t.num_sequences
            yield name, t, (lambda d, t=t, S=S: t.select_sequences([(d + 1) % S]))
    else:
        print(f"note: {SHARED} not found; real traces skipped", file=sys.stderr)


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def markdown(rows):
    head = ("| model | B/layer | GB (all layers) | LRU | LFU | static | static off-domain | Belady | LRU/Belady "
            "| global LRU | global static | global Belady | global-layer LRU (pp) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lru, bel = r["layer:lru"], r["layer:belady"]
        share = f"{lru / bel:.2f}" if lru is not None and bel else "-"
        diff = (f"{100 * (r['global:lru'] - lru):+.1f}" if lru is not None and r["global:lru"] is not None else "-")
        gb = "-" if r["budget_gb"] is None else f"{r['budget_gb']:.4g}"
        out.append(f"| {r['model']} | {r['B']} | {gb} | {pct(lru)} | {pct(r['layer:lfu'])} | {pct(r['layer:static'])} "
                   f"| {pct(r['layer:static-off'])} | {pct(bel)} | {share} | {pct(r['global:lru'])} "
                   f"| {pct(r['global:static'])} | {pct(r['global:belady'])} | {diff} |")
    return "\n".join(out)


def plot(rows, folder: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = (len(models) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7.6), squeeze=False)
    for ax in axes.ravel()[len(models):]:
        ax.set_visible(False)
    for ax, m in zip(axes.ravel(), models):
        rs = [r for r in rows if r["model"] == m]
        x = [r["budget_gb"] or r["B"] for r in rs]
        for key, label, style in (("layer:lru", "LRU", "-o"), ("layer:lfu", "LFU", "-s"), ("layer:static", "static", "-^"),
                                  ("layer:static-off", "static off-domain", ":^"), ("layer:belady", "Belady (future)", "--"),
                                  ("global:lru", "LRU global", ":o")):
            ys = [None if r[key] is None else 100 * r[key] for r in rs]
            ax.plot(x, [np.nan if y is None else y for y in ys], style, label=label, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("budget, GB over all layers" if rs[0]["budget_gb"] else "budget, experts per layer")
        ax.set_ylabel("hit rate (% of scored requests)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if len(models) > 1:
        axes[0][1].legend(fontsize=7)
    fig.suptitle("Hit rate against budget, fair windows (warm 60%, scored 40%)", fontsize=10)
    fig.tight_layout()
    path = folder / "section3-hit-vs-budget.png"
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plots", default=None, help="folder for section3-hit-vs-budget.png")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for name, trace, profile_of in traces():
        rows += study(name, trace, profile_of)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(markdown(rows))
    if args.plots:
        print(f"wrote {plot(rows, Path(args.plots))}", file=sys.stderr)
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
