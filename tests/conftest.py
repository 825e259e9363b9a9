"""Shared fixtures. Real traces live in ../shared/traces beside the checkout (CI has it; a user's
clone does not, so tests that need them skip cleanly)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: torch (and anything on OpenMP) takes one thread each, not one per core
    # (oversubscribed, the README's chapters took 5 min of CPU instead of 3), in this process and the
    # commands the tests start
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = Path(os.environ.get("EXPERTCACHE_SHARED_TRACES", REPO.parent / "shared" / "traces"))


SMALL_MOE = REPO / "models" / "small-moe"
"""The smallest MoE checkpoint in the repository (a trained 8 MB model with its tokenizer)."""


def small_moe_gguf(tmp_path_factory, name: str, dtype: str = "f16") -> Path:
    """:data:`SMALL_MOE` converted to a GGUF of ``dtype`` in a new temporary folder ``name``; the
    test skips where the checkout lacks the model."""
    from expertcache.llama.convert import convert

    if not (SMALL_MOE / "config.json").is_file():
        pytest.skip("models/small-moe is not in this checkout")
    out = tmp_path_factory.mktemp(name) / "small-moe.gguf"
    convert(SMALL_MOE, out, dtype)
    return out


FIRST = ("test_readme.py",)
"""Files collected first: ``make test`` runs two workers (``pytest -n 2 --dist loadgroup
--no-loadscope-reorder``: xdist would otherwise sort the groups by their number of tests) that take
groups in collection order, so the longest file (the README's examples, about a third of the suite)
starts at once instead of finishing last."""
SPLIT = ("test_readme.py",)
"""Files whose tests are scheduled one by one (the README's chapters run in parallel); every other
file's tests stay together on one worker, its module fixtures shared (``xdist_group`` = the file)."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order
    for item in items:
        group = item.nodeid if item.path.name in SPLIT else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))


@contextlib.contextmanager
def ray_lock():
    """One Ray at a time across test workers: ``--ray auto`` joins whichever local Ray this machine
    runs, so a README example must not join test_ray.py's cluster while that module shuts it down."""
    with open(Path(tempfile.gettempdir()) / "expertcache-tests-ray.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def shared_trace_paths() -> list[Path]:
    return sorted(SHARED_TRACES.glob("*/routing.npz")) if SHARED_TRACES.is_dir() else []


@pytest.fixture(params=shared_trace_paths() or [None], ids=lambda p: p.parent.name if p else "no-shared-traces")
def shared_trace_path(request) -> Path:
    """Each real trace in ../shared/traces (skips when the folder is absent)."""
    if request.param is None:
        pytest.skip("../shared/traces is not beside this checkout")
    return request.param


@pytest.fixture
def seed_case():
    """The seeds' three-token case: C=3, requests {a,b}, {c,d}, {a,b} (DESIGN section 2)."""
    from expertcache import Trace

    return Trace.from_arrays(np.array([[0, 1], [2, 3], [0, 1]]), num_experts=4)


GRID_SPEC = """
traces = ["t*.npz"]
synth = [{preset = "olmoe", seed = 1, tokens = 30, sequences = 2, num_layers = 4}]
policies = ["lru", "belady", "decayed:0.9"]
capacities = [8, 12]
pools = ["layer", "global"]
warm = [0.0, 0.5]
"""
"""The grid spec of tests/test_grid.py and tests/test_ray.py: two small files and a synth preset."""
GRID_CELLS = 3 * 3 * 2 * 2 * 2


@pytest.fixture
def grid(tmp_path):
    """A folder with two small traces (ta.npz, tb.npz) and grid.toml holding :data:`GRID_SPEC`."""
    import expertcache as ec

    rng = np.random.default_rng(0)
    for name in ("ta", "tb"):
        ex = np.stack([[rng.choice(16, 4, replace=False) for _ in range(3)] for _ in range(80)])
        ec.Trace.from_arrays(ex, np.repeat([0, 1], 40), num_experts=16, meta={"name": name}).save(tmp_path / f"{name}.npz")
    (tmp_path / "grid.toml").write_text(GRID_SPEC)
    return tmp_path


def strip_seconds(rows):
    """Rows (dicts) without the timing field ``seconds``, the only one that differs between runs."""
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def assert_bad_fields(path, cases, load, tmp_path):
    """Each ``(field, value, match)``: ``path``'s npz with that field dropped (value None) or replaced
    makes ``load`` raise one ConfigError matching ``match``."""
    from expertcache.errors import ConfigError

    with np.load(path) as z:
        arrays = dict(z)
    for name, value, match in cases:
        bad = {k: v for k, v in arrays.items() if k != name}
        if value is not None:
            bad[name] = value(arrays[name]) if callable(value) else value
        np.savez(tmp_path / "bad.npz", **bad)
        with pytest.raises(ConfigError, match=match):
            load(tmp_path / "bad.npz")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one CPU thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    toy-sized matmuls run fastest and steadiest on a shared machine that way (hf.toy.single_thread)."""
    from expertcache.hf.toy import single_thread

    with single_thread():
        yield
