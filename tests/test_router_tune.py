"""``expertcache router-tune`` (GRPO for cache hits, the SFT control) on models/small-moe.

The reward against hand-computed LRU hit rates and the simulator; GRPO and SFT end to end with a
few steps, bitwise reproducible under a seed, touching only the trained layer's weights; the output
folder loads with plain transformers and runs through ``expertcache eval``; bad options are one
line and exit 2. Runs at one thread (a seed fixes the weights for a given thread count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache import Trace, replay
from expertcache.cli.main import main as cli
from expertcache.routetune import TuneConfig, group_advantages, lru_hit_rate

MODEL = Path(__file__).resolve().parents[1] / "models" / "small-moe"
HELDOUT = MODEL / "heldout_ids.npy"
ROUTER = "model.layers.2.mlp.gate.weight"
FAST = ["--steps", "2", "--group", "3", "--max-new-tokens", "6", "--prompt-len", "8"]

needs_model = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="models/small-moe not in this checkout")


# ---------------------------------------------------------------- the reward (no torch)

def test_reward_is_the_hand_computed_lru_hit_rate():
    # C=3, k=2: {0,1} fills 2 slots (2 misses); {2,3} fills the last slot and evicts 0 (tie on last
    # use, lowest id), 2 misses; {0,1}: 1 resident, 0 copied in over 2 or 3 (both last used at
    # step 1; lowest id 2 goes): 1 hit. Hits 1 of 6 requests; after one warm pass, 1 of 4.
    seq = np.array([[0, 1], [2, 3], [0, 1]])
    assert lru_hit_rate(seq, 3, 4) == pytest.approx(1 / 6)
    assert lru_hit_rate(seq, 3, 4, warm=1) == pytest.approx(1 / 4)
    # C=4: {0,1},{2,3} fill; {0,1} hits 2; {4,5} evicts 2,3 (oldest); {2,3} evicts 0,1 (used at 2 < 3)
    seq = np.array([[0, 1], [2, 3], [0, 1], [4, 5], [2, 3]])
    assert lru_hit_rate(seq, 4, 6) == pytest.approx(2 / 10)
    assert lru_hit_rate(seq, 4, 6, warm=2) == pytest.approx(2 / 6)
    assert lru_hit_rate(seq, 6, 6) == pytest.approx(4 / 10)  # everything fits: only first uses miss
    assert np.isnan(lru_hit_rate(seq, 4, 6, warm=5))


def test_reward_agrees_with_the_simulator():
    rng = np.random.default_rng(3)
    for capacity in (2, 4, 7):
        seq = np.stack([rng.choice(8, size=2, replace=False) for _ in range(60)])
        sim = replay(Trace.from_arrays(seq, num_experts=8), capacity, "lru")
        assert lru_hit_rate(seq, capacity, 8) == pytest.approx(sim.hit_rate, abs=1e-12)


def test_group_advantages():
    assert np.allclose(group_advantages([1.0, 0.0, 1.0, 0.0]), [1, -1, 1, -1], atol=1e-3)
    assert np.array_equal(group_advantages([0.5, 0.5, 0.5]), np.zeros(3))  # no preference, no update
    a = group_advantages([0.2, 0.4, 0.9])
    assert abs(a.mean()) < 1e-12 and a[0] < a[1] < a[2]


def test_core_imports_without_torch():
    code = ("import sys, expertcache.routetune, expertcache.cli.router_tune_cmd; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_checks():
    from expertcache.errors import ConfigError

    TuneConfig(layer=2, cache=4).check().check_model([0, 1, 2, 3], 16, 2)
    for kwargs in [{"layer": 9, "cache": 4}, {"layer": 2, "cache": 17}, {"layer": 2, "cache": 1},
                   {"layer": 2, "cache": 4, "group": 1}, {"layer": 2, "cache": 4, "lora_targets": ("experts",)},
                   {"layer": 2, "cache": 4, "balance": -1.0}, {"layer": 2, "cache": 4, "balance": float("nan")}]:
        with pytest.raises(ConfigError):
            TuneConfig(**kwargs).check().check_model([0, 1, 2, 3], 16, 2)


def test_balance_loss_is_k_when_uniform_and_its_gradient_spreads_the_load():
    torch = pytest.importorskip("torch")
    from expertcache.routetune.rollout import balance_loss

    E, k = 8, 2
    uniform = torch.zeros(64, E)
    assert abs(float(balance_loss(uniform, k)) - k) < 1e-6  # E * sum_e (k/E) * (1/E) = k
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(0))
    logits[:, :2] += 4.0  # most tokens to experts 0 and 1
    logits.requires_grad_(True)
    loss = balance_loss(logits, k)
    assert float(loss.detach()) > k
    loss.backward()
    stepped = (logits - 5.0 * logits.grad).detach()
    assert float(balance_loss(stepped, k)) < float(loss.detach())  # a step down the gradient spreads the load


# ---------------------------------------------------------------- end to end on the small model

def _tune(tmp: Path, name: str, *extra: str) -> Path:
    out = tmp / name
    code = cli(["router-tune", "--model", str(MODEL), "--tokens", str(HELDOUT), "--layer", "2", "--cache", "4",
                *FAST, *extra, "--out", str(out), "--json"])
    assert code == 0
    return out


def _tensors(folder: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    import torch

    if not (MODEL / "config.json").is_file():
        pytest.skip("models/small-moe not in this checkout")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("routetune")
    try:
        yield tmp, {name: _tune(tmp, name, *extra) for name, extra in [
            ("grpo", ()), ("grpo_again", ()), ("grpo_seed1", ("--seed", "1")), ("sft", ("--sft-control",)),
            ("lora", ("--lora-rank", "2", "--lora-targets", "router,experts,attention", "--cache-tag")),
            ("grpo_lb", ("--balance", "1.0")),
        ]}
    finally:
        torch.set_num_threads(threads)


@needs_model
def test_grpo_is_deterministic_and_trains_only_the_router(runs):
    tmp, out = runs
    base, a, b, c = (_tensors(p) for p in (MODEL, out["grpo"], out["grpo_again"], out["grpo_seed1"]))
    assert a.keys() == base.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)  # same seed: bitwise the same weights
    assert not np.array_equal(a[ROUTER], c[ROUTER])   # another seed: other weights
    assert not np.array_equal(a[ROUTER], base[ROUTER])
    assert [k for k in a if not np.array_equal(a[k], base[k])] == [ROUTER]
    assert a[ROUTER].dtype == base[ROUTER].dtype == np.float16
    record = json.loads((out["grpo"] / "routetune.json").read_text())
    assert record["config"]["objective"] == "grpo" and len(record["curve"]) == 2
    assert all(0 <= s["reward"] <= 1 and s["kl"] >= 0 for s in record["curve"])
    assert record["summary"]["trained_parameters"] == 16 * 128
    assert sorted(os.listdir(tmp)) == sorted(out)  # atomic: no temporary folder left beside them


@needs_model
def test_the_load_balance_control_changes_only_the_router_and_is_recorded(runs):
    _, out = runs
    base, grpo, lb = (_tensors(p) for p in (MODEL, out["grpo"], out["grpo_lb"]))
    assert [k for k in lb if not np.array_equal(lb[k], base[k])] == [ROUTER]
    assert not np.array_equal(lb[ROUTER], grpo[ROUTER])  # the balance term moved the router differently
    record = json.loads((out["grpo_lb"] / "routetune.json").read_text())
    assert record["config"]["balance"] == 1.0 and record["config"]["objective"] == "grpo"


@needs_model
def test_sft_control_trains_the_same_parameters_without_the_reward(runs):
    _, out = runs
    base, sft, grpo = (_tensors(p) for p in (MODEL, out["sft"], out["grpo"]))
    assert [k for k in sft if not np.array_equal(sft[k], base[k])] == [ROUTER]
    assert not np.array_equal(sft[ROUTER], grpo[ROUTER])
    record = json.loads((out["sft"] / "routetune.json").read_text())
    first = json.loads((out["grpo"] / "routetune.json").read_text())["curve"][0]
    # same seed, same prompts, same starting weights: the first step's generations are the same
    assert record["config"]["objective"] == "sft" and record["curve"][0]["reward"] == first["reward"]


@needs_model
def test_lora_is_merged_into_the_stock_layout(runs):
    _, out = runs
    base, lora = _tensors(MODEL), _tensors(out["lora"])
    assert lora.keys() == base.keys()  # no adapter tensors saved
    changed = {k for k in lora if not np.array_equal(lora[k], base[k])}
    assert changed and all(k.startswith("model.layers.2.") for k in changed)
    assert ROUTER in changed and any("experts" in k for k in changed) and any("self_attn" in k for k in changed)
    assert json.loads((out["lora"] / "routetune.json").read_text())["config"]["cache_tag_text"] == "<cache=4>"


@needs_model
def test_routing_read_by_the_rollout_is_what_capture_records(runs):
    import torch

    from expertcache import capture
    from expertcache.hf.loading import load_model
    from expertcache.routetune.grpo import site_at
    from expertcache.routetune.rollout import score

    model = load_model(str(MODEL), device="cpu").float()
    ids = torch.from_numpy(np.load(HELDOUT)[:1, :24].astype(np.int64))
    _, routing = score(model, ids, 8, site_at(model, 2))
    with capture(model, phase="all") as cap:
        model(input_ids=ids)
    assert np.array_equal(np.sort(routing[0], axis=1), np.sort(cap.trace.select_layers([2]).experts[:, 0], axis=1))


@needs_model
def test_output_loads_with_transformers_and_runs_in_eval(runs, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    _, out = runs
    model = AutoModelForCausalLM.from_pretrained(out["grpo"], dtype=torch.float32)
    assert model.config.num_experts == 16
    capsys.readouterr()
    code = cli(["eval", "--model", str(out["grpo"]), "--tokens", str(HELDOUT), "--max-sequences", "1", "--max-len", "24",
                "-c", "4", "-p", "lru", "-p", "decayed", "--mode", "forward", "--json"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [r["policy"] for r in records] == ["lru", "decayed:0.95"]
    assert all(r["exact"] and r["replay_agrees"] for r in records)


@needs_model
@pytest.mark.parametrize("argv, message", [
    (["--layer", "9"], "--layer 9 is not an MoE layer"),
    (["--layer", "2", "--cache", "17"], "--cache 17 holds all 16 experts of layer 2"),
    (["--layer", "2", "--cache", "16"], "--cache 16 holds all 16 experts of layer 2: nothing is ever evicted"),
    (["--layer", "2", "--lr", "0"], "--lr must be above 0"),
    (["--layer", "2", "--lora-rank", "100000"], "--lora-rank 100000 is above 16, the full rank"),
    (["--layer", "2", "--lora-rank", "17", "--lora-targets", "router,attention"], "above 16"),
    (["--layer", "2", "--cache", "1"], "below top-k 2"),
    (["--layer", "2", "--group", "1"], "--group must be at least 2"),
    (["--layer", "2", "--lora-rank", "2", "--lora-targets", "mlp"], "--lora-targets: mlp"),
    (["--layer", "2", "--steps", "0"], "--steps"),
    (["--layer", "2", "--reward", "lfu-hit"], "--reward"),
])
def test_bad_options_are_one_line(argv, message, tmp_path, capsys):
    cache = [] if "--cache" in argv else ["--cache", "4"]
    args = ["router-tune", "--model", str(MODEL), "--tokens", str(HELDOUT), *cache, *argv, "--out", str(tmp_path / "t")]
    try:
        code = cli(args)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t").exists() and os.listdir(tmp_path) == []


@needs_model
def test_missing_model_existing_out_and_missing_text_are_one_line(tmp_path, capsys):
    (tmp_path / "exists").mkdir()
    cases = [
        (["--model", str(tmp_path / "nope"), "--tokens", str(HELDOUT), "--out", str(tmp_path / "a")], "no such folder"),
        (["--model", str(tmp_path), "--tokens", str(HELDOUT), "--out", str(tmp_path / "a")], "not a checkpoint"),
        (["--model", str(MODEL), "--tokens", str(HELDOUT), "--out", str(tmp_path / "exists")], "already exists"),
        (["--model", str(MODEL), "--text", str(tmp_path / "none.txt"), "--out", str(tmp_path / "b")], "no such file"),
        (["--model", str(MODEL), "--tokens", str(HELDOUT), "--out", str(tmp_path / "no" / "c")], "does not exist"),
    ]
    for argv, message in cases:
        code = cli(["router-tune", *argv, "--layer", "2", "--cache", "4"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
