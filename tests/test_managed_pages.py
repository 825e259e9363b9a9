"""The ``managed`` pool's pages, on a made-up GGUF geometry (no file, no llama.cpp): which pages an
expert's slices cover, which partial pages it shares and with whom, and that dropping victims as
the advisor does keeps the page cache within the residents' accounted bytes while never dropping a
page a resident or a dense tensor still uses (llama/advice.py: ``managed_item_bytes``,
``EdgePages``; formats/gguf.py: ``compute_ranges``)."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.formats.gguf import Geometry, TensorInfo
from expertcache.llama.advice import DENSE, PAGE, EdgePages, managed_budget, managed_item_bytes

E = 4


def geometry(slice_bytes=(6000, 6000, 9000), start=100, dense_between=700) -> Geometry:
    """Two MoE layers of E experts; each layer a small dense tensor (a router) then its three expert
    tensors in the file order of a quantized file (down, gate, up), packed without page alignment."""
    tensors, experts, off = {}, {}, start
    for layer in (0, 1):
        t = TensorInfo(f"blk.{layer}.ffn_gate_inp.weight", (8, E), 0, off, dense_between, "f32")
        tensors[t.name], off = t, off + dense_between
        experts[layer] = {}
        for kind, n in zip(("ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"), slice_bytes):
            t = TensorInfo(f"blk.{layer}.{kind}", (n, E), 8, off, n * E, "q4_K")
            tensors[t.name], experts[layer][kind], off = t, t, off + n * E
    return Geometry(path="made-up.gguf", file_bytes=off, architecture="qwen3moe", num_experts=E, top_k=2,
                    num_layers=2, moe_layers=[0, 1], experts=experts, tensors=tensors, metadata={})


def pages(off: int, n: int) -> set[int]:
    return set(range(off // PAGE * PAGE, off + n, PAGE))


def test_compute_ranges_are_gate_up_down_by_expert_id():
    g = geometry()
    got = g.compute_ranges(0, [3, 1])
    want = [r for kind in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
            for e in (1, 3) for r in [(g.experts[0][kind].offset + e * (g.experts[0][kind].nbytes // E),
                                       g.experts[0][kind].nbytes // E)]]
    assert got == want
    assert sorted(got) == sorted(r for e in (1, 3) for r in g.expert_ranges(0, e))


def test_item_bytes_are_the_pages_its_slices_cover():
    g = geometry()
    items = managed_item_bytes(g)
    for j in (0, 1):
        for e in range(E):
            want = sum(len(pages(off, n)) * PAGE for off, n in g.expert_ranges(j, e))
            assert items[j * E + e] == want
    assert managed_budget(g, None) == items.sum()
    wall = g.dense_bytes + 5 * int(items.max())
    assert managed_budget(g, wall) == 5 * int(items.max())  # the wall less the dense part


def test_edge_owners_by_brute_force():
    g = geometry()
    edges = EdgePages(g)
    spans = [(off, n, j * E + e) for j in (0, 1) for e in range(E) for off, n in g.expert_ranges(j, e)]
    spans += [(t.offset, t.nbytes, DENSE) for t in g.dense_tensors]
    for item in range(2 * E):
        mine = [(off, n) for off, n, who in spans if who == item]
        want = {}
        for off, n in mine:
            for p in sorted(pages(off, n)):
                if p < off or p + PAGE > off + n:  # a partial page
                    want[p] = tuple(sorted({who for o, m, who in spans if who != item and pages(o, m) & {p}}))
        assert dict(edges.edges.get(item, [])) == want


@pytest.mark.parametrize("seed", range(5))
def test_drops_keep_the_cache_within_the_residents_pages(seed):
    """LRU-like random residency changes carried out page by page as the advisor does (a load reads
    the pages its slices cover; a victim drops the whole pages inside its slices, then its partial
    pages that no resident and no dense tensor shares): every page a resident or a dense tensor
    covers stays, and every cached page is one of theirs, so the cache is within the residents'
    ``managed_item_bytes`` plus the dense pages."""
    g = geometry()
    edges, items = EdgePages(g), managed_item_bytes(g)
    rng = np.random.default_rng(seed)
    cover = {j * E + e: set().union(*(pages(off, n) for off, n in g.expert_ranges(j, e))) for j in (0, 1) for e in range(E)}
    dense = set().union(*(pages(t.offset, t.nbytes) for t in g.dense_tensors))
    cached, resident = set(dense), np.zeros(2 * E, dtype=bool)
    for _ in range(200):
        item = int(rng.integers(2 * E))
        if resident[item]:
            resident[item] = False
            j, e = divmod(item, E)
            for off, n in g.expert_ranges(j, e):
                lo, hi = -(-off // PAGE) * PAGE, (off + n) // PAGE * PAGE
                cached -= set(range(lo, hi, PAGE))
            cached -= set(edges.droppable(item, lambda xs: resident[np.asarray(xs)]))
        else:
            resident[item] = True
            cached |= cover[item]
        held = dense.union(*(cover[i] for i in np.flatnonzero(resident)))
        assert held <= cached, "a page a resident or a dense tensor uses was dropped"
        assert cached <= held, "a page nobody holds stayed"
        assert len(cached - dense) * PAGE <= items[resident].sum()


def test_mlock_refused_for_memory_is_tried_again(monkeypatch):
    """On a v1 memory cgroup at its limit mlock's own kernel memory fails to charge (ENOMEM) instead
    of waiting; the lock is tried again until the wall's next limit gives room, and a refusal that
    lasts, or of another kind, fails in one line."""
    import ctypes
    import errno

    from expertcache.errors import ConfigError
    from expertcache.llama import advice

    buf = np.zeros(4 * PAGE, dtype=np.uint8)
    addr = (buf.ctypes.data + PAGE - 1) // PAGE * PAGE  # one whole page inside the buffer
    calls = []

    def refusing(n, code):
        def lock(lo, length, flags):
            calls.append(lo)
            if len(calls) <= n:
                ctypes.set_errno(code)
                return -1
            return 0
        return lock

    monkeypatch.setattr(advice, "_mlock2", refusing(2, errno.ENOMEM))
    advice.mlock(addr, PAGE)
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(advice, "MLOCK_RETRY_S", 0.02)
    monkeypatch.setattr(advice, "_mlock2", refusing(10**9, errno.ENOMEM))
    with pytest.raises(ConfigError, match="mlock of 4096 bytes failed: Cannot allocate memory"):
        advice.mlock(addr, PAGE)
    calls.clear()
    monkeypatch.setattr(advice, "_mlock2", refusing(10**9, errno.EPERM))
    with pytest.raises(ConfigError, match="Operation not permitted"):
        advice.mlock(addr, PAGE)
    assert len(calls) == 1
