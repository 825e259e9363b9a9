"""One conformance suite for every registered rule, found in the registry at collection time (as
scikit-learn's ``check_estimator`` checks every estimator): a rule registered with ``@register`` gets
every check below without an edit here.

Checks, each parametrized by rule name (``available_policies()``):

* ``test_kind``: the parse gives one of :data:`~expertcache.policies.KINDS`, the same as ``kind_of``
  and as the rule object's ``admits``; a filter without that kind is one line naming it;
* ``test_canonical_round_trip``: the canonical string parses to the same :class:`PolicySpec` and
  rule, any case of the name gives it, clones are fresh objects;
* ``test_seed_three_token_case``: the seeds' case (C=3, {a,b},{c,d},{a,b}: 5 copies, 2 steady) on
  every engine the rule has (every eviction rule is lossless and protects the current group);
* ``test_compiled_equals_reference``: the compiled plan and the Python reference (ExpertCache
  driving the policy object) give equal counts, per layer, on small random token-grouped traces
  (both pools, sequences, padding, warm windows, second-request admission), a synthetic OLMoE
  trace (real-ish: calibrated locality, k = 8 of 64) and a k = 1 trace carried over (reset none);
* ``test_counts_equal_libcachesim``: where libCacheSim implements the same rule, its miss counts on
  k = 1 traces equal our copies (libCacheSim is a test dependency: skipped without it).

What a rule cannot run is declared below with its reason (``NO_COMPILED``, ``NO_REFERENCE``,
``NO_LIBCACHESIM``; a rule that needs an argument to be built, in ``SPECS``), never dropped: a
registered rule missing from both ``LIBCACHESIM`` and ``NO_LIBCACHESIM``, or one whose bare name
does not build and has no ``SPECS`` entry, fails; a declaration that is no longer true fails too.
"""

from __future__ import annotations

import re
from dataclasses import astuple

import numpy as np
import pytest

import expertcache as ec
from expertcache.errors import ConfigError, PolicyError
from expertcache.policies import KINDS, available_policies, kind_of, make_policy, parse_policy

RULES = available_policies()
"""Every registered rule (the package's module scan registers them all on import)."""

# -- declarations: how to build a rule, and what it cannot run (with why) -----------------------------
SPECS = {
    "learned": lambda files: [f"learned:{files['scorer']}"],
}
"""Rules whose bare name does not build (a required argument): ``files -> spec strings`` (``files``:
paths the ``files`` fixture made). Every other rule is checked as its bare name."""

EXAMPLES = {
    "decayed": ["decayed:0.5"],
    "foresight": ["foresight:0", "foresight:2"],
    "random": ["random:3"],
}
"""Further parameter values checked besides the bare name (the cases the hand lists had)."""


def _learned_reference(policy):
    from expertcache.policies.learned import Learned

    return Learned(policy.scorer, policy.path, reference=True)


REFERENCE = {"learned": _learned_reference}
"""A second Python path, where the Python engine's own one is not the independent reference:
learned's follows the stream with the compiled LiveFeatures; ``reference=True`` with FeatureState."""

NO_COMPILED = {
    "router-logit": "no compiled plan: it reads the stream context (the current router rows) step by step, "
                    "on the Python engine only",
}
NO_REFERENCE = {
    "static": "no Python reference: a pin table, not a rule a cache consults (no keys); it runs only as the "
              "simulator's plan",
}
LIBCACHESIM = {
    "lru": ("LRU", 1),
    "belady": ("Belady", 1),
    "arc": ("ARC", 1),
    "s3fifo": ("S3FIFO", 20),
    "sieve": ("Sieve", 1),
}
"""Rules libCacheSim implements too: its class and the smallest capacity checked. S3-FIFO from 20: below,
libCacheSim's small queue is 0 or 1 objects (policies/s3fifo.py; test_hooked_rules.py shows it failing
where ours does not)."""
NO_LIBCACHESIM = {
    "decayed": "libCacheSim has no exponentially decayed frequency rule",
    "foresight": "libCacheSim has no Belady limited to a horizon",
    "learned": "a trained scorer of ours: no libCacheSim counterpart",
    "lfu": "libCacheSim's LFU counts uses while resident (forgotten on eviction) and breaks ties otherwise; "
           "ours counts every use in the stream, ties to the least recently used",
    "mean-interval": "libCacheSim has no mean-interval predictor",
    "random": "libCacheSim's Random draws from its own generator: no common victims to count",
    "router-logit": "reads router probabilities, which a libCacheSim trace does not carry",
    "static": "an admission rule (pin set with bypass): no libCacheSim cache class",
}


# -- fixtures and helpers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Files rules need: a scorer file of reuse features (``learned:PATH``)."""
    from expertcache.scorer.file import save_scorer
    from expertcache.scorer.models import Scorer

    d = tmp_path_factory.mktemp("rules")
    save_scorer(Scorer(kind="linear", features=("age", "count", "last_gap"), mean=np.array([4.0, 3.0, 2.0]),
                       scale=np.array([3.0, 2.0, 1.5]), weights=[np.array([0.7, -1.3, 0.4])]), d / "scorer.npz")
    return {"scorer": d / "scorer.npz"}


@pytest.fixture
def specs(rule, files):
    """The spec strings the checks run for ``rule``: its bare name (or its SPECS entry) and EXAMPLES."""
    if rule in SPECS:
        out = SPECS[rule](files)
    else:
        try:
            make_policy(rule)
        except PolicyError as err:
            pytest.fail(f"{rule!r} does not build from its bare name ({err}): declare how to build it in SPECS")
        out = [rule]
    return out + EXAMPLES.get(rule, [])


def example_specs(rule: str) -> list[str]:
    """The specs of a rule that builds without files (the bare name and EXAMPLES), for other tests'
    rule lists; ``[]`` for a rule in SPECS."""
    return [] if rule in SPECS else [rule] + EXAMPLES.get(rule, [])


def plain_specs(**where) -> list[str]:
    """Every registered rule's :func:`example_specs` that run on both engines from a plain trace (no
    file, no context; not an admission rule), filtered by rule-object attributes (``hooked=True``)."""
    out = []
    for rule in RULES:
        if rule in NO_COMPILED or rule in NO_REFERENCE:
            continue
        for spec in example_specs(rule):
            p = make_policy(spec)
            if p.admits and not p.wants_context and all(getattr(p, k) == v for k, v in where.items()):
                out.append(spec)
    return out


def seed_case(router: bool = False) -> ec.Trace:
    """The seeds' three-token case (conftest's ``seed_case``); ``router``: with a router softmax (router-logit)."""
    rp = np.full((3, 1, 4), 0.25, dtype=np.float32) if router else None
    return ec.Trace.from_arrays(np.array([[0, 1], [2, 3], [0, 1]]), num_experts=4, router_probs=rp)


def grouped_trace(seed: int, T=40, L=2, E=8, k=2, seqs=2, pads=False) -> ec.Trace:
    """Random token-grouped routing, bursty (random-walk logits): with gate weights and a router softmax, or
    (``pads``) with padding (-1) in about a fifth of the slots and neither."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(size=(T, L, E))
    logits = 1.2 * noise + 0.3 * noise.cumsum(axis=0)
    rp = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    ex = np.argsort(-rp, axis=2)[:, :, :k]
    probs = np.take_along_axis(rp, ex, axis=2).astype(np.float32)
    if pads:
        ex[rng.random(ex.shape) < 0.2] = -1
        return ec.Trace.from_arrays(ex, np.sort(rng.integers(0, seqs, T)), num_experts=E)
    return ec.Trace.from_arrays(ex, np.sort(rng.integers(0, seqs, T)), num_experts=E, probs=probs,
                                router_probs=rp.astype(np.float32))


def k1_trace(n=20_000, E=300, seed=0, burst=0.3, skew=1.1) -> ec.Trace:
    """One expert per token (k = 1), Zipf-popular ids with bursts of reuse: a classic cache trace."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, E + 1, dtype=float) ** -skew
    ids = rng.choice(E, n, p=p / p.sum())
    b = rng.random(n) < burst
    ids[1:][b[1:]] = ids[:-1][b[1:]]
    return ec.Trace.from_arrays(ids[:, None], num_experts=E)


def lcs_misses(lcs, path, n, rule, capacity) -> int:
    """libCacheSim's miss count of ``rule`` (its LIBCACHESIM class) over an oracleGeneral file of ``n`` requests."""
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    return round(getattr(lcs, LIBCACHESIM[rule][0])(capacity).process_trace(reader)[0] * n)


def _cases():
    """``(label, trace, capacities, replay keywords)``: the traces the compiled plan and the reference share."""
    from expertcache.trace.synth import synthesize_preset

    out = []
    for seed, (k, E, pads) in enumerate([(1, 6, False), (2, 8, False), (3, 8, True), (2, 5, True)]):
        tr = grouped_trace(seed, k=k, E=E, pads=pads)
        out.append((f"grouped{seed}", tr, (k, k + 1, E - 1, E + 1), {"pool": "layer"}))
        out.append((f"grouped{seed}-global", tr, (k, 2 * k + 1, 2 * E - 1), {"pool": "global", "reset": "none"}))
    tr = grouped_trace(7, T=60, L=3, E=10, k=2, seqs=3)
    out.append(("warm", tr, (3, 6), {"warm": 0.3}))
    out.append(("second", tr, (3, 6), {"pool": "global", "admission": "second"}))
    olmoe = synthesize_preset("olmoe", seed=0, tokens=80, sequences=2, num_layers=2)
    out.append(("olmoe", olmoe, (8, 20, 48), {"pool": "layer"}))
    out.append(("olmoe-global", olmoe, (24,), {"pool": "global", "warm": 0.25}))
    out.append(("k1", k1_trace(4000, 100), (1, 3, 10, 33), {"reset": "none"}))
    return out


@pytest.fixture(scope="module")
def cases():
    return _cases()


def counts(r) -> tuple:
    return r.copies_total, r.copies_steady, r.copies_fill, [astuple(c) for c in r.per_layer]


# -- the checks -------------------------------------------------------------------------------------------
def test_declarations_name_registered_rules():
    """A declaration about a rule that is not registered (renamed, removed) is stale."""
    for table in (SPECS, EXAMPLES, REFERENCE, NO_COMPILED, NO_REFERENCE, LIBCACHESIM, NO_LIBCACHESIM):
        assert set(table) <= set(RULES), sorted(set(table) - set(RULES))
    assert not set(LIBCACHESIM) & set(NO_LIBCACHESIM)
    assert {"lru", "belady", "arc", "s3fifo", "sieve", "random", "static"} <= set(RULES)  # the scan found them


@pytest.mark.parametrize("rule", RULES)
def test_kind(rule, specs):
    for text in specs:
        spec = parse_policy(text)
        assert spec.kind in KINDS and spec.kind == kind_of(text), text
        assert spec.kind in ("eviction", "admission"), text  # registered rules are Policy objects
        assert spec.kind == ("eviction" if make_policy(text).admits else "admission"), text
        others = tuple(k for k in KINDS if k != spec.kind)
        with pytest.raises(PolicyError, match=re.escape(f"is an {spec.kind} rule")) as err:
            parse_policy(text, others)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("rule", RULES)
def test_canonical_round_trip(rule, specs):
    for text in specs:
        spec = parse_policy(text)
        assert spec.name == rule and spec.to_spec() == spec.text, text
        assert parse_policy(spec.to_spec()) == spec, text  # canonical: parsing it again changes nothing
        name, colon, arg = text.partition(":")
        assert parse_policy(f"  {name.upper()}{colon}{arg} ") == spec, text  # names are case-insensitive
        assert spec.params == (tuple(spec.text.partition(":")[2].split(":")) if ":" in spec.text else ())
        a, b = spec.clone(), spec.clone()
        assert a is not b and isinstance(a, ec.Policy) and a.spec == b.spec == spec.text, text
        assert make_policy(text).spec == make_policy(spec.text).spec == spec.text, text


def _paths(rule, text):
    """``[(label, rule or spec, engine)]``: every way this rule runs in replay."""
    out = []
    if rule not in NO_COMPILED:
        out.append(("compiled", text, "compiled"))
    if rule not in NO_REFERENCE:
        out.append(("python", text, "python"))
        if rule in REFERENCE:
            out.append(("reference", REFERENCE[rule](make_policy(text)), "python"))
    return out


def _check_declared(rule, trace, capacity, **kw):
    """A NO_COMPILED / NO_REFERENCE declaration must still be true."""
    if rule in NO_COMPILED:
        with pytest.raises(ConfigError, match="has no compiled plan"):
            ec.replay(trace, capacity, rule, engine="compiled", **kw)
    if rule in NO_REFERENCE:
        with pytest.raises(PolicyError):
            ec.replay(trace, capacity, rule, engine="python", **kw)


@pytest.mark.parametrize("rule", RULES)
def test_seed_three_token_case(rule, specs):
    """C=3, {a,b},{c,d},{a,b} from empty: 5 copies under every eviction rule, 2 of them steady."""
    if kind_of(rule) != "eviction":
        pytest.skip(f"{rule} is an {kind_of(rule)} rule: it streams misses and never evicts (the case is of "
                    "lossless rules)")
    _check_declared(rule, seed_case(router=True), 3)
    for text in specs:
        trace = seed_case(router=make_policy(text).wants_context)
        for label, policy, engine in _paths(rule, text):
            r = ec.replay(trace, 3, policy, engine=engine)
            assert r.engine == engine, (text, label)
            assert (r.copies_total, r.copies_steady, r.copies_fill) == (5, 2, 3), (text, label)
            assert r.tokens == 3 and r.requests == 6
            assert r.hit_rate == pytest.approx(1 - 5 / 6)
            assert r.copies_per_token == pytest.approx(2 / 3)


@pytest.mark.parametrize("rule", RULES)
def test_compiled_equals_reference(rule, specs, cases):
    for declared in (NO_COMPILED, NO_REFERENCE):
        if rule in declared:
            _, trace, caps, kw = next(c for c in cases if c[0] == "warm")  # a warm window: static can start
            _check_declared(rule, trace, caps[0], **kw)
            pytest.skip(f"{rule}: {declared[rule]}")
    for text in specs:
        for label, trace, caps, kw in cases:
            for C in caps:
                got = {}
                for name, policy, engine in _paths(rule, text):
                    r = ec.replay(trace, C, policy, engine=engine, **kw)
                    assert r.engine == engine, (text, name)
                    got[name] = counts(r)
                first = next(iter(got.values()))
                assert all(v == first for v in got.values()), (text, label, C, got)


@pytest.fixture(scope="module")
def lcs_files(tmp_path_factory):
    """The k = 1 traces of the libCacheSim check, exported once (synthetic, and each layer of a real trace
    with k = 1 in ../shared/traces): ``[(label, trace, replay keywords, path, requests, capacities)]``."""
    from conftest import shared_trace_paths
    from expertcache.trace.exporters import export_libcachesim

    d = tmp_path_factory.mktemp("lcs")
    out = []
    for label, trace in (("zipf", k1_trace()), ("uniform", k1_trace(10_000, 120, seed=1, burst=0.0, skew=0.0))):
        E = trace.num_experts
        n = export_libcachesim(trace, d / f"{label}.bin", fmt="oracle")
        out.append((label, trace, {}, d / f"{label}.bin", n, (1, 2, 3, 5, 10, 16, 40, 64, E - 1)))
    for path in shared_trace_paths():  # real traces of one expert per token, layer by layer
        trace = ec.load_trace(path)
        if trace.top_k != 1:
            continue
        for lid in trace.layer_ids:
            f = d / f"{path.parent.name}-{lid}.bin"
            n = export_libcachesim(trace, f, layers=[lid], fmt="oracle")
            out.append((f"{path.parent.name}/{lid}", trace, {"layers": [lid]}, f, n, (2, 4, 6)))
    return out


@pytest.mark.parametrize("rule", RULES)
def test_counts_equal_libcachesim(rule, request):
    """libCacheSim (an independent, native implementation) counts its misses on k = 1 traces (a
    single-request simulator equals ours there): they equal our copies with pools carried over."""
    if rule in NO_LIBCACHESIM:
        pytest.skip(f"{rule}: {NO_LIBCACHESIM[rule]}")
    if rule not in LIBCACHESIM:
        pytest.fail(f"{rule!r}: declare its libCacheSim class in LIBCACHESIM, or why it has none in NO_LIBCACHESIM")
    lcs = pytest.importorskip("libcachesim")
    smallest = LIBCACHESIM[rule][1]
    ran = 0
    for label, trace, kw, path, n, caps in request.getfixturevalue("lcs_files"):
        for C in caps:
            if C < smallest:
                continue
            ours = ec.replay(trace, C, rule, reset="none", **kw)
            assert ours.copies_total == lcs_misses(lcs, path, n, rule, C), (rule, label, C)
            ran += 1
    assert ran > 0
