"""Serving a model larger than the device: loading into host memory, copy ordering, prefetch, batches.

CPU tests check every count and every output; tests marked ``cuda`` check what only a GPU can show
(peak device memory, copies racing matmuls on another stream) and skip cleanly without one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import expertcache  # noqa: E402
from expertcache import ConfigError, ExpertCache, replay  # noqa: E402
from expertcache.hf import find_sites, load_offloaded  # noqa: E402
from expertcache.hf.evaluation import evaluate  # noqa: E402
from expertcache.hf.model import cache_argument  # noqa: E402
from expertcache.hf.toy import save_toy_checkpoint, toy_model  # noqa: E402
from expertcache.hf.timing import Stopwatch  # noqa: E402

E, K = 8, 2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def olmoe():
    return toy_model("olmoe", seed=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_toy_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe")


def ids(b, n, seed=1):
    return torch.randint(0, 95, (b, n), generator=torch.Generator().manual_seed(seed))


def counts(result):
    return [(c.layer, c.copies_total, c.copies_steady) for c in result.per_layer]


def decode(model, x):
    key = cache_argument(model)  # ``cache`` in 5.24, ``past_key_values`` in 5.17
    cache, rows = None, []
    for i in range(x.shape[1]):
        out = model(input_ids=x[:, i : i + 1], use_cache=True, **{key: cache})
        cache = out[key]
        rows.append(out.logits[:, -1])
    return torch.stack(rows, dim=1)


# ---------------------------------------------------------------------- the cache's prefetch
def test_prefetch_counts_and_speculative_victims_first():
    cache = ExpertCache(3, "lru", 10)
    cache.prepare([0, 1])
    cache.prepare([2])
    step = cache.prefetch([7, 2])  # 2 is resident (a hit); 7 evicts the least recently used (0)
    assert step.loads and step.evicted == [0] and step.hits == 1
    assert cache.prefetch_pending == 1
    step = cache.prefetch([8])  # an unused prefetched item goes before any used one
    assert step.evicted == [7] and cache.prefetch_wasted == 1
    step = cache.prepare([8, 1])
    assert step.hits == 2 and cache.prefetch_hits == 1 and cache.prefetch_pending == 0
    cache.prefetch([5])  # evicts 2 (used at step 1, before 1 and 8 at step 2)
    assert cache.prefetch_pending == 1
    cache.reset()  # the pool empties: an unused prefetch is wasted
    assert (cache.prefetch_copies, cache.prefetch_hits, cache.prefetch_wasted, cache.prefetch_pending) == (3, 1, 2, 0)


def test_prefetch_without_use_leaves_the_policy_untouched():
    """A prefetched item enters the policy's state only when a step requests it."""
    a, b = ExpertCache(4, "lfu", 10), ExpertCache(4, "lfu", 10)
    for c in (a, b):
        c.prepare([0, 1])
        c.prepare([0, 2])
    b.prefetch([9])
    assert a.policy.keys(np.array([0, 1, 2]), 2).tolist() == b.policy.keys(np.array([0, 1, 2]), 2).tolist()


# ---------------------------------------------------------------------- loading
def test_load_offloaded_keeps_one_host_copy_and_matches_stock(ckpt):
    stock = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    model, run = load_offloaded(ckpt, capacity=E, layers=[1, 2], policy="lru", device="cpu")
    sites = {s.layer: s for s in find_sites(model)}
    for layer in run.layers:
        experts = sites[layer.layer].experts
        # the model's parameters, the pool's host tensors and the loaded tensors are one storage
        assert [h.data_ptr() for h in layer.pool.host] == [experts.gate_up_proj.data_ptr(), experts.down_proj.data_ptr()]
    storages = {}
    for p in model.parameters():
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(storages.values()) == param_bytes  # nothing is held twice
    x = ids(1, 24)
    with torch.no_grad():
        expected = decode(stock, x)
        got = decode(model, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    stats = run.stats()
    assert stats.copies_steady == 0 and stats.copies_total > 0
    mem = stats.memory
    assert mem.host_expert_bytes == 2 * E * stats.expert_bytes and mem.slot_bytes == 2 * E * stats.expert_bytes
    assert mem.device_peak_bytes is None and not mem.pinned
    run.detach()
    assert model.model.layers[1].mlp.experts.gate_up_proj.device.type == "cpu"


def test_load_offloaded_refuses_bad_input_in_one_line(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_offloaded(tmp_path, capacity=4)
    with pytest.raises(ConfigError, match="not an MoE layer|not MoE layers"):
        load_offloaded(ckpt, capacity=4, layers=[7])
    with pytest.raises(ConfigError, match="dtype"):
        load_offloaded(ckpt, capacity=4, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load_offloaded(ckpt, capacity=4, device="cuda")


@cuda
def test_cuda_load_never_puts_all_experts_on_the_device(ckpt):
    torch.cuda.empty_cache()
    model, run = load_offloaded(ckpt, capacity=3, device="cuda")
    with torch.no_grad():
        decode(model, ids(1, 12).cuda())
    mem = run.stats().memory
    experts = sum(s.experts.gate_up_proj.numel() * s.experts.gate_up_proj.element_size()
                  + s.experts.down_proj.numel() * s.experts.down_proj.element_size() for s in find_sites(model))
    assert mem.pinned and mem.host_expert_bytes == experts
    assert mem.device_peak_bytes < mem.device_weight_bytes + mem.slot_bytes + experts
    assert all(s.experts.gate_up_proj.device.type == "cpu" for s in find_sites(model))


# ---------------------------------------------------------------------- batches
@pytest.mark.parametrize("policy", ["lru", "decayed:0.9", "belady"])
def test_batch_union_live_equals_replay(olmoe, policy):
    x = ids(3, 16)
    C = 6  # the union of 3 rows of top-2 is at most 6 experts
    with torch.no_grad():
        stock = olmoe(input_ids=x).logits
        with expertcache.capture(olmoe) as first:
            olmoe(input_ids=x)
        for forward in (True, False):
            with expertcache.capture(olmoe, phase="all") as cap, \
                    expertcache.offload(olmoe, C, policy, future=first.trace) as run:
                out = olmoe(input_ids=x).logits if forward else decode(olmoe, x)
            torch.testing.assert_close(out, stock, rtol=0, atol=1e-5)
            stats = run.stats()
            trace = cap.trace
            assert trace.meta["batch"] == 3 and trace.experts.shape == (16, 3, 6) and trace.probs is None
            assert stats.tokens == 16 and stats.batch == 3 and stats.future_mismatches == 0
            replayed = replay(trace, C, policy)
            assert counts(replayed) == counts(stats) and stats.copies_steady > 0


def test_batch_command_union_equals_the_live_batch_capture(olmoe):
    """``expertcache batch`` of b single-row captures = the live harness's batch-b capture, row for row."""
    from expertcache.trace.batch import batch_union

    x = ids(3, 16, seed=4)
    with torch.no_grad():
        with expertcache.capture(olmoe) as batched:
            olmoe(input_ids=x)
        singles = []
        for r in range(3):
            with expertcache.capture(olmoe) as one:
                olmoe(input_ids=x[r : r + 1])
            singles.append(one.trace)
    live, union = batched.trace, batch_union(singles)
    assert live.meta["batch"] == 3 and union.meta["batch"] == 3
    np.testing.assert_array_equal(union.experts, live.experts)
    np.testing.assert_array_equal(union.seq, live.seq)
    assert union.extras["batch_rows"].tolist() == [[t, t, t] for t in range(16)]
    assert counts(replay(union, 6, "lru")) == counts(replay(live, 6, "lru"))


def test_batch_union_above_capacity_is_refused_in_one_line(olmoe):
    with torch.no_grad(), expertcache.offload(olmoe, 2):
        with pytest.raises(ConfigError, match=r"a batch of 4 rows requests \d+ distinct experts .* capacity >= 8"):
            olmoe(input_ids=ids(4, 3))


# ---------------------------------------------------------------------- prefetch
@pytest.mark.parametrize("mode", ["next-layer", "oracle"])
def test_prefetch_is_lossless_and_counts_add_up(olmoe, mode):
    x = ids(1, 30, seed=3)
    with torch.no_grad():
        with expertcache.capture(olmoe) as first:
            olmoe(input_ids=x)
        with expertcache.offload(olmoe, 3, "lru") as plain:
            expected = decode(olmoe, x)
        with expertcache.offload(olmoe, 3, "lru", prefetch=mode, future=first.trace) as run:
            got = decode(olmoe, x)
    assert torch.equal(got, expected)  # bitwise: prefetching changes when copies happen, not what is computed
    stats = run.stats()
    assert stats.prefetch == mode and stats.prefetch_copies > 0
    for c in stats.per_layer:
        assert c.prefetch_copies == c.prefetch_hits + c.prefetch_wasted + c.prefetch_pending
    assert stats.per_layer[0].prefetch_copies == 0  # the first offloaded layer has no layer before it
    if mode == "oracle":  # every later layer finds its experts already there
        assert all(c.copies_total == 0 for c in stats.per_layer[1:])
        assert stats.prefetch_hits == stats.prefetch_copies
    assert stats.copies_total < plain.stats().copies_total


def test_prefetch_options_are_checked(olmoe):
    with pytest.raises(ConfigError, match="prefetch"):
        expertcache.offload(olmoe, 3, prefetch="sometimes")
    with pytest.raises(ConfigError, match="prefetch 'oracle' reads the future"):
        with expertcache.offload(olmoe, 3, prefetch="oracle"):
            pass
    with pytest.raises(ConfigError, match="prefetch needs mode decode"):
        evaluate(olmoe, [np.arange(10)], 3, ["lru"], mode="forward", prefetch="next-layer")


def test_evaluate_batch_and_prefetch(olmoe):
    seqs = [np.random.default_rng(s).integers(0, 95, 12) for s in range(5)]
    ev = evaluate(olmoe, seqs, 6, ["lru", "belady"], mode="decode", batch=2)
    assert ev.failures() == [] and ev.dropped == 1
    for r in ev.results:
        d = r.to_dict()
        assert d["batch"] == 2 and d["steps"] == 24 and d["tokens"] == 48 and d["replay_agrees"]
        assert d["ms_blocking"] >= d["ms_overlapped"] >= d["c_ms_reference"] > 0
    ev = evaluate(olmoe, seqs[:2], 3, ["lru"], mode="decode", prefetch="next-layer")
    d = ev.results[0].to_dict()
    assert ev.failures() == [] and d["replay_agrees"] is None and d["exact"] and d["prefetch_copies"] > 0


# ---------------------------------------------------------------------- live == replay, every reset mode and pool
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    policy=st.sampled_from(["lru", "lfu", "decayed:0.8", "belady", "foresight:3", "mean-interval"]),
    reset=st.sampled_from(["sequence", "none"]),
    pool=st.sampled_from(["layer", "global"]),
    capacity=st.integers(2, 7),
    batch=st.integers(1, 2),
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_live_equals_replay_for_every_reset_mode_and_pool(olmoe, policy, reset, pool, capacity, batch, lengths, seed):
    if batch * K > capacity:
        batch = 1
    xs = [ids(batch, n, seed + i) for i, n in enumerate(lengths)]

    def serve():  # a global pool serves one token position per forward
        for x in xs:
            decode(olmoe, x) if pool == "global" else olmoe(input_ids=x)

    with torch.no_grad():
        with expertcache.capture(olmoe, phase="all") as first:
            serve()
        with expertcache.capture(olmoe, phase="all") as cap, \
                expertcache.offload(olmoe, capacity, policy, reset=reset, pool=pool, future=first.trace) as run:
            serve()
    stats = run.stats()
    assert stats.future_mismatches == 0 and stats.sequences == len(xs) and stats.pool == pool
    assert counts(replay(cap.trace, capacity, policy, reset=reset, pool=pool)) == counts(stats)


@pytest.mark.parametrize("pool", ["layer", "global"])
def test_live_learned_scorer_with_priors_and_online_counts_equals_replay(olmoe, pool, tmp_path):
    """A scorer of reuse, online and prior features reads the live stream context (the groups served so far and the
    item map) and decides exactly as in replay of the run's capture."""
    from expertcache.learn.dataset import build_dataset
    from expertcache.scorer.models import fit
    from expertcache.scorer.file import save_scorer

    train, test = [ids(1, 24, s) for s in (1, 2, 3)], [ids(1, 16, s) for s in (7, 8)]
    C = 3 if pool == "layer" else 3 * 2

    def serve(xs):
        for x in xs:
            decode(olmoe, x) if pool == "global" else olmoe(input_ids=x)

    with torch.no_grad():
        with expertcache.capture(olmoe, phase="all") as cap:
            serve(train)
        ev = build_dataset(cap.trace, C, states=("lru", "decayed"), pool=pool, features="reuse,online,prior")
        sc = fit(ev.X, ev.victim, ev.offsets, ev.features, kind="linear", seed=0)
        sc.tables = ev.tables.full
        spec = f"learned:{save_scorer(sc, tmp_path / 'sc.npz')}"
        with expertcache.capture(olmoe, phase="all") as cap, expertcache.offload(olmoe, C, spec, pool=pool) as run:
            serve(test)
    stats = run.stats()
    assert stats.copies_steady > 0
    assert counts(replay(cap.trace, C, spec, pool=pool)) == counts(stats)
    assert counts(replay(cap.trace, C, spec, pool=pool)) != counts(replay(cap.trace, C, "lru", pool=pool))


def test_evaluate_reads_a_scorer_file_once(olmoe, tmp_path, monkeypatch):
    """A policy string is parsed once where it enters (issue 23): eval's probes and every timed round
    reuse the rule it made (each run copies it per layer), so a learned: scorer file is read once."""
    import expertcache.policies.learned as learned
    from expertcache.scorer.file import load_scorer, save_scorer
    from expertcache.scorer.features import REUSE
    from expertcache.scorer.models import Scorer

    F = len(REUSE)
    path = save_scorer(Scorer("linear", REUSE, np.zeros(F), np.ones(F), [np.arange(F, dtype=float)]), tmp_path / "s.npz")
    reads = []
    monkeypatch.setattr(learned, "load_scorer", lambda p: reads.append(p) or load_scorer(p))
    ev = evaluate(olmoe, [ids(1, 16, s)[0].numpy() for s in (1, 2)], 3, [f"learned:{path}", "lru"], repeats=2)
    assert len(reads) == 1
    assert [r.policy for r in ev.results] == [f"learned:{path}", "lru"] and all(r.exact for r in ev.results)


def test_global_pool_shares_slots_and_refuses_multi_token_forwards(olmoe):
    x = ids(1, 20, seed=5)
    with torch.no_grad():
        stock = decode(olmoe, x)
        with expertcache.capture(olmoe, phase="all") as cap, expertcache.offload(olmoe, 5, "lru", pool="global") as run:
            got = decode(olmoe, x)
        torch.testing.assert_close(got, stock, rtol=0, atol=1e-5)
        stats = run.stats()
        assert stats.memory.slot_bytes == 5 * stats.expert_bytes  # 5 slots in all, not 5 per layer
        assert stats.copies_steady > 0
        assert counts(replay(cap.trace, 5, "lru", pool="global")) == counts(stats)
        with expertcache.offload(olmoe, 5, "lru", pool="global"):
            with pytest.raises(ConfigError, match="one token position per forward"):
                olmoe(input_ids=x)
    with pytest.raises(ConfigError, match="pool='layer'"):
        expertcache.offload(olmoe, 5, pool="global", prefetch="next-layer")
    with pytest.raises(ConfigError, match="pool"):
        expertcache.offload(olmoe, 5, pool="shared")


def test_reset_none_clairvoyant_reads_the_whole_trace(olmoe):
    """The regression: with reset="none" belady saw only sequence 0's future (live 103 vs replay 80)."""
    xs = [ids(1, 40, s) for s in (1, 2, 3)]
    with torch.no_grad():
        with expertcache.capture(olmoe) as first:
            for x in xs:
                olmoe(input_ids=x)
        with expertcache.offload(olmoe, 3, "belady", reset="none", future=first.trace) as run:
            for x in xs:
                olmoe(input_ids=x)
    assert run.stats().future_mismatches == 0
    assert counts(replay(first.trace, 3, "belady", reset="none")) == counts(run.stats())


# ---------------------------------------------------------------------- CUDA ordering and timing
@cuda
def test_delayed_copies_never_race_the_matmuls(ckpt):
    """Copies on their own stream, each group delayed by a busy kernel: a missing wait would read a
    slot before its copy lands (NaN or another expert's weights) and change the outputs."""
    stock = AutoModelForCausalLM.from_pretrained(ckpt).cuda().eval()
    x = ids(1, 24).cuda()
    with torch.no_grad():
        expected = decode(stock, x)
    del stock
    model, run = load_offloaded(ckpt, capacity=3, device="cuda", prefetch="next-layer")
    for layer in run.layers:
        layer.pool.sync.delay_cycles = 2_000_000
    with torch.no_grad():
        got = decode(model, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert run.stats().copies_steady > 0


@cuda
def test_stopwatch_releases_finished_events():
    watch = Stopwatch("cuda")
    a = torch.ones(256, 256, device="cuda")
    for _ in range(200):
        with watch.time():
            a = a @ a / 256
        torch.cuda.synchronize()
    assert watch.in_flight <= 2 and watch.seconds > 0


def test_gpu_check_script_runs_end_to_end_on_a_tiny_model():
    """benchmarks/gpu_check.py is run on a GPU machine only rarely: keep every step of it working."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--small", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "gpu_check: all checks PASS" in proc.stdout and "FAIL " not in proc.stdout
    assert proc.stdout.count("PASS ") >= 14


def test_gpu_profile_script_runs_end_to_end_on_a_tiny_model(tmp_path):
    """benchmarks/gpu_profile.py (where C = E's time goes on a GPU): every step on a tiny model on the
    CPU, its JSON holding the three runs with paired ratios, and 0 copies in the timed C = E passes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_profile.py"), "--small", "--device", "cpu",
                           "--tokens", "8", "--repeat", "2", "--profile-tokens", "2", "--top", "5",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "copies in the timed C = E passes: 0 " in proc.stdout
    figures = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert figures["c_equals_e_bitwise_equal"] is True and figures["c_equals_e_max_abs_logit_diff"] == 0.0
    rows = figures["rows"]
    assert [r["run"] for r in rows] == ["stock", "stock + sync", "C = E"]
    assert rows[0]["x_stock_speed_paired"] == 1.0 and all(r["repeats"] == 2 for r in rows)
    assert all(r["min"] <= r["ms_per_token"] <= r["max"] for r in rows)
    assert {p.name for p in tmp_path.iterdir()} >= {"python-stock.txt", "python-CE.txt", "profile-CE.txt"}
