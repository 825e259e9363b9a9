"""Policies by name: ``make_policy("decayed:0.9")``. New rules opt in with ``@register``."""

from __future__ import annotations

from ..errors import PolicyError
from .base import Policy

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    """Registered policy names."""
    return sorted(_REGISTRY)


def make_policy(spec: "str | Policy") -> Policy:
    """A fresh policy from a spec such as ``"lru"``, ``"decayed:0.9"`` or ``"foresight:16"``.

    A :class:`Policy` instance is returned as is.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"policy: expected a name such as 'lru' or 'decayed:0.9', got {spec!r}")
    from .kinds import SET_HOLDING, kind_of, wrong_kind

    name, _, arg = spec.strip().partition(":")
    cls = _REGISTRY.get(name.lower())
    if kind_of(spec) == "set-holding":
        raise wrong_kind(spec, "set-holding", "policy", ("eviction", "admission"))
    if cls is None:
        raise PolicyError(f"unknown policy {name!r} (known: {', '.join(available_policies())}; set-holding, "
                          f"in eval and the offloaded runtime: {', '.join(SET_HOLDING)})")
    return cls.from_arg(arg if _ else None)

