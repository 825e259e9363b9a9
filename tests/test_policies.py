"""Policies by name, their specs, the recorded future, and the cache step the harnesses drive."""

from __future__ import annotations

import re

import numpy as np
import pytest

import expertcache as ec
from expertcache.errors import PolicyError
from expertcache.policies import NEVER


@pytest.mark.parametrize(
    "spec, canonical",
    [("lru", "lru"), ("LFU", "lfu"), ("decayed", "decayed:0.95"), ("decayed:0.9", "decayed:0.9"),
     ("belady", "belady"), ("foresight:16", "foresight:16"), ("foresight", "foresight:16"),
     ("mean-interval", "mean-interval"), ("random", "random:0"), ("random:7", "random:7")],
)
def test_specs_round_trip(spec, canonical):
    p = ec.make_policy(spec)
    assert p.spec == canonical
    assert ec.make_policy(p.spec).spec == canonical


@pytest.mark.parametrize(
    "spec, message",
    [("fifo", "unknown policy 'fifo'"), ("lru:3", "takes no parameter"), ("decayed:0", "outside (0.0, 1.0]"),
     ("decayed:abc", "expected a number"), ("foresight:-1", "below 0"), ("", "expected a name")],
)
def test_bad_specs(spec, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        ec.make_policy(spec)


def test_registry_lists_the_rules():
    assert {"lru", "lfu", "decayed", "belady", "foresight", "mean-interval", "random"} <= set(ec.available_policies())


def test_clairvoyant_policy_needs_a_future():
    with pytest.raises(PolicyError, match="needs the recorded future"):
        ec.ExpertCache(2, "belady", 4)


def test_stream_future_next_use():
    groups = np.array([[0, 1], [2, -1], [0, 3], [1, 2]])
    f = ec.StreamFuture(groups)
    assert f.next_use(np.array([0, 1, 2, 3]), 0).tolist() == [2, 3, 1, 2]
    assert f.next_use(np.array([0, 3, 2]), 2).tolist() == [NEVER, NEVER, 3]
    assert f.next_use(np.array([5]), 0).tolist() == [NEVER]


def test_cache_step_reuses_the_victims_slot_and_reports_fill():
    cache = ec.ExpertCache(2, "lru", 5)
    s = cache.prepare([3, 1])
    assert s.loads == [(1, 0), (3, 1)] and s.evicted == [] and s.hits == 0 and cache.filling is False
    s = cache.prepare([1])
    assert s.hits == 1 and s.loads == [] and s.slots.tolist() == [0]
    s = cache.prepare([4, 1])  # 3 is the least recently used non-requested resident
    assert s.evicted == [3] and s.loads == [(4, 1)] and cache.slot_of(3) == -1
    assert cache.copies == 3 and cache.evictions == 1
    with pytest.raises(ec.ConfigError, match="capacity is 2"):
        cache.prepare([0, 2, 3])
    cache.reset()
    assert cache.resident.size == 0 and cache.t == 0 and cache.filling


def test_ties_break_by_least_recent_then_smallest_id():
    # lfu: 2 and 0 both used once; 0 used earlier -> evicted first
    cache = ec.ExpertCache(3, "lfu", 8)
    for g in ([0], [2], [5], [5], [7]):
        step = cache.prepare(g)
    assert step.evicted == [0]
    # equal last use: smallest id goes
    cache = ec.ExpertCache(2, "lru", 8)
    cache.prepare([6, 4])
    assert cache.prepare([1]).evicted == [4]


@pytest.mark.parametrize("spec, says", [
    ("dwell:8", "is a set-holding rule"), ("controller:heads.pt:0.5", "is a set-holding rule"),
    ("static:32", "in replay and sweep, 'static' is the pin set with bypass"), ("prefix:32", "is a set-holding rule"),
])
def test_a_rule_of_another_kind_is_named_as_such(spec, says):
    """'static' means the pin set with bypass where eviction rules run (static:P, the old spelling of the
    set-holding prefix:P, says so): a string of the wrong kind says which kind it is and where it runs."""
    with pytest.raises(PolicyError, match=re.escape(says)):
        ec.make_policy(spec)


def test_eval_static_without_p_says_where_plain_static_runs():
    from expertcache.hf.holding import parse_holding

    with pytest.raises(PolicyError, match="plain 'static', runs in replay and sweep"):
        parse_holding("static")


def test_the_step_by_step_cache_refuses_what_replay_refuses():
    """ExpertCache had converted what replay() refuses: capacity 2.5 became 2 and True 1, an id -5
    was dropped as padding, 1.7 truncated to 1, a uint64 2**64 - 1 wrapped to -1; and a capacity of
    2**24 built 16 M free slots at every reset (1.4 GB) for 8 items."""

    for args in ((2.5, "lru", 8), (True, "lru", 8), ("3", "lru", 8), (0, "lru", 8), (4, "lru", 0),
                 (4, "lru", 2**40), (2**63, "lru", 8)):
        with pytest.raises(ec.ConfigError, match="must be an integer in"):
            ec.ExpertCache(*args)
    c = ec.ExpertCache(2, "lru", 8)
    for items in ([-5, 1], [1.7, 2.2], np.array([2**64 - 1], dtype=np.uint64), ["1"], [2**63], [8]):
        with pytest.raises(ec.ConfigError, match="prepare: "):
            c.prepare(items)
    with pytest.raises(ec.ConfigError, match="slot_of: "):
        c.slot_of(100)
    assert c.prepare([-1, 3]).hits == 0 and c.slot_of(3) >= 0
    big = ec.ExpertCache(np.int64(2**24), "lru", 8)
    big.reset()
    assert len(big._free) == 8  # the slots 8 items can use, not 2**24 of them


def test_every_method_of_the_cache_checks_its_ids_as_prepare_does():
    """slot_of(-1) had read the last item's slot and slot_of((1, 2)) item 1's; slots_of and prefetch
    had truncated 1.5 to 1, prefetch had dropped an id past n_items and slots_of raised IndexError on
    it; steps_per_token took 0, -1, 2.5 and True (the policies' clock)."""
    c = ec.ExpertCache(2, "lru", 8)
    c.prepare([7])
    assert c.slot_of(7) >= 0 and c.slot_of(-1) == -1 and c.slot_of(np.int64(6)) == -1
    for item in ((1, 2), [], 1.0, True, 8, -2, None, "1", 2**70):
        with pytest.raises(ec.ConfigError, match="slot_of: "):
            c.slot_of(item)
    assert c.slots_of(np.array([[7, -1], [3, 7]])).tolist() == [[c.slot_of(7), -1], [-1, c.slot_of(7)]]
    for method in ("slots_of", "prefetch"):
        for items in ([8], [1.5], [-2], [True], [[1], [2, 3]], np.array([2**64 - 1], dtype=np.uint64), [2**70]):
            with pytest.raises(ec.ConfigError, match=f"{method}: "):
                getattr(c, method)(items)
    assert c.prefetch([3, -1, 3, 4]).loads == [(3, c.slot_of(3)), (4, c.slot_of(4))]
    for steps in (0, -1, 2.5, True, "2", float("inf")):
        with pytest.raises(ec.ConfigError, match="steps_per_token must be an integer"):
            ec.ExpertCache(2, "lru", 8, steps_per_token=steps)


@pytest.mark.parametrize("cls, arg, good", [
    ("decayed", "beta", 0.5), ("foresight", "horizon", 3), ("random", "seed", 7)])
def test_a_rules_constructor_checks_its_parameter_as_its_string_does(cls, arg, good):
    """Decayed(2.5) had been taken (a negative decay rate: a silent wrong order), as had Decayed(nan)
    and Foresight(-1); Random(2.5) was truncated to seed 2; Random(10**30) and Foresight(inf) ended
    as OverflowError. The constructor now checks what ``name:value`` checks, with the same words."""
    from expertcache.policies.registry import _REGISTRY

    rule = _REGISTRY[cls]
    made = rule(**{arg: good})
    assert ec.make_policy(made.spec).spec == made.spec == f"{cls}:{good:g}"
    for bad in (2.5, -1, float("nan"), float("inf"), True, None, "x", [1], 10**30, -(10**5000)):
        with pytest.raises(PolicyError, match=f"{cls}:"):
            rule(**{arg: bad})
        if isinstance(bad, (int, float)) and not isinstance(bad, bool) and abs(bad) < 1e300:
            with pytest.raises(PolicyError, match=f"{cls}:"):
                ec.make_policy(f"{cls}:{bad}")


def test_register_refuses_a_name_make_policy_could_never_find():
    """make_policy looks names up lower-cased and splits arguments at ':': "MyMRU" had been
    registered, then refused as "unknown policy 'MyMRU' (known: MyMRU, ...)"."""
    from expertcache.policies import register
    from expertcache.policies.lru import LRU

    before = ec.available_policies()
    for name in ("MyMRU", "a:b", "dwell", "", "?", "9lives", None):
        cls = type("Bad", (LRU,), {"name": name})
        with pytest.raises(ValueError, match="policy name"):
            register(cls)
    with pytest.raises(TypeError, match="expected a Policy subclass"):
        register(5)
    assert ec.available_policies() == before
