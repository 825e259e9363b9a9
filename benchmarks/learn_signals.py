"""Model-side signals for learned eviction: an ablation on a real trained model (issue 12, items 1 and 6).

Captures ``models/small-moe`` (a trained OLMoE: 4 layers, E=16, top-2) teacher-forced over two text
domains it never trained on, with router probabilities and every signal (``record=
"token-ids,next-top:8,hidden:16"``):

* ``code``: the model's held-out files (every 20th file of its corpus: Python standard-library source
  and one license text), rebuilt with ``tools/train_small_moe.py``'s corpus code and the saved
  tokenizer; ``--sequences`` windows of ``--tokens`` ids evenly spaced over that stream;
* ``prose``: this repository's ``README.md`` and ``docs/*.md`` (English and markdown), same windows.

Then, per domain and capacity (per-layer pools), the learn protocol (docs/learn.md): 2 contiguous
sequence folds, ``decayed``'s beta tuned on the training folds, events from ``lru`` and ``decayed``
states on the training sequences (no DAgger round: findings.md measured none to matter), routing
tables fitted on the training sequences (two-fold for their own events), a scorer per seed, and
closed-loop replay of the held-out sequences. Events are collected once with every feature; each
ablation row trains on a subset of the columns (same events, same seeds). Rows: lru, tuned decayed,
the linear scorer on growing feature sets (reuse; + gate and router; + token tables; + next-token
expected demand; + hidden summary = every causal signal), the MLP on every causal signal, its
shuffled-label control, two non-causal diagnostics (``late``: the model's own next-token forecast one
row early; ``ahead``: the true input ids of the next 8 rows), foresight:1/2/4 and belady. The rows
marked ``[train-text tables]`` repeat three of them with the routing tables fitted instead on a
capture of ``--table-windows`` windows of the model's own *training* text (never an evaluated
sequence; more token ids seen than the 16 training sequences of a fold hold). Gap
recovered = ``(lru - p) / (lru - belady)`` in steady copies summed over the held-out sequences; mean
and sd over seeds.

Run: ``OMP_NUM_THREADS=1 nice -n 5 python benchmarks/learn_signals.py [--sequences 32 --tokens 128
--capacity 4,8 --seeds 0,1,2 --json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from expertcache.learn.dataset import concat, rule_events
from expertcache.scorer.models import fit
from expertcache.learn.protocol import FORESIGHT, folds_of, tune_beta
from expertcache.scorer.signals import FoldedTables, fit_folded, fit_tables
from expertcache.policies.learned import Learned
from expertcache.sim import build_layout, replay_layout

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "small-moe"
ALL = "reuse,gate,router,token,next,hidden,late,ahead"
CAUSAL = ("reuse", "gate", "router", "token", "next", "hidden")
SETS = [  # (row label, groups, kind)
    ("learned linear: reuse", ("reuse",), "linear"),
    ("+ gate, router", ("reuse", "gate", "router"), "linear"),
    ("+ token tables", ("reuse", "gate", "router", "token"), "linear"),
    ("+ next-token expected demand", ("reuse", "gate", "router", "token", "next"), "linear"),
    ("+ hidden summary (all causal)", CAUSAL, "linear"),
    ("learned mlp, all causal", CAUSAL, "mlp"),
    ("shuffled control (mlp, all causal)", CAUSAL, "mlp-shuffled"),
    ("diagnostic: + late (forecast one row early)", CAUSAL + ("late",), "linear"),
    ("diagnostic: + ahead (true next 8 input ids)", CAUSAL + ("ahead",), "linear"),
]
EXT = [(f"[train-text tables] {label}", groups, kind) for label, groups, kind in
       (SETS[4], SETS[7], SETS[8])]


def windows(stream: np.ndarray, rows: int, length: int) -> np.ndarray:
    starts = np.linspace(0, len(stream) - length, rows).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


def domain_ids(name: str, rows: int, length: int) -> np.ndarray:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    if name in ("code", "train"):
        sys.path.insert(0, str(REPO / "tools"))
        import train_small_moe as tsm

        build = json.loads((MODEL / "build.json").read_text())["args"]
        train, held, _ = tsm.build_corpus(build["corpus_mb"], build["max_file_kb"], build["holdout_every"])
        texts = held if name == "code" else train
    else:
        texts = [(REPO / "README.md").read_text()] + [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    eos = tok.eos_token_id
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    stream = np.concatenate([np.asarray(d + [eos], dtype=np.int64) for d in ids])
    return windows(stream, rows, length)


def capture(ids: np.ndarray):
    import torch
    from transformers import AutoModelForCausalLM

    import expertcache

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad(), expertcache.capture(model, phase="all", router_probs=True,
                                              record="token-ids,next-top:8,hidden:16") as cap:
        for row in ids:
            model(torch.as_tensor(row[None, :]))
    return cap.trace


def columns(names: tuple[str, ...], groups: tuple[str, ...]) -> np.ndarray:
    from expertcache.scorer.features import GROUPS

    want = {n for g in groups for n in GROUPS[g]}
    return np.array([i for i, n in enumerate(names) if n in want])


def ablation(trace, capacity: int, seeds: list[int], folds: int = 2, ext_tables=None) -> dict:
    steady = {}
    tokens = 0
    betas = []
    for held in folds_of(trace.num_sequences, folds):
        train_idx = np.setdiff1d(np.arange(trace.num_sequences), held)
        train, test = trace.select_sequences(train_idx.tolist()), trace.select_sequences(held.tolist())
        beta = tune_beta(train, capacity)
        betas.append(beta)
        layout = build_layout(test)
        tokens += layout.tokens
        rules = [("lru", "lru"), ("decayed (tuned)", f"decayed:{beta:g}"),
                 *((f"foresight:{h}", f"foresight:{h}") for h in FORESIGHT), ("belady", "belady")]
        for name, spec in rules:
            steady.setdefault(name, np.zeros(len(seeds)))
            steady[name] += replay_layout(layout, capacity, spec).copies_steady
        variants = [(fit_folded(train), SETS)]
        if ext_tables is not None:
            variants.append((FoldedTables(ext_tables, {}), EXT))
        for tables, sets in variants:
            _, parts = rule_events(train, capacity, ("lru", "decayed"), features=ALL, tables=tables)
            ev = concat(parts)
            for label, groups, kind in sets:
                cols = columns(ev.features, groups)
                names = tuple(ev.features[i] for i in cols)
                for si, seed in enumerate(seeds):
                    sc = fit(ev.X[:, cols], ev.victim, ev.offsets, names, kind=kind.split("-")[0], seed=seed,
                             shuffled=kind.endswith("shuffled"))
                    sc.tables = tables.full
                    r = replay_layout(layout, capacity, Learned(sc, label))
                    steady.setdefault(label, np.zeros(len(seeds)))[si] += r.copies_steady
    lru, bel = steady["lru"][0], steady["belady"][0]
    order = ["lru", "decayed (tuned)", *(s[0] for s in SETS), *(s[0] for s in EXT if s[0] in steady),
             *(f"foresight:{h}" for h in FORESIGHT), "belady"]
    rows = []
    for name in order:
        v = steady[name]
        gap = (lru - v) / (lru - bel)
        rows.append({"policy": name, "copies_steady": float(v.mean()), "copies_sd": float(v.std()),
                     "gap_recovered": float(gap.mean()), "gap_sd": float(gap.std()) if np.ptp(v) else 0.0})
    return {"capacity": capacity, "tokens": tokens, "betas": betas, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--capacity", default="4,8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--domains", default="code,prose")
    ap.add_argument("--table-windows", type=int, default=512,
                    help="windows of the training text whose capture fits the [train-text tables] rows (0: none)")
    ap.add_argument("--save-traces", metavar="DIR", default=None, help="also save the captured traces here")
    ap.add_argument("--json", metavar="OUT", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    caps = [int(c) for c in args.capacity.split(",")]
    results = []
    ext = None
    if args.table_windows:
        t0 = time.perf_counter()
        ext = fit_tables(capture(domain_ids("train", args.table_windows, args.tokens)))
        print(f"train-text tables: {args.table_windows} x {args.tokens} tokens, {ext.vocab.size} distinct ids, "
              f"{time.perf_counter() - t0:.0f} s")
    for dom in args.domains.split(","):
        t0 = time.perf_counter()
        trace = capture(domain_ids(dom, args.sequences, args.tokens))
        if args.save_traces:
            trace.save(Path(args.save_traces) / f"small_moe_{dom}.npz")
        t_cap = time.perf_counter() - t0
        for c in caps:
            t1 = time.perf_counter()
            res = ablation(trace, c, seeds, ext_tables=ext)
            res.update(domain=dom, sequences=trace.num_sequences, capture_s=round(t_cap, 1),
                       eval_s=round(time.perf_counter() - t1, 1))
            results.append(res)
            print(f"\n{dom}: {trace.num_sequences} x {args.tokens} tokens, C={c} per layer, betas {res['betas']}, "
                  f"held-out tokens {res['tokens']}, capture {t_cap:.0f} s, eval {res['eval_s']:.0f} s")
            for r in res["rows"]:
                sd = f" ± {r['gap_sd'] * 100:.1f}" if r["gap_sd"] > 1e-9 else ""
                print(f"  {r['policy']:<46} {r['copies_steady']:>9.1f}  {r['gap_recovered'] * 100:6.1f}{sd} %")
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
