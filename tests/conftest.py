"""Shared fixtures. Real traces live in ../shared/traces beside the checkout (CI has it; a user's
clone does not, so tests that need them skip cleanly)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = Path(os.environ.get("EXPERTCACHE_SHARED_TRACES", REPO.parent / "shared" / "traces"))


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
