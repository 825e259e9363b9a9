"""``SizedCache`` (a byte capacity over items of different sizes, for GGUFs whose expert tensors differ
in type by layer) against two independent references: ``ExpertCache`` when every size is equal
(every registered rule that runs online or with a recorded future, with prefetches in between), and a
byte-LRU written here from scratch when sizes differ."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from expertcache.cache import ExpertCache, SizedCache
from expertcache.errors import ConfigError
from expertcache.policies import StreamFuture, available_policies, make_policy


def _rules() -> list[str]:
    out = []
    for name in available_policies():
        try:
            pol = make_policy(name)
        except Exception:  # noqa: BLE001 - a rule that needs an argument file (learned:PATH) is not made bare
            continue
        if pol.admits and not pol.wants_context:  # not static (no cache rule) nor router-logit (reads router rows)
            out.append(name)
    return out


def _groups(rng, steps: int, n_items: int, k: int) -> np.ndarray:
    hot = rng.choice(n_items, size=max(k, n_items // 3), replace=False)
    rows = []
    for _ in range(steps):
        pool = hot if rng.random() < 0.7 else np.arange(n_items)
        rows.append(rng.choice(pool, size=k, replace=False))
    return np.asarray(rows, dtype=np.int64)


@pytest.mark.parametrize("rule", _rules())
def test_equal_sizes_decide_exactly_as_the_slot_cache(rule):
    rng = np.random.default_rng(7)
    n_items, C, k, size = 24, 7, 3, 4096
    for trial in range(3):
        groups = _groups(rng, 120, n_items, k)
        future = StreamFuture(groups) if make_policy(rule).needs_future else None
        a = ExpertCache(C, rule, n_items, future=future)
        b = SizedCache(C * size + (0, size - 1, size // 2)[trial], rule, np.full(n_items, size), future=future)  # < one more item
        for t, g in enumerate(groups):
            if t % 17 == 5:  # a prefetch between steps: unused ones are evicted first
                want = rng.choice(n_items, size=2, replace=False)
                pa, pb = a.prefetch(want), b.prefetch(want)
                assert pa.hits == pb.hits and [i for i, _ in pa.loads] == [i for i, _ in pb.loads]
                assert sorted(pa.evicted) == sorted(pb.evicted)
            sa, sb = a.prepare(g), b.prepare(g)
            assert sa.hits == sb.hits, (rule, t)
            assert [i for i, _ in sa.loads] == [i for i, _ in sb.loads], (rule, t)
            assert sa.evicted == sb.evicted, (rule, t)
            assert np.array_equal(a.resident, b.resident)
            assert b.used_bytes == b.resident.size * size <= b.capacity_bytes
        assert (a.copies, a.evictions, a.prefetch_hits, a.prefetch_wasted) == \
               (b.copies, b.evictions, b.prefetch_hits, b.prefetch_wasted)


def _byte_lru(groups, sizes, capacity):
    """A byte-capacity LRU from scratch: hit refreshes; a miss evicts the least recently used item
    outside the group (ties: smallest id) until it fits."""
    od: OrderedDict[int, int] = OrderedDict()  # item -> last step, oldest first
    used, hits, evicted = 0, 0, []
    for t, g in enumerate(groups):
        g = sorted(int(x) for x in g)
        for e in g:
            if e in od:
                hits += 1
        missing = [e for e in g if e not in od]
        need = used + sum(sizes[e] for e in missing) - capacity
        if need > 0:
            order = sorted((last, item) for item, last in od.items() if item not in g)
            for last, item in order:
                if need <= 0:
                    break
                del od[item]
                used -= sizes[item]
                need -= sizes[item]
                evicted.append(item)
        for e in missing:
            used += sizes[e]
        for e in g:
            od[e] = t
        assert used <= capacity
    return hits, evicted


def test_different_sizes_equal_a_byte_lru_written_here():
    rng = np.random.default_rng(3)
    n_items = 40
    for trial in range(5):
        sizes = rng.choice([3, 4, 5, 9], size=n_items)  # Q4_K / Q6_K-like ratios and odd ones
        capacity = int(sizes.sum() * rng.uniform(0.2, 0.6))
        groups = _groups(rng, 200, n_items, 4)
        cache = SizedCache(capacity, "lru", sizes)
        hits, evicted = 0, []
        for g in groups:
            s = cache.prepare(g)
            hits += s.hits
            evicted += s.evicted
            assert cache.used_bytes == int(sizes[cache.resident].sum()) <= capacity
            assert set(g.tolist()) <= set(cache.resident.tolist())
        assert (hits, evicted) == _byte_lru(groups, sizes, capacity)


def test_refusals():
    with pytest.raises(ConfigError, match="below the largest item"):
        SizedCache(5, "lru", [3, 6])
    cache = SizedCache(10, "lru", [4, 4, 4])
    with pytest.raises(ConfigError, match="12 bytes requested at once"):
        cache.prepare([0, 1, 2])
    with pytest.raises(ConfigError, match="distinct"):
        cache.prepare([1, 1])


def test_sizes_capacities_and_ids_are_integers():
    """A size of 1.5 had been truncated to 1, a NaN capacity passed the comparison with the largest
    item (then failed inside numpy), and ``prepare`` had dropped -5 as padding, truncated 1.7 to 1
    and raised IndexError on an id past the last item: it checks as ExpertCache.prepare does."""
    for capacity in (float("nan"), 10.0, True, 0, "10", 2**70):
        with pytest.raises(ConfigError, match="capacity_bytes must be an integer"):
            SizedCache(capacity, "lru", [3, 4])
    for sizes in ([1.5, 2], [3, [4]], np.array([2**64 - 1], dtype=np.uint64), [2**70], ["3"]):
        with pytest.raises(ConfigError, match="item_bytes must be"):
            SizedCache(10, "lru", sizes)
    cache = SizedCache(10, "lru", [3, 4, 5])
    for items in ([-5, 1], [1.7], [3], [True], [2**63]):
        with pytest.raises(ConfigError, match="prepare: "):
            cache.prepare(items)
        with pytest.raises(ConfigError, match="prefetch: "):
            cache.prefetch(items)
    assert cache.prepare([-1, 2]).loads == [(2, 0)] and cache.slot_of(2) == 0 and cache.slot_of(1) == -1


@pytest.mark.parametrize("rule", _rules())
def test_a_step_of_hits_alone_decides_as_the_full_step(rule):
    """The fast path of a step whose items are all resident (and none an unused prefetch) skips the
    victim search: it must decide exactly as the full step, slot and byte caches alike, on a stream
    with many such steps and with prefetches in between (the full step forced by clearing the flag)."""
    rng = np.random.default_rng(11)
    n_items, C, k = 20, 12, 3
    sizes = rng.choice([3, 4, 5], size=n_items)
    groups = _groups(rng, 300, n_items, k)
    future = StreamFuture(groups) if make_policy(rule).needs_future else None
    makers = (lambda: ExpertCache(C, rule, n_items, future=future),
              lambda: SizedCache(int(sizes.sum() * 0.6), rule, sizes, future=future))
    for make in makers:
        fast, full = make(), make()
        full._all_hit_fast = False
        taken = 0
        for t, g in enumerate(groups):
            if t % 13 == 4:
                want = rng.choice(n_items, size=2, replace=False)
                pf, pu = fast.prefetch(want), full.prefetch(want)
                assert (pf.hits, pf.loads, pf.evicted) == (pu.hits, pu.loads, pu.evicted), (rule, t)
            taken += fast._all_hit_fast and fast._all_resident(np.asarray(g, dtype=np.int64))
            sf, su = fast.prepare(g), full.prepare(g)
            assert (sf.hits, sf.loads, sf.evicted) == (su.hits, su.loads, su.evicted), (rule, t)
            assert np.array_equal(sf.slots, su.slots) and np.array_equal(fast.resident, full.resident)
        assert (fast.copies, fast.evictions, fast.prefetch_hits, fast.prefetch_wasted, fast.prefetch_pending) == \
               (full.copies, full.evictions, full.prefetch_hits, full.prefetch_wasted, full.prefetch_pending)
        assert taken >= 30 or make_policy(rule).hooked, (rule, taken)  # the stream did exercise the fast path


def test_a_rule_that_overrides_a_miss_hook_is_told_of_every_step():
    """A rule whose on_miss / on_evict / on_admit is its own is told of every step, the steps of hits
    alone included (with empty sets), as the hooks' contract says; the fast path is for the base no-ops."""
    from expertcache.policies.lru import LRU

    class Told(LRU):
        name = "told-test"

        def reset(self, n_items, future=None, steps_per_token=1):
            super().reset(n_items, future, steps_per_token)
            self.told = []

        def on_miss(self, items, t):
            self.told.append((t, np.asarray(items).tolist()))

    cache = ExpertCache(4, Told(), 8)
    assert not cache._all_hit_fast
    for g in ([0, 1], [0, 1], [2, 3], [0, 1]):
        cache.prepare(g)
    assert cache.policy.told == [(0, [0, 1]), (1, []), (2, [2, 3]), (3, [])]
    assert ExpertCache(4, "lru", 8)._all_hit_fast
