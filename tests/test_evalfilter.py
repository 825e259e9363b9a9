"""The eval callback's compiled filter (``expertcache.llama.evalfilter``) is compiled once per
installation, not once per process: numba's on-disk cache finds it again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache._jit import AVAILABLE

PKG = Path(__file__).resolve().parents[1] / "src" / "expertcache"


@pytest.mark.skipif(not AVAILABLE, reason="numba is off: the Python callback serves alone")
def test_the_compiled_filter_is_cached_once_across_processes(tmp_path):
    """As a closure it was keyed by its captured objects, which differ in every process: each
    ``llama run`` compiled it again (0.38 s) and added an entry to the cache (583 in one
    ``__pycache__``, 18 MB). Built in three processes, it leaves one compiled entry, and each
    process gets a working address."""
    # a copy of the package: its compiled caches live beside its files (the package's own locator)
    shutil.copytree(PKG, tmp_path / "expertcache", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = ("import expertcache.llama.evalfilter as f; assert f.__file__.startswith(%r), f.__file__; "
            "print(int(f.compiled() or 0))" % str(tmp_path))
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.strip()) > 0
    entries = [p.name for p in (tmp_path / "expertcache" / "llama").rglob("*.nbc") if "evalfilter" in p.name]
    assert len(entries) == 1, entries
