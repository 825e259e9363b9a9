"""Byte budgets: capacities in the units a host tier is planned in (DESIGN section 2, "Budgets in bytes").

A budget of ``B`` bytes with experts of ``S`` bytes holds ``n = floor(B / S)`` experts
(``budget_experts``). A global pool is one pool of ``n`` ``(layer, expert)`` items; per-layer pools
split it equally, ``floor(n / L)`` experts per layer over ``L`` layers (the remainder,
``n mod L`` experts, stays unused and is reported as ``budget_unused_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._units import format_bytes
from ..errors import ConfigError


@dataclass(frozen=True)
class Budget:
    """``budget_bytes`` of memory for experts of ``expert_bytes`` each."""

    budget_bytes: int
    expert_bytes: int

    def __post_init__(self):
        if self.budget_bytes < 1 or self.expert_bytes < 1:
            raise ConfigError(f"budget: need positive sizes, got {self.budget_bytes} bytes for experts of "
                              f"{self.expert_bytes} bytes")

    @property
    def experts(self) -> int:
        """``floor(B / S)``: experts the budget holds over all layers."""
        return self.budget_bytes // self.expert_bytes

    def capacity(self, pool: str, num_layers: int) -> int:
        """Experts per pool: all of them for a global pool, an equal share per layer otherwise
        (a ConfigError when that is zero)."""
        n = self.experts
        cap = n if pool == "global" else n // max(num_layers, 1)
        if cap < 1:
            per = "" if pool == "global" else f", {cap} per layer over {num_layers} layers"
            raise ConfigError(f"--budget {format_bytes(self.budget_bytes)} holds {n} experts of "
                              f"{format_bytes(self.expert_bytes)}{per}: raise the budget")
        return cap

    def record(self, pool: str, num_layers: int) -> dict:
        """JSON fields: the budget in bytes and experts, and the experts a split leaves unused."""
        cap = self.capacity(pool, num_layers)
        used = cap if pool == "global" else cap * num_layers
        return {"budget_bytes": self.budget_bytes, "expert_bytes": self.expert_bytes,
                "budget_experts": self.experts, "budget_unused_experts": self.experts - used}

    def describe(self, pool: str, num_layers: int) -> str:
        cap = self.capacity(pool, num_layers)
        where = "in one global pool" if pool == "global" else f"= {cap} per layer x {num_layers} layers"
        return (f"budget {format_bytes(self.budget_bytes)} / {format_bytes(self.expert_bytes)} per expert "
                f"= {self.experts} experts {where}")
