"""tools/train_olmoe64.py's corpus rules and its n-gram baseline, on inputs written here: the README's
"beats the best n-gram" claim rests on them. The n-gram is checked against a dictionary count."""

from __future__ import annotations

import gzip
import math
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
train = pytest.importorskip("train_olmoe64", reason="tools/train_olmoe64.py needs its base module's imports")


def test_html_text_keeps_the_main_body_only():
    page = b"""<html><body><div class="nav">Navigation junk</div>
    <div role="main"><h1>Title<a class="headerlink" href="#t">\xc2\xb6</a></h1>
    <p>Some   spaced
    words &amp; more.</p><pre>def f():
        return 1</pre><div><p>nested</p></div></div>
    <div role="main"><p>a second main div is ignored</p></div><p>footer</p></body></html>"""
    text = train.html_text(page)
    assert "Navigation" not in text and "footer" not in text and "second main" not in text
    assert "\u00b6" not in text  # the permalink mark is dropped
    lines = [line for line in text.splitlines() if line]
    assert lines[0] == "Title" and lines[1] == "Some spaced words & more."
    assert "def f():\n        return 1" in text  # <pre> keeps its layout
    assert "nested" in text and text.endswith("\n")
    assert train.html_text(b"<html><p>no main div</p></html>") == ""


def test_roff_text_drops_requests_and_escapes():
    src = "\n".join([
        '.\\" a comment', ".TH LS 1", ".SH NAME", "ls \\- list directory contents", ".SH SYNOPSIS",
        ".B ls", "[\\fIOPTION\\fR]... [\\fIFILE\\fR]...", ".PP", "It\\(aqs \\(lqquoted\\(rq \\(em done.", ".br",
    ])
    text = train.roff_text(src.encode())
    assert "comment" not in text and "TH" not in text and ".PP" not in text
    assert "ls - list directory contents" in text
    assert "[OPTION]... [FILE]..." in text and "It's \"quoted\" -- done." in text
    assert "\nSYNOPSIS" in text and "\\" not in text
    assert train.roff_text(gzip.decompress(gzip.compress(src.encode()))) == text


def _dict_ngram_nll(train_ids, rows, vocab, order, k):
    full = Counter(tuple(train_ids[i:i + order]) for i in range(len(train_ids) - order + 1))
    ctx = Counter()
    for g, c in full.items():
        ctx[g[:-1]] += c
    total, n = 0.0, 0
    for row in rows:
        for i in range(len(row) - order + 1):
            g = tuple(row[i:i + order])
            nc = ctx[g[:-1]] if order > 1 else len(train_ids)
            total -= math.log((full[g] + k) / (nc + k * vocab))
            n += 1
    return total / n


@pytest.mark.parametrize("order", [1, 2, 3])
def test_ngram_nll_equals_a_dictionary_count(order):
    rng = np.random.default_rng(order)
    vocab = 7
    train_ids = rng.integers(0, vocab, 400)
    rows = rng.integers(0, vocab, (5, 30))
    counts = train.ngram_counts(train_ids, vocab, order)
    for k in (0.01, 0.5, 1.0):
        assert train.ngram_nll(counts, rows, vocab, order, k) == pytest.approx(
            _dict_ngram_nll(train_ids.tolist(), rows.tolist(), vocab, order, k), rel=1e-12)
    # an add-k model is a distribution: over every next token of one context its probabilities sum to 1
    (uf, cf), (uc, cc), _ = counts
    ctx = train_ids[:order - 1].astype(np.int64)
    code = 0
    for t in ctx:
        code = code * vocab + int(t)
    nc = train._lookup(uc, cc, np.array([code]))[0] if order > 1 else len(train_ids)
    probs = [(train._lookup(uf, cf, np.array([code * vocab + t]))[0] + 0.5) / (nc + 0.5 * vocab) for t in range(vocab)]
    assert sum(probs) == pytest.approx(1.0, abs=1e-12)


def test_codes_are_base_vocab_windows():
    a = np.array([1, 2, 3, 0, 4])
    assert train._codes(a, 2, 5).tolist() == [1 * 5 + 2, 2 * 5 + 3, 3 * 5 + 0, 0 * 5 + 4]
    assert train._codes(a, 1, 5).tolist() == a.tolist()
