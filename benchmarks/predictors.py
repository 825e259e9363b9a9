#!/usr/bin/env python
"""Recall of next-layer expert predictors on the trained models in models/ (issue 33, docs/llama.md
"Predicting the next layer's experts").

For each trained model (``models/small-moe``, ``models/olmoe-64x8``): the GGUF (f16, converted once
under --scratch), its held-out rows forwarded teacher-forced through llama.cpp with every row's
logits; the capture's recorder keeps each layer's routed experts and an observer keeps each layer's
``ffn_inp`` rows (the residual entering the layer's FFN). For every token ``t`` and consecutive MoE
layers ``j -> j+1``, each predictor names ``k`` experts of layer ``j+1`` from what is known once layer
``j`` has routed; recall = |predicted ∩ routed| / k, averaged over (token, layer) pairs of the
evaluated rows:

* ``lookahead``: layer ``j+1``'s router applied to layer ``j``'s ``ffn_inp`` row after layer
  ``j+1``'s FFN norm (the ``lookahead`` mode's rule, ``PageAdvisor.predict_rows``);
* ``previous-token``: the experts token ``t-1`` routed at layer ``j+1`` (none for a row's first token);
* ``co-activation``: the ``k`` experts of layer ``j+1`` most often routed together with this token's
  layer-``j`` experts, counted on the first half of the rows (train) and scored on the second half;
* ``co-activation+previous``: both tables' votes, the previous token's experts counted as one more
  co-activation vote each at the train split's mean vote weight.

Only the second half of the rows is scored for every predictor (the same pairs). Prints a table and,
with --doc, writes it between the predictors markers of docs/llama.md.

Run (a minute)::

    .venv/bin/python benchmarks/predictors.py --scratch /work/scratch --doc docs/llama.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

START, END = "<!-- predictors:start -->", "<!-- predictors:end -->"
MODELS = ("small-moe", "olmoe-64x8")


class Residuals:
    """Engine observer: each forward's ``ffn_inp-N`` rows, per layer (float32 ``[rows, H]``)."""

    prefixes = (b"ffn_inp-",)

    def __init__(self):
        self.rows: dict[int, list] = {}

    def begin(self, n_tokens, starts_sequence, all_logits) -> None:
        pass

    def wants(self, name: bytes) -> bool:
        from expertcache.llama.capture import layer_of

        return layer_of(name, self.prefixes) is not None

    def seen(self, name: bytes, ptr: int) -> None:
        from expertcache.llama.capture import layer_of
        from expertcache.llama.ggml import read_2d

        self.rows.setdefault(layer_of(name, self.prefixes), []).append(read_2d(ptr, np.float32).copy())


def forward_rows(gguf: Path, rows: np.ndarray):
    """Per row: experts ``[T, L, k]`` and ffn_inp residuals ``{layer: [T, H]}``."""
    from expertcache.llama.capture import RoutingRecorder
    from expertcache.llama.engine import Engine

    out = []
    with Engine(str(gguf), n_ctx=int(rows.shape[1]) + 1) as eng:
        g = eng.geometry
        for ids in rows:
            rec, res = RoutingRecorder(weights=False), Residuals()
            eng.attach(rec)
            eng.attach(res)
            eng.reset()
            eng.forward(ids, logits="all")
            eng.detach(rec)
            eng.detach(res)
            fe = rec.forwards[-1].experts
            experts = np.stack([fe[lid] for lid in g.moe_layers], axis=1)
            out.append((experts, {lid: np.concatenate(res.rows[lid]) for lid in g.moe_layers}))
    return g, out


def recall(pred: np.ndarray, actual: np.ndarray) -> float:
    """Mean over rows of |pred ∩ actual| / k (``[n, k]`` each)."""
    hits = (pred[:, :, None] == actual[:, None, :]).any(axis=2).sum(axis=1)
    return float(np.mean(hits / actual.shape[1]))


def study(name: str, scratch: Path) -> dict:
    from expertcache.llama.advice import PageAdvisor
    from expertcache.llama.convert import convert

    src = REPO / "models" / name
    gguf = scratch / f"{name}-f16.gguf"
    if not gguf.exists():
        convert(src, gguf, "f16")
    rows = np.load(src / "heldout_ids.npy")
    g, seqs = forward_rows(gguf, rows)
    E, k, L = g.num_experts, g.top_k, len(g.moe_layers)
    half = len(seqs) // 2
    co = np.zeros((L - 1, E, E), dtype=np.float64)
    for experts, _ in seqs[:half]:
        for j in range(L - 1):
            np.add.at(co[j], (np.repeat(experts[:, j], k, axis=1).ravel(), np.tile(experts[:, j + 1], (1, k)).ravel()), 1)
    vote = float(co.sum() / max(1, np.count_nonzero(co)))  # the mean weight of a co-activation vote
    adv = PageAdvisor(g, "lookahead")
    try:
        preds: dict[str, list] = {p: [] for p in ("lookahead", "previous-token", "co-activation", "co-activation+previous")}
        actual_all, actual_prev = [], []
        for experts, res in seqs[half:]:
            for j in range(L - 1):
                nxt = g.moe_layers[j + 1]
                actual = experts[:, j + 1]
                actual_all.append(actual)
                preds["lookahead"].append(adv.predict_rows(nxt, res[g.moe_layers[j]]))
                scores = co[j][experts[:, j]].sum(axis=1)  # [T, E]
                preds["co-activation"].append(np.argsort(-scores, axis=1, kind="stable")[:, :k])
                prev = np.vstack([np.full((1, k), -1), experts[:-1, j + 1]])
                preds["previous-token"].append(prev)
                actual_prev.append(np.arange(len(actual)) > 0)
                both = scores.copy()
                np.add.at(both, (np.repeat(np.arange(len(actual))[1:], k), prev[1:].ravel()), vote * k)
                preds["co-activation+previous"].append(np.argsort(-both, axis=1, kind="stable")[:, :k])
    finally:
        adv.close()
    actual = np.concatenate(actual_all)
    has_prev = np.concatenate(actual_prev)
    out = {"model": name, "num_experts": E, "top_k": k, "moe_layers": L, "rows": len(seqs), "scored_rows": len(seqs) - half,
           "pairs": int(actual.shape[0]), "recall": {}}
    for p, parts in preds.items():
        pred = np.concatenate(parts)
        mask = has_prev if p == "previous-token" else np.ones(len(actual), bool)
        out["recall"][p] = recall(pred[mask], actual[mask])
    # what picking k of E at random recalls: k / E
    out["recall"]["random"] = k / E
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", default="/work/scratch", help="folder for the GGUFs (outside the repository)")
    ap.add_argument("--doc", default=None, help="write the table between the predictors markers of this file")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    results = [study(m, Path(args.scratch)) for m in MODELS if (REPO / "models" / m / "config.json").is_file()]
    names = ["lookahead", "previous-token", "co-activation", "co-activation+previous", "random"]
    lines = [START, f"Measured {time.strftime('%Y-%m-%d', time.gmtime())} with `benchmarks/predictors.py` "
             f"({time.time() - t0:.0f} s): recall of the k experts each predictor names for layer j+1 once layer j "
             "has routed, over every (token, consecutive MoE layer pair) of the second half of each model's held-out "
             "rows (co-activation counted on the first half).", "",
             "| model | E, k, MoE layers | pairs | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for r in results:
        lines.append(f"| {r['model']} | {r['num_experts']}, {r['top_k']}, {r['moe_layers']} | {r['pairs']} | " +
                     " | ".join(f"{r['recall'][n]:.3f}" for n in names) + " |")
    lines.append(END)
    block = "\n".join(lines)
    print(block)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.doc:
        doc = Path(args.doc)
        text = doc.read_text()
        if START in text and END in text:
            text = text[: text.index(START)] + block + text[text.index(END) + len(END):]
        else:
            text += "\n" + block + "\n"
        doc.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
