"""The Hugging Face integration: offloaded experts on tiny random-weight checkpoints of real families.

Every model is built from its family's config class, saved with ``save_pretrained`` and loaded back
with ``AutoModelForCausalLM.from_pretrained``, as a user's checkpoint would be. CPU only, offline.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

import expertcache  # noqa: E402
from expertcache import ConfigError, PolicyError, load_trace, replay  # noqa: E402
from expertcache.hf import IMPLEMENTATION, find_sites  # noqa: E402
from expertcache.hf.evaluation import ExactnessError, evaluate  # noqa: E402
from expertcache.hf.passes import split_tokens  # noqa: E402
from expertcache.hf.layer import OffloadedLayer  # noqa: E402
from expertcache.hf.model import cache_argument  # noqa: E402
from expertcache.hf.toy import FAMILIES, save_toy_checkpoint  # noqa: E402

E, K = 8, 2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {fam: save_toy_checkpoint(fam, root / fam) for fam in (*FAMILIES, "gpt_oss")}


def load(checkpoints, family):
    return AutoModelForCausalLM.from_pretrained(checkpoints[family]).eval()


def tokens(n=40, seed=1):
    return torch.randint(0, 95, (1, n), generator=torch.Generator().manual_seed(seed))


def counts(result):
    return [(c.layer, c.copies_total, c.copies_steady) for c in result.per_layer]


# ---------------------------------------------------------------------- package surface
def test_core_import_does_not_import_torch():
    code = (
        "import sys, expertcache\n"
        "from expertcache.cli.main import build_parser\n"
        "build_parser()\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
        "assert callable(expertcache.offload) and callable(expertcache.capture)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_offload_is_the_function_of_the_hf_package():
    """``expertcache.offload`` is a plain function, not a callable module (issue 35): the package is
    ``expertcache.hf``, and importing it or its submodules leaves the top-level names alone."""
    import types

    import expertcache.hf
    import expertcache.hf.run  # noqa: F401
    from expertcache import load_offloaded, offload

    assert isinstance(offload, types.FunctionType) and offload is expertcache.hf.offload
    assert expertcache.offload is expertcache.hf.offload and load_offloaded is expertcache.hf.load_offloaded
    assert type(expertcache.hf) is types.ModuleType and "expertcache.offload" not in sys.modules


def test_opt_in_by_name(checkpoints):
    """Loading with experts_implementation="expertcache" is the stock model until a run attaches."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS
    stock = load(checkpoints, "olmoe")
    named = AutoModelForCausalLM.from_pretrained(checkpoints["olmoe"], experts_implementation=IMPLEMENTATION)
    assert named.config._experts_implementation == IMPLEMENTATION
    x = tokens()
    with torch.no_grad():
        assert torch.equal(named(input_ids=x).logits, stock(input_ids=x).logits)
        with expertcache.offload(named, capacity=3) as run:
            named(input_ids=x)
    assert run.stats().copies_steady > 0 and named.config._experts_implementation == IMPLEMENTATION


# ---------------------------------------------------------------------- families
@pytest.mark.parametrize("family", FAMILIES)
def test_full_capacity_matches_stock_and_small_capacity_matches_replay(checkpoints, family):
    model = load(checkpoints, family)
    sites = find_sites(model)
    layers = [s.layer for s in sites]
    x = tokens()
    with torch.no_grad():
        stock = model(input_ids=x).logits
        with expertcache.offload(model, capacity=E) as run:
            full = model(input_ids=x).logits
        # the default implementation (grouped_mm) groups rows by id, so slot ids may reorder rows
        # inside a BLAS block: equal up to float rounding
        torch.testing.assert_close(full, stock, rtol=0, atol=1e-5)
        assert run.stats().copies_steady == 0
        with expertcache.capture(model) as cap, expertcache.offload(model, capacity=3) as run:
            small = model(input_ids=x).logits
    torch.testing.assert_close(small, stock, rtol=0, atol=1e-5)
    stats = run.stats()
    assert stats.copies_steady > 0 and stats.layers == layers and stats.tokens == x.shape[1]
    replayed = replay(cap.trace, 3, "lru", layers=layers)
    assert counts(replayed) == counts(stats)
    assert (replayed.copies_total, replayed.copies_steady) == (stats.copies_total, stats.copies_steady)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_full_capacity_is_bitwise_equal(checkpoints, implementation):
    model = load(checkpoints, "olmoe")
    model.set_experts_implementation(implementation)
    x = tokens()
    with torch.no_grad():
        stock = model(input_ids=x).logits
        with expertcache.offload(model, capacity=E):
            assert model.config._experts_implementation == IMPLEMENTATION
            full = model(input_ids=x).logits
    assert torch.equal(full, stock)
    assert model.config._experts_implementation == implementation


def test_refuses_other_layouts_in_one_line(checkpoints):
    with pytest.raises(ConfigError) as err:
        expertcache.offload(load(checkpoints, "gpt_oss"), capacity=4)
    msg = str(err.value)
    assert "not supported" in msg and "gate_up_proj [E, 2I, H]" in msg and "\n" not in msg
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match="no transformers v5 experts module"):
        expertcache.offload(dense, capacity=4)


def test_bad_options(checkpoints):
    model = load(checkpoints, "deepseek_v3")  # layer 0 is dense
    with pytest.raises(ConfigError, match="0 is not an MoE layer"):
        expertcache.offload(model, capacity=4, layers=[0, 1])
    with pytest.raises(ConfigError, match="below the 2 experts"):
        expertcache.offload(model, capacity=1)
    with pytest.raises(PolicyError):
        expertcache.offload(model, capacity=4, policy="nope")
    with pytest.raises(ConfigError, match="clairvoyant"):
        with expertcache.offload(model, capacity=4, policy="belady"):
            pass
    assert model.config._experts_implementation != IMPLEMENTATION
    # a Python caller's values: policy=None/True had ended as AttributeError, device=True or 2.5 as
    # torch's many-line TypeError, device=-1 as RuntimeError, record=True as AttributeError
    for policy in (None, True, 2.5):
        with pytest.raises(PolicyError, match="expected a policy string"):
            expertcache.offload(model, capacity=4, policy=policy)
    for device in (True, 2.5, [], -1):
        with pytest.raises(ConfigError, match="^device ") as err:
            expertcache.offload(model, capacity=4, device=device)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="--record|record: expected text"):
        expertcache.capture(model, record=True)
    # the command stopped --slow-copies at 1,000; offload(slow_copies=10**30) repeated every copy for ever
    for slow in (0, 2.5, 1001, 10**30):
        with pytest.raises(ConfigError, match=r"slow_copies must be an integer in \[1, 1,000\]"):
            expertcache.offload(model, capacity=4, slow_copies=slow)


def test_a_failed_attach_leaves_the_model_as_it_was(checkpoints, monkeypatch):
    """capacity=10**30 passed the run's check and failed as the pools started (``_start_streams``),
    after the forward hook was on the model and outside attach's undo: every later forward, and
    every later offload of that model, failed with the same message. The capacity is now checked
    first, and a failure anywhere in attach, the pools' start included, undoes it."""
    from expertcache.hf.run import OffloadRun

    model = load(checkpoints, "olmoe")
    ids = tokens(6)
    with torch.no_grad():
        stock = model(ids).logits
    with pytest.raises(ConfigError, match="capacity must be an integer"):
        expertcache.offload(model, capacity=10**30)

    def failing_start(self):
        raise ConfigError("stop")

    with monkeypatch.context() as patch:
        patch.setattr(OffloadRun, "_start_streams", failing_start)
        with pytest.raises(ConfigError, match="stop"):
            expertcache.offload(model, capacity=4).attach()
    assert not model._forward_pre_hooks and model.config._experts_implementation != IMPLEMENTATION
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock)
    with expertcache.offload(model, capacity=4) as run, torch.no_grad():
        model(ids)
    assert run.stats().copies_total > 0


# ---------------------------------------------------------------------- policies and streams
@pytest.mark.parametrize("policy", ["lru", "lfu", "decayed:0.9", "random:3", "mean-interval", "belady", "foresight:4"])
def test_live_copies_equal_replay_of_captured_trace(checkpoints, policy):
    """The agreement test: a lossless live run makes exactly the copies the simulator replays."""
    model = load(checkpoints, "qwen3_moe")
    layers, C = [1, 2], 3
    seqs = [tokens(30, seed=s) for s in (1, 2, 3)]
    with torch.no_grad():
        with expertcache.capture(model) as first:  # the first pass records the future
            for x in seqs:
                model(input_ids=x)
        with expertcache.capture(model, layers=layers) as cap, \
                expertcache.offload(model, C, policy, layers, future=first.trace) as run:
            for x in seqs:
                model(input_ids=x)
    stats = run.stats()
    assert stats.sequences == 3 and stats.tokens == 90 and stats.future_mismatches == 0
    replayed = replay(cap.trace, C, policy, layers=layers)
    assert counts(replayed) == counts(stats)
    assert replayed.copies_steady == stats.copies_steady > 0


def test_decode_and_forward_make_the_same_copies(checkpoints):
    model = load(checkpoints, "mixtral")
    x = tokens(24)
    with torch.no_grad():
        with expertcache.offload(model, capacity=3) as whole:
            ref = model(input_ids=x).logits
        with expertcache.offload(model, capacity=3) as stepwise:
            rows = decode_logits(model, x)
    assert stepwise.stats().sequences == 1
    assert counts(stepwise.stats()) == counts(whole.stats())
    torch.testing.assert_close(rows, ref[0], rtol=0, atol=1e-4)


def test_reset_none_carries_pools_over(checkpoints):
    model = load(checkpoints, "olmoe")
    seqs = [tokens(20, seed=s) for s in (4, 5)]
    with torch.no_grad(), expertcache.capture(model) as cap, \
            expertcache.offload(model, capacity=3, reset="none") as run:
        for x in seqs:
            model(input_ids=x)
    assert cap.trace.num_sequences == 2
    assert counts(replay(cap.trace, 3, "lru", reset="none")) == counts(run.stats())
    assert counts(replay(cap.trace, 3, "lru")) != counts(run.stats())


def test_detach_restores_the_model(checkpoints):
    model = load(checkpoints, "olmoe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    with torch.no_grad(), expertcache.offload(model, capacity=4, layers=[1]) as run:
        model(input_ids=tokens(8))
        print(run.stats())
    assert "lru at C=4" in str(run.stats())
    assert model.config._experts_implementation == "grouped_mm"
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.data_ptr() == ptrs[name]
    for site in find_sites(model):
        assert not [k for k in vars(site.experts) if k.startswith("_expertcache")]


def test_slots_never_read_stale_weights(checkpoints):
    """Slots start as NaN: a row computed before its copy would poison the logits."""
    model = load(checkpoints, "olmoe")
    with torch.no_grad(), expertcache.offload(model, capacity=2) as run:
        out = model(input_ids=tokens(40)).logits
    assert torch.isfinite(out).all()
    assert run.stats().copies_steady > 0


# ---------------------------------------------------------------------- capture
def test_capture_generate_is_decode_only_by_default(checkpoints, tmp_path):
    model = load(checkpoints, "olmoe")
    prompt = tokens(6)
    with torch.no_grad(), expertcache.capture(model, router_probs=True) as cap:
        model.generate(prompt, max_new_tokens=5, do_sample=False)
    trace = cap.trace
    assert trace.num_tokens == 4  # the prefill forward makes the first new token; four decode steps follow
    assert trace.meta["phase"] == "decode" and trace.meta["provenance"]["prefill"] == "excluded"
    assert trace.router_probs.shape == (4, 3, E)
    np.testing.assert_allclose(trace.router_probs.sum(-1), 1.0, rtol=1e-5)
    top = np.sort(np.argsort(-trace.router_probs, axis=-1)[..., :K], axis=-1)
    assert np.array_equal(top, np.sort(trace.experts, axis=-1))
    path = trace.save(tmp_path / "t.npz")
    again = load_trace(path)
    assert np.array_equal(again.experts, trace.experts) and again.meta["phase"] == "decode"

    with torch.no_grad(), expertcache.capture(model, phase="all") as everything:
        model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert everything.trace.num_tokens == 6 + 4 and everything.trace.meta["phase"] == "mixed"


def test_capture_teacher_forced_and_errors(checkpoints):
    model = load(checkpoints, "olmoe")
    with torch.no_grad(), expertcache.capture(model) as cap:
        model(input_ids=tokens(12))
        model(input_ids=tokens(7, seed=9))
    assert cap.trace.meta["phase"] == "teacher-forced"
    assert list(np.bincount(cap.trace.seq)) == [12, 7]
    with expertcache.capture(model, phase="decode") as empty, torch.no_grad():
        model(input_ids=tokens(5))
    with pytest.raises(ConfigError, match="phase='all'"):
        empty.trace
    with pytest.raises(ConfigError, match="batch-1"), torch.no_grad(), expertcache.capture(model, router_probs=True):
        model(input_ids=torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------------- evaluation
def test_evaluate_reports_exact_runs(checkpoints):
    model = load(checkpoints, "olmoe")
    seqs = split_tokens(np.random.default_rng(0).integers(0, 95, 50), max_len=24)
    ev = evaluate(model, seqs, 3, ["lru", "belady"], layers=[1, 2], mode="forward")
    assert ev.failures() == []
    lru, belady = ev.results
    for r in ev.results:
        d = r.to_dict()
        assert d["exact"] and d["replay_agrees"] and d["routing_changed"] == 0.0
        assert d["tokens"] == 50 and d["copies_per_token"] == d["copies_steady"] / 50
    assert belady.stats.copies_steady <= lru.stats.copies_steady
    assert ev.trace.num_tokens == 50 and ev.trace.meta["phase"] == "teacher-forced"


def test_evaluate_fails_loudly_when_a_run_is_not_exact(checkpoints, monkeypatch):
    model = load(checkpoints, "olmoe")
    original = OffloadedLayer.__call__

    def broken(self, hidden, index, weights):
        return original(self, hidden, index, weights) + 1.0  # a wrong expert output

    monkeypatch.setattr(OffloadedLayer, "__call__", broken)
    ev = evaluate(model, [np.arange(20) % 90], 3, ["lru"], mode="forward")
    assert not ev.results[0].exact
    with pytest.raises(ExactnessError, match="lossless policy must match"):
        ev.check()



def test_evaluate_checks_a_python_callers_options(checkpoints):
    """tolerance=True had read as 1 nat and infinity switched the exactness check off; batch=True
    was a batch of 1; bootstrap=None or "" meant no interval and bootstrap_seed=2.5 went unchecked."""
    model = load(checkpoints, "olmoe")
    seqs = [np.arange(8) % 90]
    for kwargs, says in (({"tolerance": True}, "tolerance must be"), ({"tolerance": float("inf")}, "tolerance must be"),
                         ({"tolerance": -1e-3}, "tolerance must be"), ({"batch": True}, "batch must be"),
                         ({"batch": 2.5}, "batch must be"), ({"bootstrap": None}, "bootstrap must be"),
                         ({"bootstrap": ""}, "bootstrap must be"),
                         ({"bootstrap": 10, "bootstrap_seed": 2.5}, "bootstrap"),
                         ({"bootstrap": 10, "bootstrap_seed": -1}, "bootstrap"),
                         ({"repeats": 10**30}, r"repeats must be an integer in \[1, 10,000\]"),
                         ({"repeats": 2.5}, "repeats must be")):
        with pytest.raises(ConfigError, match=says):
            evaluate(model, seqs, 3, ["lru"], mode="forward", **kwargs)
    from expertcache.hf.calibrate import calibrate

    for kwargs in ({"repeats": 2.5}, {"repeats": 10**30}, {"tokens": 2.5}, {"slow_copies": 10**30}):
        with pytest.raises(ConfigError, match="calibrate needs 3 to 10,000 repeats|slow_copies must be"):
            calibrate(model, **kwargs)


def decode_logits(model, x):
    key = cache_argument(model)  # ``cache`` in 5.24, ``past_key_values`` in 5.17 (which ignores ``cache=``)
    cache, rows = None, []
    for i in range(x.shape[1]):
        out = model(input_ids=x[:, i : i + 1], use_cache=True, **{key: cache})
        cache = out[key]
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


def test_full_capacity_decode_is_bitwise_equal_under_the_default_implementation(checkpoints):
    """One token per forward: every expert group is one row, so even grouped_mm sees identical blocks."""
    model = load(checkpoints, "qwen2_moe")
    x = tokens(16)
    with torch.no_grad():
        stock = decode_logits(model, x)
        with expertcache.offload(model, capacity=E) as run:
            full = decode_logits(model, x)
    assert torch.equal(full, stock)
    assert run.stats().copies_steady == 0 and run.stats().sequences == 1


def test_transformers_range_is_checked():
    from expertcache.hf.model import require_transformers

    require_transformers("5.17.0")
    require_transformers("5.24.0")
    for version in ("4.57.1", "5.0.0", "5.16.0", "6.0.0"):
        with pytest.raises(ConfigError, match=r"supports transformers >=5\.17\.0,<6"):
            require_transformers(version)


def test_evaluate_bootstrap_gives_paired_dnll_intervals_by_hand(checkpoints):
    """--bootstrap: per-sequence NLLs add up to the pass's, and each policy's dnll interval is the
    percentile interval of the resampled per-token dnll, recomputed here by hand."""
    from expertcache.hf.intervals import draws

    model = load(checkpoints, "olmoe")
    seqs = split_tokens(np.random.default_rng(3).integers(0, 95, 120), max_len=12)
    ev = evaluate(model, seqs, 2, ["lru", "dwell:2:4"], layers=[1, 2], mode="forward", bootstrap=400, bootstrap_seed=5)
    ref = ev.reference
    assert len(ref.seq_nll) == len(seqs) == 10 and sum(ref.seq_predictions) == ref.predictions
    assert sum(ref.seq_nll) == pytest.approx(ref.nll_sum, rel=1e-6)
    idx = draws(10, 400, 5)
    assert idx.shape == (400, 10) and (draws(10, 400, 5) == idx).all()
    for r in ev.results:
        run = np.asarray(r.run.seq_nll)
        assert sum(run) == pytest.approx(r.run.nll_sum, rel=1e-6)
        vals = [(run[i] - np.asarray(ref.seq_nll)[i]).sum() / np.asarray(ref.seq_predictions)[i].sum() for i in idx]
        d = r.to_dict()
        assert d["dnll_ci"] == pytest.approx(list(np.percentile(vals, [2.5, 97.5])), abs=1e-12)
        assert d["bootstrap"] == 400 and d["bootstrap_seed"] == 5 and d["dnll_ci"][0] <= d["dnll_ci"][1]
    lru, dwell = ev.results
    assert max(abs(x) for x in lru.dnll_ci) <= 5e-3  # lossless: every resample's dnll is ~0
    assert dwell.to_dict()["routing_changed"] > 0 and dwell.dnll_ci[1] > dwell.dnll_ci[0]
    plain = evaluate(model, seqs, 2, ["lru"], layers=[1, 2], mode="forward")
    assert plain.results[0].to_dict()["dnll_ci"] is None and plain.reference.nll_sum == ref.nll_sum
