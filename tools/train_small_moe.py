#!/usr/bin/env python
"""Train the small real OLMoE checkpoint in ``models/small-moe/`` (for tests and the demo).

Random-weight toy models route by accident and their NLL means nothing; this script trains a small
causal LM of the real OLMoE class (``transformers.OlmoeConfig`` / ``AutoModelForCausalLM``) on text
that ships with this machine, nothing downloaded:

* corpus: the license texts under ``/usr/share/common-licenses`` (regular files, if the folder
  exists), the Python standard library's ``LICENSE.txt`` and its ``*.py`` sources (test suites,
  ``idlelib``, ``lib2to3``, ``encodings``, ``site-packages`` and other non-stdlib folders skipped),
  in sorted order, each file cut at ``--max-file-kb`` (at a line end), until ``--corpus-mb`` bytes
  are taken. Every ``--holdout-every``-th file is held out for evaluation, the rest trains. The
  sha256 fingerprint printed (and written to the README) identifies the exact bytes, so a rebuild
  can be compared (it depends on the Python version's stdlib: see ``python`` in the README);
* tokenizer: a byte-level BPE (``tokenizers``) trained on the training part, saved as a
  ``PreTrainedTokenizerFast`` beside the model (``AutoTokenizer.from_pretrained(folder)``);
* model: OLMoE config scaled down (hidden 128, 4 layers, 16 experts, top-2), trained with AdamW on
  next-token cross-entropy plus ``router_aux_loss_coef`` (0.01) times the model's own Switch
  load-balancing loss (``load_balancing_loss_func`` on the ``output_router_logits``), computed per
  layer and averaged; ``--aux-pooled`` uses the built-in form, which pools all layers' routes and
  so lets single layers leave experts unused;
* save: fp16 safetensors (``save_pretrained``), the tokenizer, ``heldout_ids.npy`` (16 x 128
  held-out token ids) and ``README.md`` with the measured figures: held-out NLL in fp32 and after
  the fp16 save (reloaded from disk), and routing locality of a trace captured with
  ``expertcache.capture`` on the held-out ids, reported by ``expertcache stats`` / ``replay``, next
  to the same figures for an untrained model of the same config and for a synthetic trace without
  locality (experts drawn uniformly at random); ``build.json`` keeps the training facts, so
  ``--report-only`` re-measures the saved checkpoint and rewrites the README without training.

Rebuild (deterministic on the same machine, torch and thread count)::

    nice -n 5 .venv/bin/python tools/train_small_moe.py --steps 480

Without ``--steps`` the run trains for ``--minutes`` of wall time (not reproducible step for step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "models" / "small-moe"
LICENSES = Path("/usr/share/common-licenses")
EOS = "<|endoftext|>"

#: stdlib folders (any path component) that are not library source worth learning from, or not stdlib
SKIP_PARTS = {
    "test", "tests", "idle_test", "idlelib", "lib2to3", "encodings", "site-packages", "dist-packages",
    "__pycache__", "__phello__", "turtledemo", "pydoc_data",
}


# -- corpus -----------------------------------------------------------------------------------------
def _cut(data: bytes, limit: int) -> bytes:
    if len(data) <= limit:
        return data
    end = data.rfind(b"\n", 0, limit)
    return data[: end + 1] if end > 0 else data[:limit]


def corpus_files() -> list[tuple[str, Path]]:
    """(label, path) of every candidate file, in the fixed order: licenses, stdlib LICENSE, stdlib *.py."""
    out: list[tuple[str, Path]] = []
    if LICENSES.is_dir():
        for p in sorted(LICENSES.iterdir()):
            if p.is_file() and not p.is_symlink():
                out.append((f"common-licenses/{p.name}", p))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if (stdlib / "LICENSE.txt").is_file():
        out.append(("stdlib/LICENSE.txt", stdlib / "LICENSE.txt"))
    sources = []
    for p in stdlib.rglob("*.py"):
        rel = p.relative_to(stdlib)
        if any(part in SKIP_PARTS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or not p.is_file():
            continue  # build-specific, not source
        sources.append((rel.as_posix(), p))
    out.extend((f"stdlib/{rel}", p) for rel, p in sorted(sources))
    return out


def build_corpus(corpus_mb: float, max_file_kb: int, holdout_every: int):
    """Deterministic (train_docs, heldout_docs, info): texts in corpus order and the corpus fingerprint."""
    budget = int(corpus_mb * 1024 * 1024)
    digest = hashlib.sha256()
    train, heldout, labels = [], [], []
    taken = 0
    for label, path in corpus_files():
        if taken >= budget:
            break
        data = _cut(path.read_bytes(), max_file_kb * 1024)
        data = _cut(data, budget - taken) if taken + len(data) > budget else data
        if not data.strip():
            continue
        text = data.decode("utf-8", errors="replace")
        index = len(labels)
        labels.append(label)
        taken += len(data)
        digest.update(label.encode() + b"\0" + data + b"\0")
        (heldout if index % holdout_every == holdout_every // 2 else train).append(text)
    info = {
        "files": len(labels),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "bytes": taken,
        "sha256": digest.hexdigest(),
        "first": labels[0] if labels else None,
        "last": labels[-1] if labels else None,
        "licenses": sum(1 for l in labels if l.startswith("common-licenses/")),
    }
    return train, heldout, info


# -- tokenizer --------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, clean_up_tokenization_spaces=False)


def encode_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """One int32 stream: each document's ids followed by EOS."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return np.concatenate([np.asarray(d + [eos], dtype=np.int32) for d in ids])


def windows(stream: np.ndarray, rows: int, length: int) -> np.ndarray:
    """``rows`` non-overlapping windows of ``length`` ids, evenly spaced over the stream."""
    span = len(stream) - length
    if span < 0 or rows * length > len(stream):
        raise SystemExit(f"held-out stream too short ({len(stream)} ids) for {rows} x {length}")
    starts = np.linspace(0, span, rows).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int64)


# -- model ------------------------------------------------------------------------------------------
def make_config(args, vocab: int, eos_id: int):
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=False,
        max_position_embeddings=512, tie_word_embeddings=False, output_router_logits=False,
        router_aux_loss_coef=args.aux_coef, bos_token_id=None, eos_token_id=eos_id, pad_token_id=None,
    )


def seed_all(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def heldout_nll(model, ids: np.ndarray, batch: int = 16) -> float:
    """Mean next-token NLL (nats) over all predicted positions of the rows of ``ids``."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = torch.from_numpy(ids[i : i + batch])
            logits = model(input_ids=x, output_router_logits=False, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += float(nll)
            count += x[:, 1:].numel()
    return total / count


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to 10% of it as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(args, model, stream: np.ndarray, log) -> dict:
    import torch

    from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

    model.train()
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60.0
    cap = (getattr(args, "cap_minutes", None) or 0) * 60.0  # with --steps: stop early at this wall time
    start = time.perf_counter()
    step, seen, ema = 0, 0, None
    while True:
        elapsed = time.perf_counter() - start
        if args.steps is not None:
            if step >= args.steps or (cap and elapsed >= cap):
                break
            progress = max(step / args.steps, elapsed / cap if cap else 0.0)
        else:
            if elapsed >= budget:
                break
            progress = elapsed / budget
        lr = lr_at(progress, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(stream) - args.seq, size=args.batch)
        x = torch.from_numpy(np.stack([stream[s : s + args.seq] for s in starts]).astype(np.int64))
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        lm_loss = model.loss_function(logits=out.logits, labels=x, vocab_size=model.config.vocab_size)
        if args.aux_pooled:  # what OlmoeForCausalLM.forward adds: one balance over all layers' routes pooled
            aux_loss = load_balancing_loss_func(out.router_logits, E, k)
        else:  # the same loss per layer, averaged: each layer's experts balanced on their own
            aux_loss = torch.stack([load_balancing_loss_func((rl,), E, k) for rl in out.router_logits]).mean()
        loss_t = lm_loss + model.config.router_aux_loss_coef * aux_loss
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        lm, aux = lm_loss.item(), aux_loss.item()
        ema = lm if ema is None else 0.95 * ema + 0.05 * lm
        if step % args.log_every == 0 or step == 1:
            el = time.perf_counter() - start
            log(f"step {step:5d}  lm {lm:.3f} (ema {ema:.3f})  aux {aux:.3f}  lr {lr:.2e}  "
                f"{seen / el:,.0f} tok/s  {el:.0f}s")
    seconds = time.perf_counter() - start
    model.eval()
    return {"steps": step, "tokens": seen, "seconds": round(seconds, 1), "final_lm_ema": round(ema or float("nan"), 4)}


# -- locality ---------------------------------------------------------------------------------------
def _cli(*argv: str) -> str:
    """Run the project's CLI (``python -m expertcache.cli.main``) and return its stdout."""
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run([sys.executable, "-m", "expertcache.cli.main", *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"expertcache {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def locality(model, ids: np.ndarray, path: Path) -> dict:
    """Capture the held-out rows (one sequence each) and read ``expertcache stats`` / ``replay`` on it."""
    import torch

    sys.path.insert(0, str(REPO / "src"))
    import expertcache

    with torch.no_grad(), expertcache.capture(model, phase="all") as cap:
        for row in ids:
            model(input_ids=torch.from_numpy(row[None]), use_cache=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    cap.trace.save(str(path))
    return _measure(path, model.config.num_experts)


def _measure(path: Path, num_experts: int) -> dict:
    """``expertcache stats`` and ``replay -c E/2 -p lru -p belady`` on a saved trace (text and JSON)."""
    stats_text = _cli("stats", str(path))
    stats = [json.loads(line) for line in _cli("stats", str(path), "--json").splitlines() if line.strip()]
    half = str(num_experts // 2)
    replay_text = _cli("replay", str(path), "-c", half, "-p", "lru", "-p", "belady")
    replay = [json.loads(line) for line in _cli("replay", str(path), "-c", half, "-p", "lru", "-p", "belady", "--json").splitlines()
              if line.strip()]
    return {"stats_text": stats_text, "stats": stats, "replay_text": replay_text, "replay": replay}


# -- main -------------------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder (default models/small-moe)")
    ap.add_argument("--steps", type=int, default=None, help="train exactly N steps (deterministic); overrides --minutes")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall-time budget when --steps is not given (default 5)")
    ap.add_argument("--cap-minutes", type=float, default=None,
                    help="with --steps: stop at this wall time if the steps are not done (the schedule follows whichever "
                         "fraction, steps or time, is further along); a run that stops early is not step-reproducible")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--max-file-kb", type=int, default=128)
    ap.add_argument("--holdout-every", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=128, help="per-expert FFN width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router_aux_loss_coef (OLMoE's default 0.01)")
    ap.add_argument("--aux-pooled", action="store_true",
                    help="balance experts over all layers pooled, as OlmoeForCausalLM's own loss does (default: per layer)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--experts-impl", choices=("eager", "grouped_mm", "batched_mm"), default="eager",
                    help="transformers experts implementation used for training (the saved model is the same class)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="saved dtype")
    ap.add_argument("--no-report", action="store_true", help="skip the locality capture and stats")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: re-measure the checkpoint in --out (its build.json gives the training facts and "
                         "settings) and rewrite its README")
    return ap


@dataclass(frozen=True)
class Recipe:
    """What differs between the checkpoints this trainer builds; ``main`` does the rest the same way.

    ``corpus(args)`` -> (train_docs, heldout_docs, info); ``heldout(held_stream, tokenizer, heldout_docs, info, args)``
    -> (heldout_ids, eval_ids, extra files {name: bytes} saved beside the model); ``readme(facts, report, args)`` -> text;
    ``measure(train_ids, heldout_ids, eval_ids, vocab, args)`` -> extra facts (or None).
    """

    script: str
    parser: Callable[[], argparse.ArgumentParser]
    corpus: Callable
    heldout: Callable
    readme: Callable
    measure: Callable | None = None


def small_moe_corpus(args):
    return build_corpus(args.corpus_mb, args.max_file_kb, args.holdout_every)


def small_moe_heldout(held_stream, tokenizer, heldout_docs, info, args):
    """16 x 128 rows (committed: tests and the demo) and 64 x 256 windows for the README figure."""
    return windows(held_stream, 16, 128), windows(held_stream, 64, 256), {}


def main(argv: list[str] | None = None, recipe: Recipe | None = None) -> int:
    recipe = recipe or SMALL_MOE
    args = recipe.parser().parse_args(argv)
    if args.report_only:
        build = json.loads((args.out / "build.json").read_text())
        kept = {"out": args.out, "no_report": args.no_report, "report_only": True}
        args = argparse.Namespace(**{**build["args"], **kept})
    else:
        build = None

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    out = args.out

    # corpus and tokenizer
    train_docs, heldout_docs, corpus = recipe.corpus(args)
    log(f"corpus: {corpus['files']} files ({corpus['train_files']} train, {corpus['heldout_files']} held out), "
        f"{corpus['bytes']:,} bytes ({corpus['first']} .. {corpus['last']}), sha256 {corpus['sha256']}")
    seed_all(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(out) if build else train_tokenizer(train_docs, args.vocab)
    train_ids = encode_stream(tokenizer, train_docs)
    held_stream = encode_stream(tokenizer, heldout_docs)
    token_digest = hashlib.sha256(train_ids.tobytes() + held_stream.tobytes()).hexdigest()
    vocab = len(tokenizer)
    log(f"tokenizer: vocab {vocab}, {len(train_ids):,} train ids, {len(held_stream):,} held-out ids "
        f"({corpus['bytes'] / (len(train_ids) + len(held_stream)):.2f} bytes/id), ids sha256 {token_digest[:16]}")
    heldout_ids, eval_ids, extra_files = recipe.heldout(held_stream, tokenizer, heldout_docs, corpus, args)
    if build:
        if corpus["sha256"] != build["corpus"]["sha256"] or token_digest != build["ids_sha256"]:
            log("warning: this machine's corpus or token ids differ from the build's; figures are for this corpus")
        if not np.array_equal(np.load(out / "heldout_ids.npy"), heldout_ids):
            log("warning: heldout_ids.npy differs from the ids rebuilt here; measuring the saved file")
            heldout_ids = np.load(out / "heldout_ids.npy")

    if build is None:
        # model
        seed_all(args.seed)
        model = AutoModelForCausalLM.from_config(make_config(args, vocab, tokenizer.eos_token_id))
        model.set_experts_implementation(args.experts_impl)
        log(f"model: OlmoeForCausalLM, {sum(p.numel() for p in model.parameters()):,} parameters, "
            f"{args.experts} experts top-{args.top_k}, hidden {args.hidden}, {args.layers} layers")
        run = train(args, model, train_ids, log)
        log(f"trained {run['steps']} steps, {run['tokens']:,} tokens in {run['seconds']}s")
        nll32 = {"heldout_ids": heldout_nll(model, heldout_ids), "eval_64x256": heldout_nll(model, eval_ids)}
        log(f"held-out NLL fp32: {nll32['heldout_ids']:.4f} (16x128), {nll32['eval_64x256']:.4f} (64x256); "
            f"ln(vocab) {math.log(vocab):.4f}")
        # save
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("*.safetensors"):
            stale.unlink()
        model.to(getattr(torch, args.dtype)).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        np.save(out / "heldout_ids.npy", heldout_ids)
        for name, data in extra_files.items():
            (out / name).write_bytes(data)
        build = {
            "command": f"nice -n {os.nice(0)} .venv/bin/python {recipe.script} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "steps": run["steps"], "train_seconds": run["seconds"], "train_tokens": run["tokens"],
            "total_seconds": round(time.perf_counter() - t0, 1),
            "corpus": corpus, "ids_sha256": token_digest, "nll_fp32": nll32,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "threads": args.threads, "machine": platform.machine()},
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "no_report", "report_only")},
        }
        (out / "build.json").write_text(json.dumps(build, indent=1) + "\n")
        del model

    # measure what is on disk, as a user would load it
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    params = sum(p.numel() for p in reloaded.parameters())
    expert_params = sum(p.numel() for n, p in reloaded.named_parameters() if ".experts." in n)
    nll_saved = {"heldout_ids": heldout_nll(reloaded, heldout_ids), "eval_64x256": heldout_nll(reloaded, eval_ids)}
    log(f"held-out NLL after the {args.dtype} save: {nll_saved['heldout_ids']:.4f} (16x128), "
        f"{nll_saved['eval_64x256']:.4f} (64x256); ln(vocab) {math.log(vocab):.4f}")
    seed_all(args.seed)
    untrained_model = AutoModelForCausalLM.from_config(make_config(args, vocab, tokenizer.eos_token_id)).eval()
    nll_untrained = heldout_nll(untrained_model, heldout_ids)
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    nll_unigram = float(-np.log(counts / counts.sum())[heldout_ids[:, 1:]].mean())
    tok2 = AutoTokenizer.from_pretrained(out)
    probe = "def add(a, b):\n    return a + b  # Licensed under the Apache License\n"
    assert tok2.decode(tok2(probe, add_special_tokens=False)["input_ids"]) == probe, "tokenizer does not round-trip"

    report = None
    if not args.no_report:
        with tempfile.TemporaryDirectory() as tmp:
            report = {
                "trained": locality(reloaded, heldout_ids, Path(tmp) / "trained" / "routing.npz"),
                "untrained": locality(untrained_model, heldout_ids, Path(tmp) / "untrained" / "routing.npz"),
                "iid-uniform": uniform_locality(args, heldout_ids.shape, Path(tmp) / "iid-uniform" / "routing.npz"),
            }
        report["trained"]["cosine"] = consecutive_cosine(reloaded, heldout_ids)
        report["untrained"]["cosine"] = consecutive_cosine(untrained_model, heldout_ids)
        for name, loc in report.items():
            log(f"--- {name}: expertcache stats\n{loc['stats_text'].rstrip()}")
            log(f"--- {name}: expertcache replay -c {args.experts // 2} -p lru -p belady\n{loc['replay_text'].rstrip()}")

    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != "README.md"}
    facts = {
        **build, "vocab": vocab, "ln_vocab": math.log(vocab), "params": params, "expert_params": expert_params,
        "train_ids": int(len(train_ids)), "heldout_stream_ids": int(len(held_stream)),
        "nll_untrained": nll_untrained, "nll_unigram": nll_unigram, "nll_saved": nll_saved, "dtype": args.dtype,
        "sizes": sizes, "measured_with": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if recipe.measure is not None:
        facts.update(recipe.measure(train_ids, heldout_ids, eval_ids, vocab, args))
    (out / "README.md").write_text(recipe.readme(facts, report, args))
    log(f"{out}: {sum(sizes.values()) / 1e6:.2f} MB without README; script {time.perf_counter() - t0:.1f}s")
    return 0


def consecutive_cosine(model, ids: np.ndarray) -> list[float]:
    """Per MoE layer: mean cosine similarity of the router inputs of consecutive positions."""
    import torch

    got: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_pre_hook(lambda mod, a, i=i: got.__setitem__(i, a[0]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i in sorted(got):
        h = got[i].reshape(ids.shape[0], ids.shape[1], -1)
        out.append(float(torch.nn.functional.cosine_similarity(h[:, 1:], h[:, :-1], dim=-1).mean()))
    return out


def uniform_locality(args, shape: tuple[int, int], path: Path) -> dict:
    """The reference without any locality: each token picks k distinct experts per layer uniformly at random."""
    sys.path.insert(0, str(REPO / "src"))
    import expertcache

    rows, length = shape
    rng = np.random.default_rng(args.seed)
    experts = np.argsort(rng.random((rows * length, args.layers, args.experts)), axis=-1)[..., : args.top_k]
    seq = np.repeat(np.arange(rows), length)
    trace = expertcache.Trace.from_arrays(np.sort(experts, axis=-1), seq, num_experts=args.experts,
                                          meta={"phase": "teacher-forced", "model": "iid uniform top-k"})
    path.parent.mkdir(parents=True, exist_ok=True)
    trace.save(str(path))
    return _measure(path, args.experts)


def readme(f: dict, report: dict | None, args) -> str:
    c = f["corpus"]
    n32, nsv = f["nll_fp32"], f["nll_saved"]
    v = f["versions"]
    tok_s = f["train_tokens"] / max(f["train_seconds"], 1e-9)
    lines = [
        "# small-moe: a small trained OLMoE for tests and the demo",
        "",
        "A causal LM of the real OLMoE class (`OlmoeForCausalLM`, `model_type: olmoe`) trained on this machine's",
        "own text (license texts and Python standard-library source, nothing downloaded), so its NLL and routing",
        "mean something, unlike the random-weight toy checkpoints. Built by `tools/train_small_moe.py`, which",
        "also writes this file and `build.json` (`--report-only` re-measures the saved checkpoint and rewrites both",
        "figures and this file without training).",
        "",
        "```python",
        "import numpy as np, torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('models/small-moe', dtype=torch.float32)",
        "tokenizer = AutoTokenizer.from_pretrained('models/small-moe')",
        "ids = np.load('models/small-moe/heldout_ids.npy')  # int64 [16, 128]: held-out token ids",
        "```",
        "",
        "## Model",
        "",
        f"- OLMoE config: vocab {f['vocab']} (byte-level BPE, `<|endoftext|>` = id 0 between files), hidden {args.hidden},",
        f"  {args.layers} layers, {args.heads} heads, {args.experts} experts per layer, top-{args.top_k} (`norm_topk_prob: false`),",
        f"  expert FFN width {args.intermediate}, untied embeddings, `router_aux_loss_coef` {args.aux_coef}",
        f"- {f['params']:,} parameters, {f['expert_params']:,} of them in experts; saved as {f['dtype']} safetensors",
        "- files: " + ", ".join(f"`{k}` {v_ / 1e6:.2f} MB" if v_ > 1e5 else f"`{k}` {v_ / 1e3:.1f} kB" for k, v_ in f["sizes"].items()),
        "",
        "## Training",
        "",
        "```",
        f["command"].strip(),
        "```",
        "",
        f"- {f['steps']} AdamW steps of {args.batch} x {args.seq} tokens ({f['train_tokens']:,} tokens) in {f['train_seconds']} s of wall",
        f"  time on {v['threads']} CPU threads ({tok_s:,.0f} tokens/s on average; the 2-core machine was shared, ~10,000 tokens/s unloaded);",
        f"  lr {args.lr} (warmup {args.warmup} steps, cosine to 10%), betas (0.9, 0.95), weight decay {args.weight_decay}, grad clip 1.0,",
        f"  seed {args.seed}, random {args.seq}-token windows of the training stream",
        f"- loss: next-token cross-entropy + {args.aux_coef} x the model's own Switch load-balancing loss",
        "  (`transformers.models.olmoe.modeling_olmoe.load_balancing_loss_func` on the router logits) " + (
            "over all layers pooled, as `OlmoeForCausalLM.forward` adds it" if args.aux_pooled else
            "computed per layer and averaged. The built-in form pools all layers' routes into one balance, which let a "
            "150-step pilot leave 3 of 16 experts unused in 3 of 4 layers"),
        f"- corpus: {c['files']} files, {c['bytes']:,} bytes: {c['licenses']} texts from /usr/share/common-licenses (regular files),",
        f"  then the stdlib's LICENSE.txt and `*.py` in sorted path order up to `{c['last']}`, each cut at {args.max_file_kb} kB,",
        "  test suites, idlelib, lib2to3, encodings, pydoc_data, turtledemo skipped, " + f"{args.corpus_mb} MB cap",
        f"- corpus sha256 `{c['sha256']}`",
        f"- held out: every {args.holdout_every}th file ({c['heldout_files']} files, {f['heldout_stream_ids']:,} ids); "
        f"training: {c['train_files']} files, {f['train_ids']:,} ids; token ids sha256 `{f['ids_sha256'][:16]}...`",
        f"- built with Python {v['python']} (its stdlib is the corpus), torch {v['torch']}, transformers {v['transformers']}, {v['machine']}",
        "",
        "`--steps N` makes a rebuild deterministic on the same machine, thread count and library versions",
        "(checked: two 5-step builds gave byte-identical `model.safetensors` and `tokenizer.json`); another Python",
        "version changes the stdlib and so the corpus fingerprint.",
        "",
        "## Measured",
        "",
        f"Held-out next-token NLL in nats per token; ln(vocab) = {f['ln_vocab']:.3f} is the uniform guess:",
        "",
        "| weights | `heldout_ids.npy` (16 x 128) | 64 x 256 held-out windows |",
        "|---|---|---|",
        f"| trained, fp32 (in memory, before saving) | {n32['heldout_ids']:.3f} | {n32['eval_64x256']:.3f} |",
        f"| saved {f['dtype']}, reloaded as fp32 | {nsv['heldout_ids']:.3f} | {nsv['eval_64x256']:.3f} |",
        f"| untrained, same config (seed {args.seed}) | {f['nll_untrained']:.3f} | |",
        f"| unigram frequencies of the training ids (add-one) | {f['nll_unigram']:.3f} | |",
        f"| uniform, ln(vocab) | {f['ln_vocab']:.3f} | {f['ln_vocab']:.3f} |",
        "",
    ]
    if report is not None:
        names = list(report)
        ov = {n: report[n]["stats"][0] for n in names}
        keys = [k for k in ("reuse_w1", "reuse_w8", "reuse_w64", "zipf_alpha", "top8_share", "distinct_mean", "coverage")
                if all(k in ov[n] for n in names)]
        half = args.experts // 2
        copies = {n: {rec["policy"]: rec["copies_per_token"] for rec in report[n]["replay"]} for n in names}
        lines += [
            "Routing locality of a trace captured on the 16 held-out rows (`expertcache.capture(model, phase=\"all\")`,",
            "one forward per row: 16 sequences x 128 tokens), for the saved model, an untrained model of the same config,",
            "and a synthetic trace in which every token picks its experts uniformly at random (no locality at all).",
            f"`expertcache stats --json` overall figures (means over layers) and `expertcache replay -c {half} -p lru -p belady`:",
            "",
            "| figure | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        lines += [f"| {k} | " + " | ".join(f"{ov[n][k]:.4f}" for n in names) + " |" for k in keys]
        lines += [f"| copies/token, {p} at capacity {half} | " + " | ".join(f"{copies[n][p]:.4f}" for n in names) + " |"
                  for p in ("lru", "belady")]
        t, u, r = ov["trained"], ov["untrained"], ov.get("iid-uniform")
        more = [k for k in ("reuse_w1", "reuse_w8") if t[k] > u[k]]
        lines += ["", "Reading:", ""]
        if r is not None:
            lines.append(
                f"- against no locality (iid uniform), the trained router reuses {t['reuse_w1'] / r['reuse_w1']:.1f}x as many of the"
                f" previous token's experts (W1 {t['reuse_w1']:.3f} vs {r['reuse_w1']:.3f}, W8 {t['reuse_w8']:.3f} vs {r['reuse_w8']:.3f}),"
                f" and LRU at capacity {half} makes {copies['trained']['lru']:.2f} copies/token against {copies['iid-uniform']['lru']:.2f}:"
                " the routing has real temporal locality.")
        if len(more) < 2:
            lines.append(
                f"- the untrained model shows *more* locality than the trained one (W1 {u['reuse_w1']:.3f} vs {t['reuse_w1']:.3f},"
                f" Zipf slope {u['zipf_alpha']:.3f} vs {t['zipf_alpha']:.3f}, LRU {copies['untrained']['lru']:.2f} vs"
                f" {copies['trained']['lru']:.2f} copies/token). That locality is inertia, not content: with random weights"
                " attention mixes the prefix regardless of content, so each position's residual stream is largely a blend"
                " of the tokens before it and changes slowly from one position to the next; the router inputs of consecutive positions have mean"
                " cosine " + "/".join(f"{x:.2f}" for x in report["untrained"]["cosine"]) + " at layers 0-"
                f"{len(report['untrained']['cosine']) - 1} untrained against " + "/".join(f"{x:.2f}" for x in report["trained"]["cosine"])
                + " trained, so the untrained router keeps choosing the same experts, more so the deeper the layer"
                " (its per-layer W1 grows with depth). The trained router, balanced per layer, routes by content;"
                " its locality comes from the text. A trained model with more locality than the"
                " untrained one was not tried (fewer, larger experts or a smaller balance coefficient would be the"
                " first things to try).")
        else:
            lines.append(f"- the trained model also shows more locality than the untrained one (W1 {t['reuse_w1']:.3f} vs {u['reuse_w1']:.3f}).")
        for n in names:
            lines += ["", f"`expertcache stats`, {n}:", "", "```", report[n]["stats_text"].rstrip(), "```"]
        for n in names:
            lines += ["", f"`expertcache replay -c {half} -p lru -p belady`, {n}:", "", "```", report[n]["replay_text"].rstrip(), "```"]
        lines.append("")
    return "\n".join(lines)


SMALL_MOE = Recipe(script="tools/train_small_moe.py", parser=make_parser, corpus=small_moe_corpus,
                   heldout=small_moe_heldout, readme=readme)


if __name__ == "__main__":
    sys.exit(main())
