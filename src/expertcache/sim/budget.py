"""Byte budgets: capacities in the units a host tier is planned in (docs/design.md section 2, "Budgets in bytes").

A budget of ``B`` bytes with experts of ``S`` bytes holds ``n = floor(B / S)`` experts
(``budget_experts``). A global pool is one pool of ``n`` ``(layer, expert)`` items; per-layer pools
split it equally, ``floor(n / L)`` experts per layer over ``L`` layers (the remainder,
``n mod L`` experts, stays unused and is reported as ``budget_unused_experts``).

A budget above the whole pool (``pool_items``: ``E`` per layer, ``L * E`` for a global pool, when
known) holds every expert: the capacity is clamped there (:meth:`Budget.capacity`), the rest is
unused too, and :meth:`Budget.describe` says so in one line.
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
    pool_items: int | None = None
    """Items one pool can hold at most (``E`` per layer, ``L * E`` global); ``None``: no clamp."""

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
        return cap if self.pool_items is None else min(cap, self.pool_items)

    def holds_everything(self, pool: str, num_layers: int) -> bool:
        """True when the budget's share reaches the whole pool: every expert fits."""
        n = self.experts if pool == "global" else self.experts // max(num_layers, 1)
        return self.pool_items is not None and n >= self.pool_items

    def record(self, pool: str, num_layers: int) -> dict:
        """JSON fields: the budget in bytes and experts, and the experts a split leaves unused."""
        cap = self.capacity(pool, num_layers)
        used = cap if pool == "global" else cap * num_layers
        return {"budget_bytes": self.budget_bytes, "expert_bytes": self.expert_bytes,
                "budget_experts": self.experts, "budget_unused_experts": self.experts - used}

    def describe(self, pool: str, num_layers: int) -> str:
        cap = self.capacity(pool, num_layers)
        if self.holds_everything(pool, num_layers):
            used = cap * (1 if pool == "global" else num_layers) * self.expert_bytes
            where = f"{cap} per layer x {num_layers} layers" if pool != "global" else f"{cap} items"
            return (f"budget {format_bytes(self.budget_bytes)} is above the whole pool ({where} x "
                    f"{format_bytes(self.expert_bytes)} = {format_bytes(used)}): every expert fits; capacity clamped "
                    f"to {cap}{' per layer' if pool != 'global' else ''}, zero steady copies, "
                    f"{format_bytes(self.budget_bytes - used)} unused")
        where = "in one global pool" if pool == "global" else f"= {cap} per layer x {num_layers} layers"
        return (f"budget {format_bytes(self.budget_bytes)} / {format_bytes(self.expert_bytes)} per expert "
                f"= {self.experts} experts {where}")
