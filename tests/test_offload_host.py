"""Host tiers under the slots (``host="memory" | "mmap" | "direct"``): exact outputs, copies equal
to the replay of the captured trace, and per-tier counts that add up, for every host mode."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from expertcache.cli.main import main  # noqa: E402
from expertcache.errors import ConfigError  # noqa: E402
from expertcache.hf import OffloadRun, evaluate, load_model  # noqa: E402
from expertcache.hf.host import HOSTS, host_of  # noqa: E402
from expertcache.hf.pagecache import read_bytes_self  # noqa: E402
from expertcache.hf.toy import save_toy_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

POLICIES = ["lru", "belady", "dwell:2:4"]


def _synced(folder):
    """The checkpoint's files written back, so the kernel can drop their cached pages."""
    for name in os.listdir(folder):
        with open(folder / name, "rb") as fh:
            os.fsync(fh.fileno())
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {fam: _synced(save_toy_checkpoint(fam, tmp_path_factory.mktemp(fam))) for fam in ("olmoe", "mixtral")}


def seqs():
    return [np.random.default_rng(s).integers(0, 95, n) for s, n in ((0, 24), (1, 20))]


def o_direct_ok(folder) -> bool:
    try:
        fd = os.open(folder / "model.safetensors", os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


@pytest.fixture(scope="module")
def evaluations(ckpts):
    """Every host mode of both families, evaluated against the all-resident reference."""
    out = {}
    for fam, folder in ckpts.items():
        for host in HOSTS:
            if host == "direct" and not o_direct_ok(folder):
                continue
            model = load_model(folder, host=host)
            out[fam, host] = evaluate(model, seqs(), 3, POLICIES, mode="forward", reference="resident")
    return out


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_every_host_mode_is_exact_and_copies_equal_the_replay(evaluations, family):
    base = evaluations[family, "memory"]
    hosts = [h for h in HOSTS if (family, h) in evaluations]
    assert "mmap" in hosts
    for host in hosts:
        ev = evaluations[family, host]
        assert ev.failures() == []
        assert ev.reference.nll == base.reference.nll  # the reference reads the same bytes back
        for r, b in zip(ev.results, base.results):
            d = r.to_dict()
            assert d["host"] == host
            assert r.policy == b.policy and r.run.nll == b.run.nll  # bitwise the same weights in the slots
            assert [(c.copies_total, c.copies_steady) for c in r.stats.per_layer] == \
                   [(c.copies_total, c.copies_steady) for c in b.stats.per_layer]
            if r.lossless:
                assert d["exact"] and abs(d["nll_delta"]) <= 5e-3
                assert d["replay_agrees"] is True
                assert d["replay_copies_total"] == d["copies_total"]


def test_tier_hits_add_up_per_host_mode(evaluations):
    for (fam, host), ev in evaluations.items():
        for r in ev.results:
            d = r.to_dict()
            t, loads = d["tier_hits"], d["copies_total"] + d["prefetch_copies"]
            assert t["slot"] + d["copies_total"] == sum(c["requests"] for c in d["per_layer"])
            if host == "memory":
                assert (t["host_memory"], t["page_cache"], t["device"]) == (loads, 0, 0)
                assert d["memory"]["host_expert_bytes"] > 0 and d["memory"]["file_expert_bytes"] == 0
            else:
                assert t["host_memory"] == 0 and t["page_cache"] + t["device"] == loads
                assert d["memory"]["host_expert_bytes"] == 0
                in_memory = evaluations[fam, "memory"].results[0].to_dict()["memory"]["host_expert_bytes"]
                assert d["memory"]["file_expert_bytes"] == in_memory  # the same experts, left in the files
                assert t["page_cache_bytes"] + t["device_bytes"] == loads * d["expert_bytes"]
            if host == "direct":
                assert t["device"] == loads and t["device_bytes"] == loads * d["expert_bytes"]
                if d["read_bytes_self"] is not None:  # O_DIRECT: every byte came from the device, for this process
                    assert d["read_bytes_self"] >= t["device_bytes"]


def test_mmap_starts_cold_then_hits_the_page_cache(tmp_path):
    # a checkpoint of its own: no other live mapping in this process holds its pages
    model = load_model(_synced(save_toy_checkpoint("olmoe", tmp_path / "cold")), host="mmap")
    x = torch.as_tensor(seqs()[0])[None]
    with OffloadRun(model, 8, "lru") as run:  # C = E: each expert loaded once per sequence
        model(input_ids=x)
        first = run.stats().tier_hits()
        run.clear_counters()
        model(input_ids=x)
        second = run.stats().tier_hits()
    assert first["device"] > 0  # dropped at load: the first touch of an expert reads the device
    assert second["device"] == 0 and second["page_cache"] > 0  # now the page cache holds them all


def test_files_hold_the_loaded_bytes_and_the_model_releases_its_copy(ckpts):
    mem = load_model(ckpts["mixtral"])
    files = load_model(ckpts["mixtral"], host="mmap")
    from expertcache.hf.model import find_sites

    for a, b in zip(find_sites(mem), find_sites(files)):
        fx = host_of(b.experts)
        gu, dn = fx.materialize(torch.device("cpu"))
        assert torch.equal(gu, a.experts.gate_up_proj) and torch.equal(dn, a.experts.down_proj)
        for p in (b.experts.gate_up_proj, b.experts.down_proj):
            assert p.untyped_storage().nbytes() == p.element_size()  # a placeholder: no expert memory
            assert torch.isnan(p[0, 0, 0])  # the stock path on it would give NaN, never a silent number


def test_refusals_are_one_line(ckpts):
    with pytest.raises(ConfigError, match="converted on load"):
        load_model(ckpts["olmoe"], host="mmap", dtype="bfloat16")
    with pytest.raises(ConfigError, match="host"):
        load_model(ckpts["olmoe"], host="disk")


def test_direct_on_a_filesystem_without_o_direct_is_refused(ckpts, tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no /dev/shm")
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(dir=shm)
    try:
        shutil.copytree(ckpts["olmoe"], folder, dirs_exist_ok=True)
        try:
            model = load_model(folder, host="direct")
        except ConfigError as exc:
            assert "O_DIRECT" in str(exc) and "\n" not in str(exc)
        else:  # this tmpfs takes O_DIRECT: then it serves exactly
            assert evaluate(model, seqs()[:1], 3, ["lru"], mode="forward").failures() == []
    finally:
        shutil.rmtree(folder)


def eval_record(capsys, folder, tmp_path, *argv):
    """One ``eval --json`` record of lru on ``folder`` (40 token ids, sequences of 20), and stderr."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 95, 40))
    code = main(["eval", "--model", str(folder), "--tokens", str(ids), "-p", "lru", "--max-len", "20",
                 "--mode", "forward", "--json", *map(str, argv)])
    out, err = capsys.readouterr()
    assert code == 0, err
    (rec,) = [json.loads(line) for line in out.splitlines()]
    return rec, err


def test_eval_cli_host_repeats_and_a_capacity_above_e(ckpts, tmp_path, capsys):
    rec, err = eval_record(capsys, ckpts["olmoe"], tmp_path, "-c", 100, "--host", "mmap", "--repeats", 2)
    assert "capacity 100 is at or above the 8 experts" in err and "every expert fits; clamped to 8" in err
    assert len([ln for ln in err.splitlines() if "clamped" in ln]) == 1
    assert rec["capacity"] == 8 and rec["capacity_requested"] == 100 and rec["copies_steady"] == 0
    assert rec["host"] == "mmap" and rec["repeats"] == 2 and len(rec["ms_per_token_runs"]) == 2
    assert rec["ms_per_token"] in rec["ms_per_token_runs"] and rec["ms_per_token_spread"] >= 0
    assert rec["exact"] and rec["replay_agrees"]
    code = main(["eval", "--model", str(ckpts["olmoe"]), "--tokens", str(tmp_path / "ids.npy"), "-c", "3", "-p", "lru",
                 "--max-len", "20", "--host", "mmap"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "host mmap" in out and "page cache" in out and "read MB (self)" in out


def test_calibrate_cli_per_host(ckpts, capsys):
    for host in ("memory", "mmap"):
        code = main(["calibrate", "--model", str(ckpts["olmoe"]), "--host", host, "--repeats", "4", "--tokens", "3",
                     "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        (rec,) = [json.loads(line) for line in out.splitlines()]
        assert rec["host"] == host and rec["tau_ms"] > 0 and rec["tau_ms_p10"] <= rec["tau_ms"] <= rec["tau_ms_p90"]
        if host == "mmap":
            assert rec["tau_tiers"] == {"page_cache": 4, "device": 0}  # warmed first: page-cache hits
        else:
            assert rec["tau_tiers"] is None


def test_read_bytes_self_is_this_process():
    before = read_bytes_self()
    if before is None:
        pytest.skip("/proc/self/io unreadable")
    assert isinstance(before, int) and read_bytes_self() >= before


def test_save_packed_keeps_every_byte_and_loads_without_a_copy(ckpts, tmp_path):
    from expertcache.hf.model import find_sites
    from expertcache.hf.wall import save_packed

    out = save_packed(ckpts["olmoe"], tmp_path / "packed")
    with pytest.raises(ConfigError, match="already exists"):
        save_packed(ckpts["olmoe"], out)
    a, b = load_model(ckpts["olmoe"]), load_model(out, host="mmap")
    for x, y in zip(find_sites(a), find_sites(b)):
        gu, dn = host_of(y.experts).materialize(torch.device("cpu"))
        assert torch.equal(gu, x.experts.gate_up_proj) and torch.equal(dn, x.experts.down_proj)
        # two reads per expert: its gate_up rows and its down matrix, slices of the packed tensors
        assert sorted(s.nbytes for s in host_of(y.experts).segments[0]) == [x.expert_bytes // 3, x.expert_bytes // 3 * 2]
    ev = evaluate(b, seqs()[:1], 3, ["lru"], mode="forward", reference="resident")
    assert ev.failures() == [] and ev.results[0].exact


def _cgroup_wall() -> bool:
    from expertcache.wall.capacity import detect_walls

    try:
        return bool(detect_walls()["cgroup"]["ok"])
    except Exception:  # noqa: BLE001 - no wall here is a skip, whatever the reason
        return False


@pytest.mark.skipif(not _cgroup_wall(), reason="no memory cgroup wall on this machine")
def test_eval_behind_the_memory_wall_is_exact_and_proves_it(ckpts, tmp_path, capsys):
    rec, _ = eval_record(capsys, ckpts["olmoe"], tmp_path, "-c", 3, "--host", "mmap", "--memory-wall", "50MB")
    wall = rec["memory_wall"]
    assert wall["capacity_bytes"] == 50 * 10**6 and wall["enforced_by"].startswith("cgroup")
    assert wall["headroom_note"].startswith("the limit follows the worker")  # no calibration run
    assert wall["proof_ok"], wall
    p = wall["proof"]
    assert p["tier_peak_bytes"] <= 50 * 10**6 * 1.02 + (4 << 20)
    assert p["tier_measure"].startswith(("cachestat", "mincore"))  # the shards' pages, not every file the child read
    assert rec["exact"] and rec["replay_agrees"] and rec["host"] == "mmap" and rec["reference"] == "lru at C=3"
    t = rec["tier_hits"]
    assert t["page_cache"] + t["device"] == rec["copies_total"]


def test_load_offloaded_serves_from_the_files(ckpts):
    from expertcache import load_offloaded

    model, run = load_offloaded(ckpts["mixtral"], capacity=3, policy="lru", host="direct"
                                if o_direct_ok(ckpts["mixtral"]) else "mmap")
    x = torch.as_tensor(seqs()[0])[None]
    with torch.no_grad():
        logits = model(input_ids=x).logits
    stats = run.stats()
    run.detach()
    ref = load_model(ckpts["mixtral"])
    with torch.no_grad():
        expected = ref(input_ids=x).logits
    assert torch.allclose(logits, expected, atol=1e-5)
    d = stats.to_dict()
    assert d["host"] in ("mmap", "direct") and d["memory"]["host_expert_bytes"] == 0
    assert d["tier_hits"]["page_cache"] + d["tier_hits"]["device"] == d["copies_total"] > 0
