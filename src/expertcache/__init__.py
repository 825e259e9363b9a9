"""expertcache: measure, bound and run expert caches for offloaded mixture-of-experts models."""

from .cache import ExpertCache, Step
from .errors import ConfigError, ExpertcacheError, PolicyError, TraceError
from .policies import Policy, StreamFuture, available_policies, make_policy, register
from .sim import ReplayResult, replay, replay_many
from .trace import Trace, load_trace

__version__ = "0.1.0"


def capture(model, **options):
    """Record a model's router decisions while the ``with`` block runs; ``cap.trace`` is the result.
    ``model``: a torch MoE model (:func:`expertcache.hf.capture`, needs torch) or a llama.cpp
    :class:`expertcache.llama.engine.Engine` (:class:`expertcache.llama.capture.LlamaCapture`;
    options ``phase`` and ``label``)."""
    if type(model).__module__ == "expertcache.llama.engine":
        from .llama.capture import LlamaCapture

        return LlamaCapture(model, **options)
    import importlib

    return importlib.import_module(f"{__name__}.hf").capture(model, **options)


def __getattr__(name: str):
    """``offload`` and ``load_offloaded`` (functions of :mod:`expertcache.hf`) need torch and
    transformers, so they load on first use."""
    if name in ("offload", "load_offloaded"):
        import importlib

        return getattr(importlib.import_module(f"{__name__}.hf"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError", "ExpertCache", "ExpertcacheError", "Policy", "PolicyError", "ReplayResult", "Step",
    "StreamFuture", "Trace", "TraceError", "available_policies", "load_trace", "make_policy", "register",
    "replay", "replay_many",
]
