"""Set-holding (lossy) policies in the live harness: masked routing per family, dwell and static.

Quality claims (dNLL > 0 for dwell/static, lossless rules exact) need a trained model: see
tests/test_small_moe_policies.py. Here: exactness of the masked routing, the refresh schedule,
the copies, and the guarantee that the router only ever picks resident experts.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import expertcache  # noqa: E402
from expertcache import ConfigError, PolicyError  # noqa: E402
from expertcache.cli.main import main  # noqa: E402
from expertcache.hf import find_sites  # noqa: E402
from expertcache.hf.holding import SetHolder, parse_holding  # noqa: E402
from expertcache.hf.routing import ROUTES, route_for  # noqa: E402
from expertcache.hf.toy import save_toy_checkpoint, toy_model  # noqa: E402

SOFTMAX_FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def ids(b, n, seed=1):
    return torch.randint(0, 95, (b, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- parsing and the schedule
def test_parse_holding():
    assert parse_holding("dwell:16").spec == "dwell:16:128"  # w defaults to 8k
    assert parse_holding("dwell:16:64").spec == "dwell:16:64"
    assert parse_holding("prefix:64").spec == "prefix:64"
    assert parse_holding("static:64").spec == "prefix:64"  # the old spelling, accepted with a notice
    assert parse_holding("lru") is None and parse_holding("decayed:0.9") is None
    for bad in ("dwell", "dwell:0", "dwell:4:0", "dwell:1:2:3", "static", "static:x", "static:1:2", "prefix", "prefix:0",
                "prefix:1:2"):
        with pytest.raises(PolicyError):
            parse_holding(bad)


def test_dwell_schedule_warm_start_then_every_k():
    holder = SetHolder(parse_holding("dwell:3:4"), num_experts=8, capacity=2)
    refreshed = [holder.step(np.array([t % 8])) is not None for t in range(14)]
    # every token until the window (4) first fills at t = 3, then every 3 tokens: 6, 9, 12
    assert [t for t, r in enumerate(refreshed) if r] == [0, 1, 2, 3, 6, 9, 12]


def test_set_is_the_most_requested_in_the_window_including_the_current_token():
    holder = SetHolder(parse_holding("dwell:1:3"), num_experts=6, capacity=2)
    assert holder.step(np.array([0, 1])).tolist() == [0, 1]
    assert holder.step(np.array([1, 2])).tolist() == [1, 2]  # 1 twice; 2 more recent than 0
    assert holder.step(np.array([3, 4])).tolist() == [1, 3]  # 1 twice; then the most recent (3, 4), smaller id
    assert holder.step(np.array([1, 4])).tolist() == [1, 4]  # window [1,2], [3,4], [1,4]: 1 and 4 twice


def test_dwell_one_one_holds_the_current_demand_and_static_freezes():
    holder = SetHolder(parse_holding("dwell:1:1"), num_experts=8, capacity=3)
    for demand in ([0, 1], [5, 6], [2, 7]):
        assert set(demand) <= set(holder.step(np.array(demand)).tolist())
    static = SetHolder(parse_holding("prefix:2"), num_experts=8, capacity=2)
    static.step(np.array([0, 1]))
    frozen = static.step(np.array([0, 3])).tolist()
    assert frozen == [0, 3] and all(static.step(np.array([5, 6])) is None for _ in range(5))
    assert static.current.tolist() == frozen


# ---------------------------------------------------------------------- masked routing, per family
@pytest.mark.parametrize("family", SOFTMAX_FAMILIES)
def test_masked_routing_is_the_routers_own_and_stays_inside_the_mask(family):
    model = toy_model(family)
    site = find_sites(model)[0]
    router = site.router
    route = route_for(router, site.layer, "dwell:1:1")
    h = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    logits, weights, index = router(h)
    w, i = route(router, logits, torch.ones_like(logits, dtype=torch.bool))
    assert torch.equal(i, index) and torch.equal(w, weights)  # unrestricted: bitwise the router's
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[:, torch.tensor([0, 3, 5])] = True
    w, i = route(router, logits, allowed)
    assert allowed.gather(1, i).all()
    probs = torch.softmax(logits.float(), dim=-1)
    if family == "mixtral" or router.norm_topk_prob:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(64), rtol=0, atol=1e-6)
    else:  # not normalised: the chosen experts' probabilities over all experts, as the family does
        torch.testing.assert_close(w.float(), probs.gather(1, i), rtol=0, atol=1e-3)


def test_group_limited_routers_are_refused_in_one_line():
    model = toy_model("deepseek_v3")
    with pytest.raises(ConfigError) as err:
        expertcache.offload(model, 4, "dwell:4")
    msg = str(err.value)
    # transformers 5.24 names the router; 5.17 does not declare DeepSeek-V3's router at all
    assert ("DeepseekV3TopkRouter" in msg and "group-limited" in msg) or "router is not exposed" in msg
    assert "\n" not in msg
    assert set(ROUTES) == {"OlmoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter"}


# ---------------------------------------------------------------------- live
@pytest.mark.parametrize("family", SOFTMAX_FAMILIES)
def test_dwell_one_one_is_lossless_and_dwell_keeps_choices_resident(family):
    model = toy_model(family)
    x = ids(1, 48, seed=2)
    with torch.no_grad():
        stock = model(input_ids=x).logits
        with expertcache.offload(model, 3, "dwell:1:1") as run:
            exact = model(input_ids=x).logits
        torch.testing.assert_close(exact, stock, rtol=0, atol=1e-5)
        with expertcache.offload(model, 3, "lru") as lru:
            model(input_ids=x)
        with expertcache.capture(model) as cap, expertcache.offload(model, 3, "dwell:4:8") as held:
            model(input_ids=x)
    stats = held.stats()
    assert not stats.lossless and stats.refreshes == 3 * (8 + (48 - 8) // 4)
    assert stats.copies_steady < lru.stats().copies_steady
    # between refreshes (t = 7, 11, ..., 47 once the window has filled) the chosen experts never
    # leave the held set: at most C distinct per hold
    ex = cap.trace.experts  # [T, L, k]
    for layer in range(ex.shape[1]):
        for start in range(7, 48, 4):
            assert np.unique(ex[start : start + 4, layer]).size <= 3
    assert run.stats().switches == lru.stats().switches  # the same choices as lossless on-demand


def test_batched_holding_uses_the_union_of_the_rows():
    model = toy_model("olmoe")
    x = ids(2, 20, seed=4)
    with torch.no_grad():
        stock = model(input_ids=x).logits
        with expertcache.offload(model, 4, "dwell:1:1"):  # C >= 2 rows x top-2: never restricts
            torch.testing.assert_close(model(input_ids=x).logits, stock, rtol=0, atol=1e-5)
        with expertcache.capture(model) as cap, expertcache.offload(model, 4, "prefix:6") as run:
            model(input_ids=x)
    assert run.stats().batch == 2
    chosen = np.unique(cap.trace.experts[6:, 0])
    assert chosen[chosen >= 0].size <= 4  # after the prefix: only the frozen set


def test_holding_refuses_global_pools_and_prefetch():
    model = toy_model("olmoe")
    with pytest.raises(ConfigError, match="pool='layer' and no prefetch"):
        expertcache.offload(model, 4, "dwell:4", pool="global")
    with pytest.raises(ConfigError, match="pool='layer' and no prefetch"):
        expertcache.offload(model, 4, "prefix:8", prefetch="next-layer")


# ---------------------------------------------------------------------- CLI: eval, calibrate
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hold")
    np.save(root / "ids.npy", np.random.default_rng(0).integers(0, 95, (2, 24)))
    return save_toy_checkpoint("qwen3_moe", root / "m"), root / "ids.npy"


def test_eval_lossy_records_carry_the_cost_model_fields(capsys, ckpt):
    model, tokens = ckpt
    code = main(["eval", "--model", str(model), "--tokens", str(tokens), "-c", "4", "-p", "lru", "-p", "dwell:4:8",
                 "-p", "prefix:8", "--slow-copies", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    recs = {r["policy"]: r for r in map(json.loads, out.splitlines())}
    assert set(recs) == {"lru", "dwell:4:8", "prefix:8"}
    for r in recs.values():
        assert {"c_ms", "rho", "dnll", "tau_ms", "slow_copies", "switch_rate", "lossless"} <= r.keys()
        assert r["slow_copies"] == 3 and r["rho"] == r["copies_per_token"] and r["dnll"] == r["nll_delta"]
    assert recs["lru"]["lossless"] and recs["lru"]["replay_agrees"] and recs["lru"]["exact"]
    for p in ("dwell:4:8", "prefix:8"):
        assert not recs[p]["lossless"] and recs[p]["replay_agrees"] is None
        assert recs[p]["copies_steady"] < recs["lru"]["copies_steady"]
        assert recs[p]["switch_rate"] <= recs["lru"]["switch_rate"]


def test_calibrate_json_and_errors(capsys, ckpt, tmp_path):
    model, _ = ckpt
    assert main(["calibrate", "--model", str(model), "--repeats", "5", "--tokens", "4", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["tau_ms_p10"] <= rec["tau_ms"] <= rec["tau_ms_p90"] and rec["tau_samples"] == 5
    assert rec["c_ms_p10"] <= rec["c_ms"] <= rec["c_ms_p90"] and rec["c_samples"] == 5 and rec["expert_bytes"] > 0
    assert main(["calibrate", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.json" in err
