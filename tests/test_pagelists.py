"""The kernel's two file lists (``expertcache.llama.pagelists``): the compiled loop against a
reference written here on ordered dicts, and the behaviour the forecast relies on."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from expertcache.llama.pagelists import GIB, _ratio, two_lists


def two_lists_ref(groups, capacity: int, sizes, dense: int, referenced: bool) -> tuple[int, int]:
    """``(read, fill)`` by the rules of the module docstring, from scratch: ordered dicts oldest first."""
    n = len(sizes)
    state = [0] * n  # 0 out, 1 inactive, 2 active
    young, marked, used = [False] * n, [False] * n, [False] * n
    shadow = [None] * n
    inactive, active = OrderedDict(), OrderedDict()
    b = {"inactive": 0, "active": dense, "age": 0}

    def put(u, where):
        state[u] = where
        (active if where == 2 else inactive)[u] = True
        b["active" if where == 2 else "inactive"] += sizes[u]
        if where == 2:
            b["age"] += sizes[u]

    def reclaim():
        while b["inactive"] + b["active"] > capacity:
            gib = (b["inactive"] + b["active"]) // GIB
            ratio = math.isqrt(10 * gib) if gib else 1
            if active and b["inactive"] * ratio < b["active"]:
                u, _ = active.popitem(last=False)
                b["active"] -= sizes[u]
                young[u] = False
                put(u, 1)
                continue
            if not inactive:
                return
            u, _ = inactive.popitem(last=False)
            b["inactive"] -= sizes[u]
            if young[u] and marked[u]:
                young[u] = False
                put(u, 2)
            elif young[u]:
                young[u], marked[u] = False, True
                put(u, 1)
            else:
                state[u] = 0
                shadow[u] = b["age"]
                b["age"] += sizes[u]

    for u in range(n):
        put(u, 2)
        reclaim()
    read = fill = 0
    for items, counted in groups:
        for u in items:
            if state[u]:
                young[u] = young[u] or referenced
                used[u] = True
                continue
            if counted:
                read += sizes[u]
                fill += 0 if used[u] else sizes[u]
            used[u] = True
            put(u, 2 if shadow[u] is not None and b["age"] - shadow[u] <= b["active"] else 1)
            young[u], marked[u] = referenced, False
            reclaim()
            assert b["inactive"] + b["active"] <= capacity or dense > capacity  # the invariant
    return read, fill


def test_ratio_is_the_kernels():
    """inactive_is_low: 1 below 1 GiB of file pages, isqrt(10 * GiB) from there."""
    assert [_ratio(x) for x in (0, GIB - 1, GIB, 2 * GIB + 5, 4 * GIB, 10 * GIB, 100 * GIB)] == [1, 1, 3, 4, 6, 10, 31]


def test_the_load_leaves_the_files_tail():
    """The replay starts where a run does, the file just loaded: every item fits, nothing is read;
    otherwise the file's first items are gone (read on first use) and its last are held."""
    sizes = [10] * 10
    stream = [([u], True) for u in range(10)]
    assert two_lists(stream, 100, sizes, 0, False) == (0, 0)
    assert two_lists([([0], True)], 50, sizes, 0, False) == (10, 10)
    assert two_lists([([9], True)], 50, sizes, 0, False) == (0, 0)
    # the dense part is held beside the experts: it takes their room
    assert two_lists([([9], True)], 50, sizes, 45, False) == (10, 10)


def test_a_fill_is_a_first_use_and_uncounted_groups_read_nothing():
    sizes = [10] * 6
    stream = [([0], False), ([1, 2], True), ([0, 1], True), ([3], True)]
    read, fill = two_lists(stream, 30, sizes, 0, False)
    assert (read, fill) == two_lists_ref(stream, 30, sizes, 0, False)
    assert fill <= read and fill == 20 + 10  # items 1, 2 and 3 first used while counted, all missed
    assert two_lists([([0, 1, 2], False)], 30, sizes, 0, False) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_compiled_equals_reference(data):
    n = data.draw(st.integers(1, 24))
    scale = data.draw(st.sampled_from([1, 4096, 300 << 20]))  # the last crosses 1 GiB: ratios above 1
    sizes = [scale * data.draw(st.integers(1, 6)) for _ in range(n)]
    capacity = data.draw(st.integers(0, sum(sizes) + 2 * scale))
    dense = data.draw(st.integers(0, 2 * scale))
    referenced = data.draw(st.booleans())
    groups = data.draw(st.lists(st.tuples(st.lists(st.integers(0, n - 1), max_size=5, unique=True), st.booleans()),
                                max_size=60))
    got = two_lists([(np.asarray(g, dtype=np.int64), c) for g, c in groups], capacity, sizes, dense, referenced)
    assert got == two_lists_ref(groups, capacity, sizes, dense, referenced)


def test_chunks_change_nothing(monkeypatch):
    """The compiled loop takes the accesses in chunks, its state kept between them."""
    import expertcache.llama.pagelists as pl

    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 5, size=50) * 4096
    stream = [(rng.choice(50, size=4, replace=False), bool(rng.random() < 0.8)) for _ in range(400)]
    whole = pl.two_lists(stream, int(sizes.sum()) // 3, sizes, 8192, True)
    monkeypatch.setattr(pl, "CHUNK", 7)
    assert pl.two_lists(stream, int(sizes.sum()) // 3, sizes, 8192, True) == whole
    assert whole == two_lists_ref([(g.tolist(), c) for g, c in stream], int(sizes.sum()) // 3, sizes.tolist(), 8192,
                                  True)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
