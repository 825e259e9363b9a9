"""The ``"expertcache"`` experts implementation, registered in transformers' experts seam by name.

transformers v5 dispatches every ``@use_experts_implementation`` experts module through
``ExpertsInterface`` by ``config._experts_implementation``. Importing this module registers
:func:`experts_forward` there as ``"expertcache"``, so a model opts in by name
(``model.set_experts_implementation("expertcache")``, done by :func:`expertcache.offload`) and
no model class is patched. An experts module with an :class:`~.layer.OffloadedLayer` attached is served
from its slot pool; any other experts module runs the implementation it had before
(``grouped_mm`` when none is recorded), so layers that are not offloaded are untouched.

The offloaded forward does not reimplement the experts: it calls the model's own experts
function (the implementation the model was using: ``grouped_mm``, ``batched_mm``, ``eager``, ...)
on a :class:`SlotView` of the module, whose ``gate_up_proj`` / ``down_proj`` are the C slot
tensors and whose router indices are slot ids. The matmuls are the same; only where the weights
are read from changes.

What an offloaded layer does per call (cache steps, batches, segments, prefetch) is in
:mod:`.layer`.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

IMPLEMENTATION = "expertcache"
#: What an experts module without a recorded implementation runs (transformers' own default).
DEFAULT_IMPLEMENTATION = "grouped_mm"

_LAYER_ATTR = "_expertcache_layer"
_FALLBACK_ATTR = "_expertcache_fallback"


def experts_forward(self: torch.nn.Module, hidden_states, top_k_index, top_k_weights):
    """The ``"expertcache"`` experts implementation: slot pool when offloaded, else the previous one."""
    layer = self.__dict__.get(_LAYER_ATTR)
    if layer is not None:
        return layer(hidden_states, top_k_index, top_k_weights)
    return implementation_of(self, self.__dict__.get(_FALLBACK_ATTR))(self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def implementation_of(module: torch.nn.Module, name: str | None) -> Callable:
    """The experts function called ``name`` for ``module`` (``eager`` is the class's own forward)."""
    if name is None or name == IMPLEMENTATION:
        name = DEFAULT_IMPLEMENTATION
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, type(module).forward.__wrapped__)


def set_fallback(module: torch.nn.Module, name: str | None) -> None:
    """Record the implementation ``module`` runs while it is not offloaded (``None`` clears it)."""
    if name is None:
        module.__dict__.pop(_FALLBACK_ATTR, None)
    else:
        module.__dict__[_FALLBACK_ATTR] = name


class SlotView:
    """An experts module seen through its slot pool.

    Every attribute is the module's own except ``gate_up_proj`` / ``down_proj`` (the ``[C, ...]``
    slot tensors) and ``num_experts`` (C), so the model's experts function, given slot ids instead
    of expert ids, computes the same thing from the slots.
    """

    def __init__(self, module: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor):
        self._module = module
        self.gate_up_proj = gate_up
        self.down_proj = down
        self.num_experts = int(gate_up.shape[0])

    def __getattr__(self, name):
        return getattr(self._module, name)


def attach_layer(module: torch.nn.Module, layer) -> None:
    """Serve ``module`` from ``layer`` (an :class:`~.layer.OffloadedLayer`) while it is attached."""
    module.__dict__[_LAYER_ATTR] = layer


def detach_layer(module: torch.nn.Module) -> None:
    module.__dict__.pop(_LAYER_ATTR, None)
