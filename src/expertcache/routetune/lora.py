"""Which weights the fine-tune trains: the router of one layer, or LoRA factors on that layer's
router / expert / attention projections, merged into the weights before saving.

Invariants:

* every parameter of the model is frozen except the ones :func:`trainable` returns;
* a LoRA factor pair starts at ``B = 0``, so the model computes exactly what it computed before
  training until the first update;
* :func:`merge` replaces each LoRA-parametrized weight by ``W + (alpha / r) * B @ A`` (per expert
  for the packed ``[E, out, in]`` expert tensors) and removes the factors: the saved checkpoint
  has the stock layout and loads with plain transformers.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from ..errors import ConfigError
from ..hf.model import ExpertsSite


class LoRADelta(torch.nn.Module):
    """Parametrization ``W -> W + scale * B @ A`` of a 2-d ``[out, in]`` or packed 3-d ``[E, out, in]`` weight."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        *lead, out_dim, in_dim = weight.shape
        a = torch.randn(*lead, rank, in_dim, generator=generator, dtype=torch.float32) / in_dim ** 0.5
        self.A = torch.nn.Parameter(a.to(weight.dtype))
        self.B = torch.nn.Parameter(torch.zeros(*lead, out_dim, rank, dtype=weight.dtype))
        self.scale = alpha / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.B @ self.A)


def block_prefix(site: ExpertsSite) -> str:
    """The decoder layer's module path (``model.layers.2`` for ``model.layers.2.mlp.experts``)."""
    parts = site.name.split(".")
    idx = max(i for i, p in enumerate(parts) if p == str(site.layer))
    return ".".join(parts[: idx + 1])


def _targets(model: torch.nn.Module, site: ExpertsSite, targets) -> list[tuple[torch.nn.Module, str]]:
    out: list[tuple[torch.nn.Module, str]] = []
    if "router" in targets:
        if site.router is None or not isinstance(getattr(site.router, "weight", None), torch.Tensor):
            raise ConfigError(f"layer {site.layer}: no router weight found (the model declares no router module)")
        out.append((site.router, "weight"))
    if "experts" in targets:
        out += [(site.experts, "gate_up_proj"), (site.experts, "down_proj")]
    if "attention" in targets:
        prefix = block_prefix(site) + "."
        attn = [(m, "weight") for name, m in model.named_modules()
                if name.startswith(prefix) and "attn" in name and isinstance(m, torch.nn.Linear)]
        if not attn:
            raise ConfigError(f"layer {site.layer}: no attention projections (nn.Linear under {prefix}*attn*)")
        out += attn
    return out


def trainable(model: torch.nn.Module, site: ExpertsSite, rank: int, alpha: float, targets,
              generator: torch.Generator) -> list[torch.nn.Parameter]:
    """Freeze the model and return the parameters to train (see the module docstring)."""
    for p in model.parameters():
        p.requires_grad_(False)
    if rank == 0:
        if site.router is None:
            raise ConfigError(f"layer {site.layer}: no router module found to train")
        params = list(site.router.parameters())
    else:
        params = []
        chosen = _targets(model, site, targets)
        full = min(min(getattr(module, name).shape[-2:]) for module, name in chosen)
        if rank > full:  # rank 100,000 on a 16 x 64 router: factors larger than the weights, no more expressive
            raise ConfigError(f"--lora-rank {rank} is above {full}, the full rank of the smallest target weight "
                              f"({', '.join(targets)} of layer {site.layer}); give R <= {full}")
        for module, name in chosen:
            delta = LoRADelta(getattr(module, name), rank, alpha, generator)
            parametrize.register_parametrization(module, name, delta)
            params += [delta.A, delta.B]
    for p in params:
        p.requires_grad_(True)
    return params


def merge(model: torch.nn.Module) -> int:
    """Fold every LoRA parametrization into its weight; returns how many weights were merged."""
    merged = 0
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
                merged += 1
    for p in model.parameters():
        p.requires_grad_(False)
    return merged
