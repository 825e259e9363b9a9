#!/usr/bin/env python
"""Train ``models/olmoe-64x8/``: a small real OLMoE at OLMoE's routing geometry (64 experts, top-8, 8 MoE layers).

The training loop, tokenizer, save and locality report are ``tools/train_small_moe.py``'s (its ``main`` with
this file's ``Recipe``); what differs is the geometry and the corpus, which is rebuilt offline from three
domains installed on these machines (Debian bookworm), nothing downloaded:

* ``docs``: the Python documentation of Debian's ``python3-doc`` package (``apt-get update && apt-get install
  -y python3-doc``; version recorded in the README), every ``*.html`` under ``/usr/share/doc/python3-doc/html``
  outside ``_static``/``_sources``/``_images``/``_downloads`` and the index pages (``genindex*``,
  ``py-modindex``, ``search``), in sorted path order, reduced to the text of its ``<div role="main">``
  (``html_text``: block tags become line breaks, ``<pre>`` keeps its layout, permalink marks dropped);
* ``man``: the English manual pages ``/usr/share/man/man[1-8]/*.gz`` (regular files; ``gcloud*`` skipped: the
  generated reference of google-cloud-cli, not a Debian package) in sorted path order, their roff source
  reduced to text (``roff_text``: requests dropped or replaced by their arguments, font escapes removed);
* ``code``: the Python standard library's ``*.py`` (``train_small_moe.corpus_files``' rule: test suites,
  idlelib, lib2to3, encodings, pydoc_data, turtledemo skipped), in sorted path order.

Each domain takes its files in order, each cut at ``--max-file-kb`` at a line end, until its byte budget
(``--docs-mb``, ``--man-mb``, ``--code-mb``); every ``--holdout-every``-th document of each domain is held out.
The corpus sha256 covers every (domain, label, bytes) in order. The held-out rows saved beside the model
(``heldout_ids.npy``, int64 [rows, 256]) are one window from the middle of each held-out document long
enough, so rows are documents; ``heldout_rows.json`` names each row's domain and document.

Build (``--steps`` fixes the schedule; ``--cap-minutes`` stops a slow run in time)::

    nice -n 19 .venv/bin/python tools/train_olmoe64.py --steps 1500 --cap-minutes 80
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_small_moe as base  # noqa: E402

DEFAULT_OUT = base.REPO / "models" / "olmoe-64x8"
DOCS = Path("/usr/share/doc/python3-doc/html")
MAN = Path("/usr/share/man")
DOMAINS = ("docs", "man", "code")
ROW_LEN = 256
DOC_SKIP_DIRS = {"_static", "_sources", "_images", "_downloads"}
DOC_SKIP_PAGES = {"genindex", "py-modindex", "search"}
#: google-cloud-cli installs 16,631 generated pages of one CLI's reference: not Debian's man pages
MAN_SKIP_PREFIX = "gcloud"


# -- text extraction --------------------------------------------------------------------------------
class _MainText(HTMLParser):
    """Text of the first ``<div role="main">`` (Sphinx's page body)."""

    BLOCK = {"p", "div", "pre", "li", "dt", "dd", "tr", "br", "h1", "h2", "h3", "h4", "h5", "h6", "table", "section",
             "blockquote", "ul", "ol", "dl"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0          # div nesting inside the main div (0: outside)
        self.done = False
        self.pre = 0
        self.skip = 0           # inside a permalink anchor
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and a.get("role") == "main" and not self.done:
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if tag == "a" and "headerlink" in (a.get("class") or ""):
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.depth == 0:
            return
        if tag == "a" and self.skip:
            self.skip -= 1
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in self.BLOCK:
            self.parts.append("\n")
        if tag == "div":
            self.depth -= 1
            if self.depth == 0:
                self.done = True

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(data: bytes) -> str:
    """The readable text of a Sphinx HTML page's main body (empty when it has none)."""
    parser = _MainText()
    parser.feed(data.decode("utf-8", errors="replace"))
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return text + "\n" if text else ""


_ROFF_ESC = re.compile(r"\\f(\[[^\]]*\]|\(..|.)|\\s[-+]?\d|\\[&|^%c:]|\\\*(\(..|\[[^\]]*\]|.)|\\n(\(..|.)")
_ROFF_CHARS = {r"\-": "-", r"\(em": "--", r"\(en": "-", r"\(bu": "*", r"\(aq": "'", r"\(dq": '"', r"\(lq": '"',
               r"\(rq": '"', r"\(co": "(c)", r"\e": "\\", r"\ ": " ", r"\~": " ", r"\0": " "}
_ROFF_TEXT_REQUESTS = {"SH", "SS", "B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "TP", "IP", "SM", "SB", "Nm", "Nd",
                       "Sh", "Ss", "Fl", "Ar", "It", "Op", "Pa", "Xr", "Dv", "Em", "Cm", "Ic", "Va", "Fn", "Ft", "Fa"}


def roff_text(data: bytes) -> str:
    """Manual-page roff source reduced to text: comments and layout requests dropped, text requests' arguments kept."""
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.startswith(("'", ".")):
            req, _, rest = line[1:].lstrip().partition(" ")
            if req.startswith('\\"') or req not in _ROFF_TEXT_REQUESTS or not rest.strip():
                continue
            line = rest.replace('"', "")
            if req in ("SH", "Sh"):
                out.append("")
        for esc, rep in _ROFF_CHARS.items():
            line = line.replace(esc, rep)
        out.append(_ROFF_ESC.sub("", line).replace("\\", ""))
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()
    return text + "\n" if text else ""


# -- corpus -----------------------------------------------------------------------------------------
def domain_files(domain: str) -> list[tuple[str, Path]]:
    """(label, path) of every candidate file of a domain, in the fixed (sorted path) order."""
    if domain == "docs":
        root = DOCS.resolve()
        paths = [p for p in root.rglob("*.html")
                 if not (set(p.relative_to(root).parts[:-1]) & DOC_SKIP_DIRS) and p.stem.split("-all")[0] not in DOC_SKIP_PAGES]
        return [(f"docs/{p.relative_to(root).as_posix()}", p) for p in sorted(paths)]
    if domain == "man":
        paths = [p for n in range(1, 9) for p in (MAN / f"man{n}").glob("*.gz")
                 if p.is_file() and not p.is_symlink() and not p.name.startswith(MAN_SKIP_PREFIX)]
        return [(f"man/{p.relative_to(MAN).as_posix()}", p) for p in sorted(paths)]
    return [(label, p) for label, p in base.corpus_files() if label.startswith("stdlib/") and label.endswith(".py")]


def domain_text(domain: str, path: Path) -> str:
    raw = path.read_bytes()
    if domain == "docs":
        return html_text(raw)
    if domain == "man":
        return roff_text(gzip.decompress(raw))
    return raw.decode("utf-8", errors="replace")


def build_corpus(args):
    """Deterministic (train_docs, heldout_docs, info) over the three domains; info['heldout'] = [(domain, label)]."""
    digest = hashlib.sha256()
    train, heldout, held_labels, per = [], [], [], {}
    for domain in DOMAINS:
        budget = int(getattr(args, f"{domain}_mb") * 1024 * 1024)
        taken, count, first, last = 0, 0, None, None
        for label, path in domain_files(domain):
            if taken >= budget:
                break
            data = base._cut(domain_text(domain, path).encode(), args.max_file_kb * 1024)
            data = base._cut(data, budget - taken) if taken + len(data) > budget else data
            if not data.strip():
                continue
            digest.update(label.encode() + b"\0" + data + b"\0")
            text = data.decode("utf-8", errors="replace")
            if count % args.holdout_every == args.holdout_every // 2:
                heldout.append(text)
                held_labels.append((domain, label))
            else:
                train.append(text)
            taken += len(data)
            count += 1
            first, last = first or label, label
        per[domain] = {"files": count, "bytes": taken, "first": first, "last": last,
                       "heldout_files": sum(1 for d, _ in held_labels if d == domain)}
    info = {"files": len(train) + len(heldout), "train_files": len(train), "heldout_files": len(heldout),
            "bytes": sum(d["bytes"] for d in per.values()), "sha256": digest.hexdigest(), "domains": per,
            "heldout": held_labels, "first": None, "last": None, "licenses": 0,
            "python3_doc": _package_version("python3-doc"), "python3_11_doc": _package_version("python3.11-doc")}
    return train, heldout, info


def _package_version(name: str) -> str | None:
    try:
        done = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def heldout_rows(held_stream, tokenizer, heldout_docs, info, args):
    """One ROW_LEN window from the middle of each held-out document with enough ids; eval: 128 windows spread over all."""
    rows, meta = [], []
    for (domain, label), text in zip(info["heldout"], heldout_docs):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < ROW_LEN:
            continue
        start = (len(ids) - ROW_LEN) // 2
        rows.append(np.asarray(ids[start : start + ROW_LEN], dtype=np.int64))
        meta.append({"row": len(meta), "domain": domain, "document": label, "start": start})
    ids = np.stack(rows)
    eval_ids = base.windows(held_stream, 128, ROW_LEN)
    info["rows_per_domain"] = {d: sum(1 for m in meta if m["domain"] == d) for d in DOMAINS}
    return ids, eval_ids, {"heldout_rows.json": (json.dumps(meta, indent=0) + "\n").encode()}


# -- n-gram baselines ------------------------------------------------------------------------------
def _codes(a: np.ndarray, order: int, vocab: int) -> np.ndarray:
    """Each length-``order`` window of ``a`` as one integer (base ``vocab``)."""
    n = len(a) - order + 1
    c = np.zeros(n, dtype=np.int64)
    for j in range(order):
        c = c * vocab + a[j : j + n]
    return c


def ngram_counts(train_ids: np.ndarray, vocab: int, order: int):
    """Sorted n-gram codes with counts, and sorted context codes with counts, of the training stream."""
    full = _codes(train_ids.astype(np.int64), order, vocab)
    return np.unique(full, return_counts=True), np.unique(full // vocab, return_counts=True), len(train_ids)


def ngram_nll(counts, rows: np.ndarray, vocab: int, order: int, k: float) -> float:
    """Mean NLL (nats) of rows' positions >= order-1 under an add-k n-gram with ``counts`` (:func:`ngram_counts`)."""
    (uf, cf), (uc, cc), n_train = counts
    total, count = 0.0, 0
    for row in rows.astype(np.int64):
        q = _codes(row, order, vocab)
        nf = _lookup(uf, cf, q)
        nc = _lookup(uc, cc, q // vocab) if order > 1 else np.full(len(q), n_train, dtype=np.int64)
        total += float(-np.log((nf + k) / (nc + k * vocab)).sum())
        count += len(q)
    return total / count


def _lookup(keys, counts, q):
    i = np.searchsorted(keys, q)
    i = np.minimum(i, len(keys) - 1)
    return np.where(keys[i] == q, counts[i], 0)


def measure(train_ids, heldout_ids, eval_ids, vocab, args) -> dict:
    """n-gram baselines on the saved held-out rows (their first order-1 positions unscored; k is the best of a grid
    chosen on the held-out rows themselves, which flatters the n-gram), and the saved model's NLL per domain."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = json.loads((args.out / "heldout_rows.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    per_row = _row_nll(model, heldout_ids)  # [rows, positions]: NLL of predicting position j + 1
    groups = {"all": np.arange(len(heldout_ids)), **{d: np.array([r["row"] for r in rows if r["domain"] == d])
                                                    for d in DOMAINS}}
    counts = {order: ngram_counts(train_ids, vocab, order) for order in (1, 2, 3)}
    out = {}
    for name, idx in groups.items():
        if idx.size == 0:
            continue
        sub = heldout_ids[idx]
        fig = {"rows": int(idx.size), "model": float(per_row[idx].mean()), "model_from_pos2": float(per_row[idx, 1:].mean())}
        for order in (1, 2, 3):
            grid = {k: ngram_nll(counts[order], sub, vocab, order, k) for k in (1.0, 0.1, 0.01, 0.001)}
            best = min(grid, key=grid.get)
            fig[f"ngram{order}"] = {"k": best, "nll": grid[best], "grid": grid}
        out[name] = fig
    return {"nll_by_domain": out}


def _row_nll(model, ids: np.ndarray) -> np.ndarray:
    """Per row and position j: the NLL of token j + 1 given tokens ..j (one forward per batch of 16 rows)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(ids), 16):
            x = torch.from_numpy(ids[i : i + 16])
            logits = model(input_ids=x, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
            out.append(nll.numpy())
    return np.concatenate(out).astype(np.float64)


# -- main -------------------------------------------------------------------------------------------
def make_parser():
    ap = base.make_parser()
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--docs-mb", type=float, default=5.0, help="python3-doc text budget (MB)")
    ap.add_argument("--man-mb", type=float, default=2.0, help="man-page text budget (MB)")
    ap.add_argument("--code-mb", type=float, default=5.0, help="stdlib source budget (MB)")
    ap.set_defaults(out=DEFAULT_OUT, experts=64, top_k=8, layers=8, hidden=128, intermediate=64, heads=4, vocab=4096,
                    holdout_every=10, batch=8, seq=256, warmup=50, corpus_mb=None,
                    experts_impl="grouped_mm")
    return ap


def readme(f: dict, report: dict | None, args) -> str:
    from readme_olmoe64 import render  # the README text lives beside this file

    return render(f, report, args, DOMAINS)


RECIPE = base.Recipe(script="tools/train_olmoe64.py", parser=make_parser, corpus=build_corpus, heldout=heldout_rows,
                     readme=readme, measure=measure)


if __name__ == "__main__":
    sys.exit(base.main(recipe=RECIPE))
