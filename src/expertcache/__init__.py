"""expertcache: measure, bound and run expert caches for offloaded mixture-of-experts models."""

from .cache import ExpertCache, Step
from .errors import ConfigError, ExpertcacheError, PolicyError, TraceError
from .policies import Policy, StreamFuture, available_policies, make_policy, register
from .sim import ReplayResult, replay, replay_many
from .trace import Trace, load_trace

__version__ = "0.1.0"


def __getattr__(name: str):
    """``offload``, ``capture`` and ``load_offloaded`` need torch and transformers, so they load on first use."""
    if name in ("offload", "capture", "load_offloaded"):
        import importlib

        package = importlib.import_module(f"{__name__}.offload")  # callable: expertcache.offload(model, ...)
        return package if name == "offload" else getattr(package, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError", "ExpertCache", "ExpertcacheError", "Policy", "PolicyError", "ReplayResult", "Step",
    "StreamFuture", "Trace", "TraceError", "available_policies", "load_trace", "make_policy", "register",
    "replay", "replay_many",
]
