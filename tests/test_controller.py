"""The learned set controller (controller:PATH:THR[:W]): heads file, schedule, equivalences, training.

Must be true (issue 13): at THR >= 1 the controller is prefix:W (same sets, copies, switches, NLL);
at THR = 0 with mu = the router's own ranking (untrained heads) and W = 1 it never restricts
routing, so it matches lossless on-demand loading; training is deterministic under a seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from expertcache import ConfigError, PolicyError  # noqa: E402
from expertcache.cli.main import main  # noqa: E402
from expertcache.hf import evaluate  # noqa: E402
from expertcache.hf.controller import ControllerSpec, parse_controller  # noqa: E402
from expertcache.hf.controller_heads import Heads, init_heads, load_heads, save_heads  # noqa: E402
from expertcache.hf.controller_train import TrainOptions, train_controller  # noqa: E402
from expertcache.hf.holding import parse_holding  # noqa: E402

FOLDER = Path(__file__).resolve().parents[1] / "models" / "small-moe"
pytestmark = [pytest.mark.skipif(not (FOLDER / "config.json").is_file(), reason="models/small-moe is not in this checkout"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)


@pytest.fixture(scope="module")
def train_ids():
    from transformers import AutoTokenizer

    text = Path(argparse.__file__).read_text(encoding="utf-8")  # training text; evaluation uses heldout_ids.npy
    return np.asarray(AutoTokenizer.from_pretrained(FOLDER)(text)["input_ids"], dtype=np.int64)


@pytest.fixture(scope="module")
def seqs():
    return np.load(FOLDER / "heldout_ids.npy")[:2, :48]


TINY = dict(capacity=8, steps=2, batch=2, seq_len=32, warmup=4, samples=2)


@pytest.fixture(scope="module")
def trained(model, train_ids, tmp_path_factory):
    heads, config, _ = train_controller(model, train_ids, TrainOptions(objective="differentiable", **TINY))
    path = tmp_path_factory.mktemp("heads") / "heads.pt"
    save_heads(path, heads, config)
    return str(path)


@pytest.fixture(scope="module")
def untrained(model, train_ids, tmp_path_factory):
    heads, config, _ = train_controller(model, train_ids, TrainOptions(**{**TINY, "steps": 0}))
    path = tmp_path_factory.mktemp("heads") / "router.pt"
    save_heads(path, heads, config)
    return str(path)


# ---------------------------------------------------------------------- the schedule, by hand
def _hand_spec(thr: float) -> ControllerSpec:
    config = dict(layers=[0], capacity=2, num_experts=4, hidden_size=2, top_k=1, warmup=1, ema_decay=0.5,
                  objective="none", seed=0)
    t = init_heads(config)
    t["beta_c"][0] = torch.tensor([-10.0, 10.0])  # z = -10 * held mass + 10 * missed share
    t["mu_a"][0], t["mu_e"][0] = 0.0, 1.0  # mu = ema of the router's probabilities
    return ControllerSpec("hand.pt", thr, 1, Heads("hand.pt", config, t))


def _run_hand(thr: float) -> list:
    probs = [[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7], [0.1, 0.7, 0.1, 0.1]]
    logits = torch.log(torch.tensor(probs))
    own = np.argmax(probs, axis=1)[:, None]
    holder = _hand_spec(thr).holder(0, 4, 2)
    holder.observe(torch.zeros(4, 2), logits, own, 1, 4)
    return [None if (s := holder.step(own[t])) is None else s.tolist() for t in range(4)]


def test_refresh_rule_and_selection_by_hand():
    # t0 warm-up (prefix:1): {0}. t1: held 0.1, missed 1 -> z = 9 > 0: ema [.225,.375,.075,.075] -> {0,1}
    # t2: held 0.2, missed 1 -> z = 8: ema [.1625,.2375,.0875,.3875] -> {1,3}; t3: held 0.8, missed 0 -> z = -8: hold
    assert _run_hand(0.5) == [[0], [0, 1], [1, 3], None]
    assert _run_hand(0.0) == [[0], [0, 1], [1, 3], [1, 3]]  # threshold 0: every token
    assert _run_hand(1.0) == [[0], None, None, None]  # threshold >= 1: never after the warm-up
    # logit(0.9998) = 8.52: z = 9 refreshes, z = 8 does not (compared on the logit, no rounding of sigmoid)
    assert _run_hand(0.9998) == [[0], [0, 1], None, None]


# ---------------------------------------------------------------------- spec and heads file
def test_spec_parsing(trained):
    spec = parse_holding(f"controller:{trained}:0.5")
    assert isinstance(spec, ControllerSpec) and spec.threshold == 0.5 and spec.warmup == 4
    assert spec.spec == f"controller:{trained}:0.5" and not spec.needs_future
    assert parse_controller(f"controller:{trained}:0.9:16").warmup == 16
    assert parse_controller(f"controller:{trained}:0.9:16").spec == f"controller:{trained}:0.9:16"
    for bad in ("controller", f"controller:{trained}", f"controller:{trained}:x", f"controller:{trained}:-1",
                f"controller:{trained}:nan", f"controller:{trained}:0.5:0", "controller::0.5"):
        with pytest.raises(PolicyError):
            parse_controller(bad)


def test_heads_file_round_trip_and_refusals(trained, tmp_path):
    heads = load_heads(trained)
    assert heads.config["layers"] == [0, 1, 2, 3] and heads.config["capacity"] == 8
    assert heads.config["objective"] == "differentiable" and heads.config["seed"] == 0
    assert os.path.getsize(trained) < 100_000  # small
    cases = {"missing.pt": None, "garbage.pt": b"not a torch file at all", "empty.pt": b""}
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
    blob = torch.load(trained, weights_only=True)
    for name, change in [("version.pt", {"version": 2}), ("format.pt", {"format": "other"}),
                         ("shape.pt", {"mu_w": torch.zeros(4, 16, 3)}), ("nan.pt", {"beta_b": torch.full((4,), math.nan)}),
                         ("config.pt", {"config": {**blob["config"], "capacity": "8"}}),
                         ("nolayer.pt", {"config": {k: v for k, v in blob["config"].items() if k != "layers"}})]:
        torch.save({**blob, **change}, tmp_path / name)
        cases[name] = 1
    torch.save({"format": "expertcache-controller", "version": 1, "evil": argparse.Namespace()}, tmp_path / "obj.pt")
    cases["obj.pt"] = 1
    for name in cases:
        with pytest.raises(ConfigError) as err:
            load_heads(str(tmp_path / name))
        assert name in str(err.value) and "\n" not in str(err.value)


def test_heads_must_fit_the_run(model, trained):
    import expertcache

    with pytest.raises(ConfigError, match="capacity 8"):
        expertcache.offload(model, 4, f"controller:{trained}:0.5")
    with pytest.raises(ConfigError, match="pool='layer'"):
        expertcache.offload(model, 8, f"controller:{trained}:0.5", pool="global")


# ---------------------------------------------------------------------- equivalences in the live harness
def test_threshold_at_least_one_is_static(model, trained, seqs):
    ev = evaluate(model, seqs, 8, [f"controller:{trained}:1", "prefix:4", f"controller:{trained}:7.5"], mode="forward")
    ctl, static, far = (r.to_dict() for r in ev.results)
    assert ctl["nll"] == static["nll"] == far["nll"]  # the same sets, so bitwise the same computation
    for key in ("copies_total", "copies_steady", "switches", "refreshes", "routing_changed"):
        assert ctl[key] == static[key] == far[key], key
    counts = [[{k: v for k, v in c.items() if k != "copy_seconds"} for c in r["per_layer"]] for r in (ctl, static, far)]
    assert counts[0] == counts[1] == counts[2]
    assert static["refreshes"] == 4 * 2 * 4  # 4 layers x 2 sequences x W = 4 warm-up tokens


def test_threshold_zero_with_the_routers_ranking_is_lossless(model, untrained, seqs):
    ev = evaluate(model, seqs, 8, [f"controller:{untrained}:0:1", "dwell:1:1"], mode="decode")
    ctl, on_demand = (r.to_dict() for r in ev.results)
    assert abs(ctl["nll"] - on_demand["nll"]) <= 5e-3 and abs(ctl["dnll"]) <= 5e-3
    assert ctl["routing_changed"] == 0.0 and ctl["switches"] == on_demand["switches"]  # never restricted
    assert ctl["refreshes"] == 4 * 2 * 48  # every token, every layer
    assert not ctl["lossless"] and ctl["rho"] >= on_demand["rho"]  # holds C, so it may copy more


def test_decode_and_forward_make_the_same_copies(model, trained, seqs):
    specs = [f"controller:{trained}:0.5", f"controller:{trained}:0.3:2"]
    fwd = [r.to_dict() for r in evaluate(model, seqs, 8, specs, mode="forward").results]
    dec = [r.to_dict() for r in evaluate(model, seqs, 8, specs, mode="decode").results]
    for a, b in zip(fwd, dec):
        assert (a["copies_total"], a["copies_steady"], a["refreshes"]) == (b["copies_total"], b["copies_steady"], b["refreshes"])
        assert abs(a["nll"] - b["nll"]) < 1e-4
        for key in ("switch_rate", "rho", "dnll", "ms_per_token", "c_ms", "tau_ms"):
            assert key in a


# ---------------------------------------------------------------------- training
@pytest.mark.parametrize("objective", ["differentiable", "reinforce"])
def test_training_is_deterministic_under_a_seed(model, train_ids, objective):
    runs = [train_controller(model, train_ids, TrainOptions(objective=objective, seed=s, **TINY))[0] for s in (3, 3, 4)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not torch.equal(runs[0][k], runs[2][k]) for k in runs[0])
    assert any(not torch.equal(runs[0][k], v) for k, v in init_heads({"layers": [0, 1, 2, 3], "num_experts": 16,
                                                                        "hidden_size": 128}).items())


def test_priced_objective_weights_copies_by_tau():
    assert TrainOptions(capacity=8, price_tau_ms=0.51, exchange=0.02).copy_weight == pytest.approx(0.0102)
    assert TrainOptions(capacity=8).copy_weight == 0.05


# ---------------------------------------------------------------------- CLI
def test_cli_train_then_eval(tmp_path, capsys):
    text = argparse.__file__
    out = tmp_path / "h.pt"
    assert main(["controller", "train", "--model", str(FOLDER), "--text", text, "--layers", "0-3", "-c", "8",
                 "--objective", "reinforce", "--price-tau", "0.51ms", "--steps", "1", "--batch", "1", "--seq-len", "24",
                 "--samples", "2", "--warmup", "4", "--out", str(out), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["out"] == str(out) and rec["copy_weight"] == pytest.approx(0.0102) and rec["bytes"] == os.path.getsize(out)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.load(FOLDER / "heldout_ids.npy")[:1, :24])
    assert main(["eval", "--model", str(FOLDER), "--tokens", str(ids), "-c", "8", "-p", f"controller:{out}:0.5",
                 "--mode", "forward", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["policy"] == f"controller:{out}:0.5" and not rec["lossless"] and rec["switch_rate"] is not None


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00" * 10)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.load(FOLDER / "heldout_ids.npy")[:1, :16])
    big = tmp_path / "big.npy"
    np.save(big, np.full(200, 5000, dtype=np.int64))  # beyond the vocabulary of 2048
    cases = [
        ["controller", "train", "--model", str(FOLDER), "--tokens", str(big), "-c", "8", "--out", str(tmp_path / "x.pt")],
        ["eval", "--model", str(FOLDER), "--tokens", str(ids), "-c", "8", "-p", f"controller:{bad}:0.5"],
        ["eval", "--model", str(FOLDER), "--tokens", str(ids), "-c", "8", "-p", f"controller:{tmp_path}/none.pt:0.5"],
        ["controller", "train", "--model", str(FOLDER), "--text", argparse.__file__, "-c", "8", "--exchange", "0.1",
         "--out", str(tmp_path / "x.pt")],
        ["controller", "train", "--model", str(FOLDER), "--text", str(tmp_path / "none.txt"), "-c", "8",
         "--out", str(tmp_path / "x.pt")],
        ["controller", "train", "--model", str(FOLDER), "--text", argparse.__file__, "-c", "8", "--objective", "x",
         "--out", str(tmp_path / "x.pt")],
    ]
    for argv in cases:
        code = None
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "x.pt").exists()
    with pytest.raises(SystemExit) as exc:
        main(["controller", "train", "--help"])
    assert exc.value.code == 0
