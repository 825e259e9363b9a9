"""Expert pools on disk: written bytes, manifest, damage refused with one line, real checkpoint bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from expertcache import Trace
from expertcache.errors import ConfigError
from expertcache.formats.safetensors import read_header
from expertcache.tier.checkpoint import expert_tensors
from expertcache.tier.pool import ALIGN, checksum, open_pool, pool_from_trace, synthetic_bytes

SIZE = 50_000  # deliberately not a multiple of 4096


def small_trace(L=3, E=5, T=6):
    rng = np.random.default_rng(0)
    ex = np.stack([[rng.choice(E, 2, replace=False) for _ in range(L)] for _ in range(T)])
    return Trace.from_arrays(ex, num_experts=E)


def cli(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *map(str, argv)], capture_output=True,
                          text=True, **kw)


@pytest.mark.parametrize("layout", ["files", "packed"])
def test_written_bytes_are_the_deterministic_source(tmp_path, layout):
    pool = pool_from_trace(tmp_path / "p", small_trace(), expert_bytes=SIZE, layout=layout, seed=7)
    assert (pool.num_layers, pool.num_experts, pool.expert_bytes) == (3, 5, SIZE)
    for li in range(3):
        for e in range(5):
            ent = pool.entry(li, e)
            with open(ent.path, "rb") as fh:
                fh.seek(ent.offset)
                data = fh.read(ent.size)
            assert data == synthetic_bytes(7, li, e, SIZE)
            assert checksum(data) == ent.digest
            if layout == "packed":
                assert ent.offset % ALIGN == 0
    assert open_pool(tmp_path / "p", verify=True).verify() == 15
    man = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert man["layout"] == layout and man["expert_bytes"] == SIZE and len(man["entries"]) == 15
    assert not [p for p in (tmp_path / "p").rglob("*.tmp")]  # atomic writes leave nothing behind


def test_same_seed_same_checksums_other_seed_differs(tmp_path):
    a = pool_from_trace(tmp_path / "a", small_trace(), expert_bytes=SIZE, layout="files", seed=1)
    b = pool_from_trace(tmp_path / "b", small_trace(), expert_bytes=SIZE, layout="packed", seed=1)
    c = pool_from_trace(tmp_path / "c", small_trace(), expert_bytes=SIZE, seed=2)
    dig = lambda p: [e.digest for row in p.entries for e in row]  # noqa: E731
    assert dig(a) == dig(b) and dig(a) != dig(c)
    assert len(set(dig(a))) == 15  # every entry differs from every other


@pytest.mark.parametrize("layout", ["files", "packed"])
def test_damaged_pool_is_refused_naming_the_file(tmp_path, layout):
    root = tmp_path / "p"
    pool = pool_from_trace(root, small_trace(), expert_bytes=SIZE, layout=layout)
    victim = pool.entry(1, 2)
    name = os.path.relpath(victim.path, root)
    # altered: sizes still match, so only a checksum sees it
    with open(victim.path, "r+b") as fh:
        fh.seek(victim.offset + 100)
        byte = fh.read(1)
        fh.seek(victim.offset + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    open_pool(root)  # sizes fine
    with pytest.raises(ConfigError, match=f"{name}: altered") as err:
        open_pool(root, verify=True)
    assert "\n" not in str(err.value)
    # truncated
    with open(victim.path, "r+b") as fh:
        fh.truncate(os.path.getsize(victim.path) - 10)
    with pytest.raises(ConfigError, match=f"{name}: truncated"):
        open_pool(root)
    # missing
    os.unlink(victim.path)
    with pytest.raises(ConfigError, match=f"{name}: missing"):
        open_pool(root)


def test_bad_manifest_and_no_pool_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        open_pool(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="manifest.json missing"):
        open_pool(tmp_path / "empty")
    root = tmp_path / "p"
    pool_from_trace(root, small_trace(), expert_bytes=SIZE)
    man = json.loads((root / "manifest.json").read_text())
    man["entries"][3][1] = 10**9  # an offset outside its file
    (root / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ConfigError, match=r"entries\[3\]"):
        open_pool(root)
    man["files"] = {"../../etc/passwd": 1}
    (root / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ConfigError, match="leaves the pool folder"):
        open_pool(root)
    # values of the wrong type or meaning (each was accepted: a helper's sweep)
    pool_from_trace(root, small_trace(), expert_bytes=SIZE)
    good = json.loads((root / "manifest.json").read_text())
    for change, match in [(lambda m: m.update(version=True), "'version' True is not"),
                          (lambda m: m.update(layers=[0, 0]), "distinct non-negative layer ids"),
                          (lambda m: m.update(layers=[-1, 0]), "distinct non-negative layer ids"),
                          (lambda m: m.update(checksum="md5"), "'checksum' 'md5' is not 'blake2b-128'"),
                          (lambda m: m.update(dtype={"a": 1}), "'dtype' must be a string"),
                          (lambda m: m["entries"][0].__setitem__(3, "zz"), r"entries\[0\]: checksum 'zz'"),
                          (lambda m: m.update(layout="packed" if m["layout"] == "files" else "files"),
                           "does not match its files")]:
        man = json.loads(json.dumps(good))
        change(man)
        (root / "manifest.json").write_text(json.dumps(man))
        with pytest.raises(ConfigError, match=match):
            open_pool(root)
    (root / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError
    with pytest.raises(ConfigError, match="nested too deeply"):
        open_pool(root)


def test_from_safetensors_holds_the_checkpoint_bytes(tmp_path):
    model = REPO / "models" / "small-moe"
    if not (model / "model.safetensors").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    r = cli("tier", "write", "--pool", tmp_path / "p", "--from-safetensors", model, "--layout", "packed", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    pool = open_pool(tmp_path / "p", verify=True)
    layers, E, index, dtype = expert_tensors(model)
    assert rec["num_experts"] == E == pool.num_experts and rec["layers"] == layers and dtype == "F16"
    # an independent reader: the safetensors package when installed, else the header offsets by hand
    names = [f"model.layers.2.mlp.experts.5.{n}.weight" for n in ("down_proj", "gate_proj", "up_proj")]
    try:
        from safetensors import safe_open
        with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
            want = b"".join(f.get_tensor(n).tobytes() for n in names)
    except ImportError:
        header, start = read_header(model / "model.safetensors")
        raw = (model / "model.safetensors").read_bytes()
        want = b"".join(raw[start + header[n]["data_offsets"][0]: start + header[n]["data_offsets"][1]] for n in names)
    ent = pool.entry(layers.index(2), 5)
    with open(ent.path, "rb") as fh:
        fh.seek(ent.offset)
        assert fh.read(ent.size) == want


def test_safetensors_header_bounds(tmp_path):
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match="header length"):
        expert_tensors(bad)
    (bad / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match="no expert tensors"):
        expert_tensors(bad)


def test_write_cli_errors_are_one_line(tmp_path):
    tr = tmp_path / "t.npz"
    small_trace().save(tr)
    r = cli("tier", "write", "--pool", tmp_path / "p", "--from-trace", tr)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--expert-mb" in r.stderr
    r = cli("tier", "write", "--pool", tmp_path / "p", "--from-safetensors", tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no *.safetensors" in r.stderr
    r = cli("tier", "write", "--pool", tmp_path / "p", "--from-trace", tr, "--expert-mb", "0.05", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["expert_bytes"] == 50_000


def test_a_trace_of_other_layer_ids_than_the_pool_is_refused(tmp_path):
    """Layers were matched by position: a trace of layers [0, 3] replayed against a pool of layers
    [0, 1] read layer 3's experts from layer 1's files (a --from-safetensors pool's real bytes)."""
    import numpy as np

    import expertcache as ec
    from expertcache.errors import ConfigError
    from expertcache.tier.pool import open_pool, pool_from_trace
    from expertcache.tier.worker import check_trace_fits

    ex = np.zeros((4, 2, 1), dtype=int)
    written = ec.Trace.from_arrays(ex, num_experts=4, meta={"layer_ids": [0, 1]})
    other = ec.Trace.from_arrays(ex, num_experts=4, meta={"layer_ids": [0, 3]})
    pool_from_trace(tmp_path / "pool", written, expert_bytes=4096)
    pool = open_pool(tmp_path / "pool")
    check_trace_fits(written, pool)
    with pytest.raises(ConfigError, match=r"has layer ids 0,3, pool .* holds layers 0-1"):
        check_trace_fits(other, pool)
