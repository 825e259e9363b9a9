"""The README of ``models/olmoe-64x8`` (written by ``tools/train_olmoe64.py``, also with ``--report-only``)."""

from __future__ import annotations

import json
from pathlib import Path

import train_small_moe as base

SHARED_TRACES = base.REPO.parent / "shared" / "traces"
#: the tiering paper's (seed 004) Table 1: decode-time routing locality, range over four domains
PAPER_TABLE1 = [
    ("Qwen3-30B-A3B (E=128)", "1.10-1.26", "38-45%", "", "95-96%"),
    ("DeepSeek-V3 (E=256)", "0.86-0.93", "26-31%", "", "83-85%"),
    ("Kimi-K3 (E=896)", "1.00-1.04", "32-36%", "57-59%", "80-82%"),
]


def _size(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n > 1e5 else f"{n / 1e3:.1f} kB"


def _shared_stats() -> list[tuple[str, dict]]:
    out = []
    if SHARED_TRACES.is_dir():
        for folder in sorted(p for p in SHARED_TRACES.iterdir() if (p / "routing.npz").is_file()):
            rec = json.loads(base._cli("stats", str(folder), "--json").splitlines()[0])
            out.append((folder.name, rec))
    return out


def _nll_lines(f: dict, domains) -> list[str]:
    by = f["nll_by_domain"]
    cols = ["all", *[d for d in domains if d in by]]
    lines = ["| held-out rows | " + " | ".join(f"{c} ({by[c]['rows']} rows)" for c in cols) + " |",
             "|---" * (len(cols) + 1) + "|",
             "| this model (saved float16, reloaded fp32), positions 1.. | " + " | ".join(f"{by[c]['model']:.3f}" for c in cols) + " |",
             "| this model, positions 2.. (what the trigram scores) | " + " | ".join(f"{by[c]['model_from_pos2']:.3f}" for c in cols) + " |"]
    for order, name in ((1, "unigram"), (2, "bigram"), (3, "trigram")):
        lines.append(f"| {name}, add-k on the training ids (best k of 1, 0.1, 0.01, 0.001 per column) | "
                     + " | ".join(f"{by[c][f'ngram{order}']['nll']:.3f} (k={by[c][f'ngram{order}']['k']:g})" for c in cols) + " |")
    lines.append(f"| uniform, ln(vocab) | " + " | ".join(f"{f['ln_vocab']:.3f}" for _ in cols) + " |")
    return lines


def _routing_lines(report: dict, half: int) -> list[str]:
    keys = ("reuse_w1", "reuse_w8", "reuse_w64", "zipf_alpha", "top8_share", "coverage")
    names = list(report)
    ov = {n: report[n]["stats"][0] for n in names}
    copies = {n: {r["policy"]: r["copies_per_token"] for r in report[n]["replay"]} for n in names}
    lines = ["| figure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{ov[n][k]:.4f}" for n in names) + " |" for k in keys]
    lines += [f"| copies/token, {p} at C={half} per layer | " + " | ".join(f"{copies[n][p]:.3f}" for n in names) + " |"
              for p in ("lru", "belady")]
    return lines


def _comparison_lines(trained: dict, shared: list[tuple[str, dict]]) -> list[str]:
    lines = ["| routing | E | k | L | tokens | Zipf slope | reuse W1 | reuse W8 | reuse W64 |", "|---|---|---|---|---|---|---|---|---|"]

    def row(name, r):
        return (f"| {name} | {r['num_experts']} | {r['top_k']} | {r['num_layers']} | {r['tokens']:,} | {r['zipf_alpha']:.3f} | "
                f"{r['reuse_w1']:.3f} | {r['reuse_w8']:.3f} | {r['reuse_w64']:.3f} |")

    lines.append(row("**olmoe-64x8** (this model, held-out rows, teacher-forced)", trained))
    lines += [row(f"shared trace `{n}` ({r.get('phase', '')})".replace(" ()", ""), r) for n, r in shared]
    lines += [f"| paper Table 1: {m} (decode, 4 domains) | | | | | {a} | {w1} | {w8} | {w64} |" for m, a, w1, w8, w64 in PAPER_TABLE1]
    return lines


def _verdict(f: dict) -> str:
    """One line: does the model beat the best n-gram on the held-out rows (all domains)?"""
    a = f["nll_by_domain"]["all"]
    best = min((a[f"ngram{o}"]["nll"], o) for o in (1, 2, 3))
    name = {1: "unigram", 2: "bigram", 3: "trigram"}[best[1]]
    if a["model"] < best[0]:
        return f"**The model beats the best n-gram ({name}, {best[0]:.3f}) by {best[0] - a['model']:.3f} nats per token.**"
    return (f"**The model does not beat the n-grams: {a['model']:.3f} against the {name}'s {best[0]:.3f} nats per token** "
            f"after {f['train_tokens']:,} training tokens ({f['train_tokens'] / f['train_ids']:.2f} passes): "
            "this build is under-trained (see Training) and its figures are not a reference model's. A first attempt of the "
            "same build, before the machine's load rose, ran 854 tokens/s (step 50 at 120 s); at that rate `--steps 1500` "
            "(3.1 M tokens, 0.9 passes) takes about an hour.")


def render(f: dict, report: dict | None, args, domains) -> str:
    c, v = f["corpus"], f["versions"]
    tok_s = f["train_tokens"] / max(f["train_seconds"], 1e-9)
    stopped = ("all --steps done" if f["steps"] >= (args.steps or 0) else
               f"stopped by --cap-minutes {args.cap_minutes:g} at step {f['steps']} of {args.steps}: the schedule followed the "
               "time fraction, so a rebuild is not step-for-step reproducible")
    half = args.experts // 2
    lines = [
        "# olmoe-64x8: a small trained OLMoE at OLMoE's routing geometry",
        "",
        "A causal LM of the real OLMoE class (`OlmoeForCausalLM`) with OLMoE-1B-7B's routing geometry: 64 experts per layer,",
        "top-8, in 8 MoE layers (OLMoE has 16), trained on this machine on text rebuilt offline from Debian packages",
        "(the Python documentation, manual pages, the Python standard library). Built by `tools/train_olmoe64.py`",
        "(training loop, tokenizer and locality report from `tools/train_small_moe.py`), which also writes this file and",
        "`build.json`; `--report-only` re-measures the saved checkpoint and rewrites this file without training.",
        "",
        "```python",
        "import json, numpy as np, torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('models/olmoe-64x8', dtype=torch.float32)",
        "ids = np.load('models/olmoe-64x8/heldout_ids.npy')   # int64 [rows, 256]: one window per held-out document",
        "rows = json.load(open('models/olmoe-64x8/heldout_rows.json'))  # each row's domain and document",
        "```",
        "",
        "## Model",
        "",
        f"- OLMoE config: vocab {f['vocab']} (byte-level BPE, `<|endoftext|>` = id 0 between documents), hidden {args.hidden},",
        f"  {args.layers} layers, {args.heads} heads, **{args.experts} experts per layer, top-{args.top_k}** (`norm_topk_prob: false`),",
        f"  expert FFN width {args.intermediate}, untied embeddings, `router_aux_loss_coef` {args.aux_coef} (balance per layer)",
        f"- {f['params']:,} parameters, {f['expert_params']:,} of them in experts; saved as {f['dtype']} safetensors",
        "- files: " + ", ".join(f"`{k}` {_size(n)}" for k, n in f["sizes"].items())
        + f"; {sum(f['sizes'].values()) / 1e6:.2f} MB in all without this README",
        "",
        "## Training",
        "",
        f"```\n{f['command'].strip()}\n```",
        "",
        f"- {f['steps']} AdamW steps of {args.batch} x {args.seq} tokens ({f['train_tokens']:,} tokens, "
        f"{f['train_tokens'] / f['train_ids']:.2f} passes over the training ids) in **{f['train_seconds']:,.0f} s of training wall time**"
        f" ({f['total_seconds']:,.0f} s for the whole build before this report), {stopped}",
        f"- {tok_s:,.0f} tokens/s on average on {v['threads']} CPU threads at nice 19 on the shared 2-core machine (other agents' tests"
        " ran at the same time: the rate varied several-fold)",
        f"- lr {args.lr} (warmup {args.warmup} steps, cosine to 10%), betas (0.9, 0.95), weight decay {args.weight_decay}, grad clip 1.0,"
        f" seed {args.seed}, random {args.seq}-token windows of the training stream; experts run as `{args.experts_impl}` in training",
        f"- loss: next-token cross-entropy + {args.aux_coef} x the Switch load-balancing loss of each layer, averaged over layers",
        "",
        "## Data",
        "",
        "Three domains, each in sorted path order, each file cut at "
        f"{args.max_file_kb} kB (at a line end), until the domain's budget; every {args.holdout_every}th document of each domain held out:",
        "",
        "| domain | source and rule | budget | files | bytes | first .. last | held out |",
        "|---|---|---|---|---|---|---|",
    ]
    rules = {
        "docs": f"Debian `python3-doc` {c.get('python3_doc')} (`python3.11-doc` {c.get('python3_11_doc')}): "
                "`/usr/share/doc/python3-doc/html/**/*.html` outside `_static`, `_sources`, `_images`, `_downloads` and the "
                "index pages; the text of `<div role=\"main\">`",
        "man": "`/usr/share/man/man[1-8]/*.gz` (regular files; `gcloud*` skipped), roff reduced to text",
        "code": f"the Python {v['python']} standard library's `*.py` (small-moe's rule: tests, idlelib, lib2to3, encodings, "
                "pydoc_data, turtledemo skipped)",
    }
    for d in domains:
        dd = c["domains"][d]
        lines.append(f"| {d} | {rules[d]} | {getattr(args, d + '_mb')} MB | {dd['files']} | {dd['bytes']:,} | "
                     f"`{dd['first']}` .. `{dd['last']}` | {dd['heldout_files']} |")
    lines += [
        "",
        f"- corpus sha256 `{c['sha256']}` (over every domain, label and byte, in order); token ids sha256 `{f['ids_sha256']}`",
        f"- training: {c['train_files']} documents, {f['train_ids']:,} ids; held out: {c['heldout_files']} documents, "
        f"{f['heldout_stream_ids']:,} ids",
        f"- `heldout_ids.npy`: one 256-id window from the middle of every held-out document with at least 256 ids "
        f"({', '.join(f'{d} {n}' for d, n in c['rows_per_domain'].items())} rows); `heldout_rows.json` names each row's domain "
        "and document. These files are fixed: evaluations read them, not files that change with commits",
        f"- built with Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, {v['machine']}, Debian 12 packages",
        "",
        "## Held-out NLL",
        "",
        "Next-token NLL in nats per token on the saved held-out rows. The n-grams are counted on the training ids only,",
        "and their smoothing k is the best of the grid *on these rows* (which flatters them):",
        "",
        *_nll_lines(f, domains),
        "",
        _verdict(f),
        "",
        f"On the 128 x 256 windows spread over the whole held-out stream: {f['nll_saved']['eval_64x256']:.3f} (saved), "
        f"{f['nll_fp32']['eval_64x256']:.3f} (fp32 before saving); an untrained model of the same config: {f['nll_untrained']:.3f}.",
        "",
    ]
    if report is not None:
        shared = _shared_stats()
        lines += [
            "## Routing",
            "",
            f"A trace captured on the {len(f.get('heldout_rows', [])) or 'saved'} held-out rows (`expertcache.capture(model, phase=\"all\")`, "
            "one forward per row, teacher-forced), of this model, of an untrained model of the same config, and of a synthetic",
            f"trace whose tokens pick their experts uniformly at random; `expertcache stats --json` (means over layers) and",
            f"`expertcache replay -c {half} -p lru -p belady` (C = {half} of {args.experts} per layer, the eviction paper's operating point):",
            "",
            *_routing_lines(report, half),
            "",
            "Beside the shared real traces (`expertcache stats` on `/work/shared/traces`) and the tiering paper's Table 1",
            "(seed 004; decode-time, ranges over four domains; its reuse figures count the same thing as `reuse_wN`: the share",
            "of a token's selections at a layer that appeared in the previous N tokens at that layer):",
            "",
            *_comparison_lines(report["trained"]["stats"][0], shared),
            "",
        ]
        for n in report:
            lines += [f"`expertcache stats`, {n}:", "", "```", report[n]["stats_text"].rstrip(), "```", ""]
        lines += ["`expertcache replay`, trained:", "", "```", report["trained"]["replay_text"].rstrip(), "```", ""]
    return "\n".join(lines)
