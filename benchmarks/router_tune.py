"""The eviction paper's Table 3 on the project's small trained MoE: does a router fine-tuned for
cache hits (GRPO on a simulated LRU hit rate) copy fewer experts than the base model, and does it
beat changing the eviction rule instead?

Capacities. The paper trains at 16 slots of 64 experts, top-8 (C/E = 1/4, C/k = 2) and measures at
C = 32 on 8 layers (C/E = 1/2, C/k = 4). ``models/small-moe`` has 16 experts, top-2, so 16 slots
would hold every expert (nothing to gain); the same ratios give C = 4 for training (4/16, 4/2) and
C = 8 on all 4 layers for the main operating point (8/16, 8/2).

Steps (one thread, run it under ``nice``):

1. prompts: the model's own training split (``tools/train_small_moe.build_corpus``), every 20th
   training file, written to OUT/prompts.txt;
2. ``expertcache router-tune`` at ``--layer 2 --cache 4``: GRPO, the SFT control (same steps, same
   prompts, same seed), GRPO with the cache-size tag (``--variants grpo-lora``: rank-8 LoRA on the
   layer's router, expert and attention projections, merged, as the paper);
3. the training instrument on held-out prompts (windows of ``heldout_ids.npy``), the same seed for
   every model: mean simulated LRU hit rate of their own generations at layer 2, C = 4; and the
   expert load per layer on the held-out text (effective experts = 2 ** entropy of the shares);
   The same capture, replayed one row at a time, gives every model's steady copies per row
   (lru and decayed at the main capacity): each tuned model's change against base comes with a
   95 % paired bootstrap interval over the rows (2,000 resamples);
4. ``expertcache eval`` on ``heldout_ids.npy`` (16 x 128, teacher-forced) for base and each tuned
   model, ``-p lru -p decayed``: at C = 8 on all layers (main) and at C = 4 on layer 2 alone (the
   training setting). The tagged model is evaluated with its tag in front of every row, so its
   NLL covers other tokens (not comparable, as in the paper).

Run: ``OMP_NUM_THREADS=1 nice -n 5 python benchmarks/router_tune.py [--out DIR] [--steps 200]``.
Writes DIR/results.json and prints the Table 3 analogue.

At OLMoE's geometry (issue 25: ``models/olmoe-64x8``, 64 experts, top-8, 8 layers) the paper's own
capacities apply as they are: training at 16 slots on a middle layer (4), measuring at C = 32 on all
8 layers. Prompts are the model's training documents (its three domains in turn, as
``controller_frontier.py`` draws them); the held-out rows are ``--sequences`` rows of
``heldout_ids.npy``, the same number from each domain::

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/router_tune.py --model models/olmoe-64x8 --layer 4 \
        --train-cache 16 --main-cache 32 --sequences 18 --lr 1e-3 --variants grpo,sft,grpo+lb,sft+lb --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from controller_frontier import eval_rows, training_text  # noqa: E402
from policy_frontier import run as cli_out  # noqa: E402  (runs one CLI command, exits on failure)
from expertcache.hf.loading import load_model  # noqa: E402
from expertcache.routetune import TuneConfig, cache_tag  # noqa: E402
from expertcache.routetune.grpo import simulated_hit_rate  # noqa: E402
from expertcache.routetune.rollout import make_prompts  # noqa: E402

MODEL = ROOT / "models" / "small-moe"
VARIANTS = {"grpo": [], "sft": ["--sft-control"], "grpo+tag": ["--cache-tag"],
            "grpo-lora": ["--lora-rank", "8", "--lora-targets", "router,experts,attention"],
            "grpo+lb": ["--balance", "{balance}"], "sft+lb": ["--sft-control", "--balance", "{balance}"]}
"""``+lb``: the load-collapse control, the tuned layer's load-balancing loss kept in the objective
with weight ``--balance`` (default: the model's own ``router_aux_loss_coef``, 0.01 for small-moe)."""
DEFAULT_VARIANTS = "grpo,sft,grpo+tag"


def write_prompts(path: Path, model: Path) -> None:
    """small-moe: every 20th training file; a model with ``heldout_rows.json`` (olmoe-64x8): its first
    600 KB of training documents, the domains in turn (never a held-out document)."""
    if (model / "heldout_rows.json").is_file():
        training_text(model, path, 600)
        return
    from train_small_moe import build_corpus

    train, _, _ = build_corpus(6.0, 128, 20)
    path.write_text("\n".join(train[::20]), encoding="utf-8")


def tagged_heldout(out: Path, capacity: int, model: Path, heldout: Path) -> Path:
    from transformers import AutoTokenizer

    tag = AutoTokenizer.from_pretrained(str(model))(cache_tag(capacity), add_special_tokens=False)["input_ids"]
    ids = np.load(heldout)
    path = out / "heldout_tagged.npy"
    np.save(path, np.concatenate([np.broadcast_to(np.asarray(tag, dtype=ids.dtype), (ids.shape[0], len(tag))), ids], 1))
    return path


def captured(model, heldout: Path):
    """A teacher-forced capture of the held-out rows through ``model`` (one sequence per row)."""
    from expertcache import capture

    ids = torch.from_numpy(np.load(heldout).astype(np.int64))
    with torch.no_grad(), capture(model, phase="all") as cap:
        for row in ids:
            model(row[None])
    if cap.trace.num_sequences != ids.shape[0]:
        raise SystemExit(f"capture: {cap.trace.num_sequences} sequences for {ids.shape[0]} rows")
    return cap.trace


def expert_load(trace) -> list[dict]:
    """Per layer, on the held-out rows (teacher-forced): effective experts = 2 ** entropy (bits) of
    the experts' shares of the selections, and the share of the 4 most used."""
    out = []
    for layer in range(trace.num_layers):
        share = np.bincount(trace.experts[:, layer].ravel(), minlength=trace.num_experts) / trace.experts[:, layer].size
        nz = share[share > 0]
        out.append({"effective_experts": float(2 ** -(nz * np.log2(nz)).sum()), "top4_share": float(np.sort(share)[-4:].sum())})
    return out


def row_copies(trace, capacity: int, policies=("lru", "decayed")) -> dict[str, list[int]]:
    """Steady copies of each held-out row (pools empty at each row) at ``capacity`` on every layer,
    per policy: the capture replayed one row at a time. Routing does not depend on the cache under
    these lossless rules, so the rows' sum is the teacher-forced count of the whole set."""
    import expertcache as ec

    rows = [trace.select_sequences([s]) for s in range(trace.num_sequences)]
    return {p: [int(ec.replay(r, capacity, p).copies_steady) for r in rows] for p in policies}


def change_ci(tuned, base, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """``sum(tuned) / sum(base) - 1`` over the rows and its paired percentile interval: one resample
    draws the rows with replacement and takes both models' sums on the same rows (expertcache._resample)."""
    from expertcache._resample import draws, percentile_interval

    t, b = np.asarray(tuned, dtype=np.float64), np.asarray(base, dtype=np.float64)
    idx = draws(t.size, resamples, seed)
    ratios = t[idx].sum(axis=1) / b[idx].sum(axis=1) - 1.0
    return {"change": float(t.sum() / b.sum() - 1.0), "ci": percentile_interval(ratios, level), "rows": int(t.size),
            "resamples": int(resamples)}


def evaluate(model: Path, tokens: Path, capacity: int, layers: str | None, mode: str) -> dict:
    argv = ["eval", "--model", model, "--tokens", tokens, "-c", capacity, "-p", "lru", "-p", "decayed",
            "--max-len", 1024, "--mode", mode, "--json"]
    if layers:
        argv += ["--layers", layers]
    return {r["policy"].split(":")[0]: r for r in map(json.loads, cli_out(argv).splitlines())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="router-tune-out")
    ap.add_argument("--model", type=Path, default=MODEL, help="models/small-moe (default) or models/olmoe-64x8")
    ap.add_argument("--sequences", type=int, default=16, help="held-out rows evaluated (default 16)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", default="5e-3")
    ap.add_argument("--kl", default="0.04")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--train-cache", type=int, default=4)
    ap.add_argument("--main-cache", type=int, default=8)
    ap.add_argument("--mode", choices=("decode", "forward"), default="decode")
    ap.add_argument("--probe-prompts", type=int, default=32)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--seed", type=int, default=0, help="router-tune's seed (sampling and init; default 0)")
    ap.add_argument("--balance", type=float, default=None,
                    help="weight of the load-balancing loss of the +lb variants (default: the model's router_aux_loss_coef)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts_txt = out / "prompts.txt"
    if not prompts_txt.is_file():
        write_prompts(prompts_txt, args.model)
    heldout = eval_rows(args.model, args.sequences, out / "heldout_rows.npy")
    if args.balance is None:
        args.balance = float(json.loads((args.model / "config.json").read_text()).get("router_aux_loss_coef", 0.01))
    models = {"base": args.model}
    results: dict = {"args": vars(args), "train": {}, "probe": {}, "main": {}, "trained_setting": {}}
    for name in args.variants.split(","):
        folder = out / name.replace("+", "_")
        if folder.exists():
            shutil.rmtree(folder)
        t0 = time.perf_counter()
        line = cli_out(["router-tune", "--model", args.model, "--text", prompts_txt, "--layer", args.layer,
                        "--cache", args.train_cache, "--steps", args.steps, "--group", args.group,
                        "--max-new-tokens", args.max_new_tokens, "--lr", args.lr, "--kl", args.kl,
                        *[a.format(balance=args.balance) for a in VARIANTS[name]], "--seed", args.seed, "--out", folder,
                        "--json"])
        results["train"][name] = json.loads(line) | {"wall_s": time.perf_counter() - t0}
        models[name] = folder
        print(f"trained {name}: {results['train'][name]}", flush=True)

    # the training instrument: simulated hit rate on each model's own generations, held-out prompts
    stream = np.load(heldout).ravel()
    probe = TuneConfig(layer=args.layer, cache=args.train_cache, group=args.group, max_new_tokens=args.max_new_tokens)
    from transformers import AutoTokenizer

    tag = AutoTokenizer.from_pretrained(str(args.model))(cache_tag(args.train_cache), add_special_tokens=False)["input_ids"]
    for name, folder in models.items():
        prompts = make_prompts(stream, 1, args.probe_prompts, 16, 12345, tag if name == "grpo+tag" else None)[0]
        model = load_model(str(folder), device="cpu").float()
        results["probe"][name] = simulated_hit_rate(model, prompts, probe, seed=12345)
        print(f"simulated hit rate {name}: {results['probe'][name]:.4f}", flush=True)
        trace = captured(model, heldout)
        results.setdefault("load", {})[name] = expert_load(trace)
        results.setdefault("rows", {})[name] = row_copies(trace, args.main_cache)
        print(f"expert load {name}: " + "; ".join(f"layer {i}: {d['effective_experts']:.1f} effective, top-4 share "
                                                  f"{d['top4_share']:.2f}" for i, d in enumerate(results["load"][name])))

    tagged = tagged_heldout(out, args.train_cache, args.model, heldout) if "grpo+tag" in models else None
    for name, folder in models.items():
        tokens = tagged if name == "grpo+tag" else heldout
        results["main"][name] = evaluate(folder, tokens, args.main_cache, None, args.mode)
        results["trained_setting"][name] = evaluate(folder, tokens, args.train_cache, str(args.layer), args.mode)
        print(f"evaluated {name}", flush=True)
    results["row_change"] = row_changes(results["rows"])
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    report(results, args)


CONTROLS = {"grpo": "sft", "grpo+lb": "sft+lb"}
"""Each GRPO variant's matched control: the same steps, prompts and seed without the cache reward."""


def row_changes(rows: dict) -> dict:
    """Per tuned model and policy: the change of its teacher-forced steady copies against base's,
    with the paired interval over held-out rows (:func:`change_ci`); and ``"X vs Y"`` for each GRPO
    variant against its control (:data:`CONTROLS`), when both ran: what the reward itself changes."""
    out = {name: {p: change_ci(r[p], rows["base"][p]) for p in r} for name, r in rows.items() if name != "base"}
    for tuned, control in CONTROLS.items():
        if tuned in rows and control in rows:
            out[f"{tuned} vs {control}"] = {p: change_ci(rows[tuned][p], rows[control][p]) for p in rows[tuned]}
    return out
    return 0


def report(results: dict, args) -> None:
    base_nll = results["main"]["base"]["lru"]["nll_reference"]
    m = results["main"]["base"]["lru"]
    print(f"\nTable 3 analogue: {args.model.name}, held-out {m.get('sequences')} sequences, {m.get('tokens')} tokens, "
          f"teacher-forced ({args.mode}); main = C={args.main_cache} on every layer, trained = C={args.train_cache} at layer "
          f"{args.layer}; steady copies (lower is better)")
    head = ("objective", "NLL", "dNLL vs base", "sim. hit (own gen.)", "lru steady", "lru copies/tok", "lru hit",
            "decayed steady", "decayed copies/tok", "trained lru steady", "trained decayed steady", "lru tok/s")
    rows = []
    for name in results["main"]:
        m, t = results["main"][name], results["trained_setting"][name]
        nll = m["lru"]["nll_reference"]
        rows.append((name, f"{nll:.4f}", "n/c (tag scored)" if name == "grpo+tag" else f"{nll - base_nll:+.4f}",
                     f"{results['probe'][name]:.4f}", m["lru"]["copies_steady"], f"{m['lru']['copies_per_token']:.4f}",
                     f"{m['lru']['hit_rate']:.4f}", m["decayed"]["copies_steady"],
                     f"{m['decayed']['copies_per_token']:.4f}", t["lru"]["copies_steady"], t["decayed"]["copies_steady"],
                     f"{m['lru']['tokens_per_s']:.1f}"))
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(str(h).ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    b = results["main"]["base"]
    for name in results["main"]:
        m = results["main"][name]
        print(f"{name}: lru steady {m['lru']['copies_steady']} ({m['lru']['copies_steady'] / b['lru']['copies_steady'] - 1:+.2%} "
              f"vs base); decayed removes {1 - m['decayed']['copies_steady'] / m['lru']['copies_steady']:.1%} of its lru copies")
    for name, per in results.get("row_change", {}).items():
        print(f"{name}, teacher-forced capture, {per['lru']['rows']} rows: lru steady copies "
              + "; ".join(f"{p} {c['change']:+.2%} [{c['ci'][0]:+.2%}, {c['ci'][1]:+.2%}]" for p, c in per.items())
              + (" (95 % paired interval over rows)" if " vs " in name else " vs base (95 % paired interval over rows)"))


if __name__ == "__main__":
    sys.exit(main())
