"""The importer registry: every built-in format is complete, and a format registered by one call is
detected (ahead of the loose vllm-jsonl shape), dispatched with its default phase, listed in the
errors of ``auto``, and gone again once the registration is undone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertcache.errors import ConfigError, TraceError
from expertcache.trace import Trace
from expertcache.trace.importers import (
    DEFAULT_PHASE,
    FORMATS,
    EngineFields,
    JsonlFields,
    TokenFields,
    detect_format,
    import_trace,
    registry,
    shapes,
)
from expertcache.trace.importers.records import iter_records
from expertcache.trace.validate import PHASES


def write(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_every_registered_format_is_complete():
    assert FORMATS == ("vllm-jsonl", "token-jsonl", "engine-jsonl", "sglang", "sglang-r3", "vllm-r3")
    assert tuple(f.name for f in registry.importers()) == FORMATS
    assert list(shapes()) == list(FORMATS)
    renamed = registry.Options(JsonlFields(seq="req", token="pos"), TokenFields(seq="req"), EngineFields(iteration="it"))
    for f in registry.importers():
        assert callable(f.read), f.name
        line = f.shape(renamed)
        assert isinstance(line, str) and line.strip() and "\n" not in line, f.name
        assert f.phase is None or f.phase in PHASES, f.name
        assert DEFAULT_PHASE.get(f.name) == f.phase, f.name
    # the shape lines show the field names in force
    assert shapes(JsonlFields(seq="req", token="pos"))["vllm-jsonl"].startswith("one JSON record per token and layer: req/")
    assert "no pos (speculative decoding)" in shapes(JsonlFields(token="pos"))["engine-jsonl"]
    assert DEFAULT_PHASE == {"vllm-jsonl": "decode", "token-jsonl": "decode", "engine-jsonl": "decode", "sglang": "mixed"}
    with pytest.raises(ValueError, match="'vllm-jsonl' is already registered"):
        registry.register(registry.Importer("vllm-jsonl", shape=lambda o: "", read=lambda p, n, o: None))


def _read_routes(path, fmt: str, o: registry.Options) -> Trace:
    """The dummy format: one record per token, ``route`` holding one id list per layer."""
    routes = [rec["route"] for _, rec in iter_records(path)]
    return Trace.from_arrays(routes, meta={"model": o.model or "unknown", "phase": o.phase, "fmt": fmt})


ROUTES = registry.Importer("route-jsonl", shape=lambda o: "one JSON record per token: route, one id list per layer",
                           read=_read_routes, phase="prefill", claims_record=lambda rec, o: "route" in rec)


def test_a_registered_format_is_detected_and_dispatched(tmp_path, monkeypatch):
    routes = write(tmp_path / "routes.jsonl", [{"route": [[1, 2], [3, 0]]}, {"route": [[2, 1], [0, 3]]}])
    # a route record that also fits vllm-jsonl (the loose shape): the registered probe goes first
    both = write(tmp_path / "both.jsonl", [{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2],
                                            "route": [[1, 2]]}])
    vllm = write(tmp_path / "vllm.jsonl", [{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}])
    odd = write(tmp_path / "odd.jsonl", [{"hello": 1}])

    def unregistered():
        assert registry.get("route-jsonl") is None
        with pytest.raises(TraceError, match="this record has no known shape") as info:
            detect_format(routes)
        assert "route-jsonl" not in str(info.value)
        assert detect_format(both) == "vllm-jsonl"
        with pytest.raises(ConfigError, match="is not one of auto, vllm-jsonl, token-jsonl, engine-jsonl, sglang, "
                                              "sglang-r3, vllm-r3$"):
            import_trace(routes, "route-jsonl")

    unregistered()
    with monkeypatch.context() as m:
        m.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # undone when the block ends
        registry.register(ROUTES)
        assert detect_format(routes) == "route-jsonl" and detect_format(both) == "route-jsonl"
        assert detect_format(vllm) == "vllm-jsonl"
        trace, fmt = import_trace(routes)
        assert fmt == "route-jsonl" and trace.experts.tolist() == [[[1, 2], [3, 0]], [[2, 1], [0, 3]]]
        assert trace.meta["phase"] == "prefill" and trace.meta["fmt"] == "route-jsonl"  # the format's default phase
        trace, fmt = import_trace(routes, "route-jsonl", phase="decode", model="m")
        assert fmt == "route-jsonl" and trace.meta["phase"] == "decode" and trace.meta["model"] == "m"
        with pytest.raises(TraceError) as info:
            detect_format(odd)
        assert str(info.value).endswith(", route-jsonl (one JSON record per token: route, one id list per layer)")
        assert shapes()["route-jsonl"] == ROUTES.shape(None)
        with pytest.raises(ConfigError, match="is not one of auto, .*, vllm-r3, route-jsonl$"):
            import_trace(routes, "csv")
    unregistered()
    assert "route-jsonl" not in FORMATS and "route-jsonl" not in shapes()
