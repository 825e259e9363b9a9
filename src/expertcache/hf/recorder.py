"""``expertcache.capture(model)``: record a model's router decisions as a canonical :class:`~expertcache.Trace`.

For every position a forward computes and every MoE layer, the capture stores the top-k expert ids
and gate weights the layer's experts module receives (``mlp.experts(hidden_states, top_k_index,
top_k_weights)``, the same seam the offloaded path serves) and, with ``router_probs=True``, the
softmax of the router's logits over all E experts; with ``record=`` (e.g. ``"token-ids,next-top:8,hidden:16"``)
the model-side signals of :mod:`.signals` as extras, one row per position. It works with or without an offload run.
Recorded tensors stay on their device until :attr:`Capture.trace` is read, so a capture adds no
host synchronisation to the forwards it watches.

Which positions are kept (``phase``):

* ``"auto"`` (default): if any decode step was seen (a forward with a non-empty KV cache, as in
  ``generate``), only decode steps are kept and each sequence's prefill is left out (trace phase
  ``decode``); otherwise every position is kept (phase ``teacher-forced``);
* ``"decode"``: decode steps only, always;
* ``"all"``: every position (phase ``teacher-forced`` when no decode step was seen, else ``mixed``).

A forward with an empty KV cache starts a new sequence (``seq`` id).

Batches. A forward of b > 1 rows is recorded as the offloaded harness serves it: one position per
token step holding the *union* of the b rows' experts at that step, sorted, padded with -1 to the
trace's width (``min(b * k, E)`` for the largest batch seen); a batch is one sequence. Gate weights
are per row, so a trace with any batched forward has no ``probs``, and ``router_probs`` needs
batch 1. ``meta["batch"]`` holds the largest batch size seen.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch
import transformers

from ..errors import ConfigError
from ..trace import Trace
from .model import ExpertsSite, find_sites, forward_info, model_label, select_sites
from .signals import SignalHooks, SignalSpec, parse_record, stack_signals

PHASES = ("auto", "decode", "all")


@dataclass
class _Forward:
    """What one top-level forward recorded."""

    sequence: int
    decode: bool
    batch: int = 1
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    router: dict[int, torch.Tensor] = field(default_factory=dict)
    signals: dict[str, torch.Tensor] = field(default_factory=dict)


class Capture:
    """Hooks on a model's MoE layers that record router decisions; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        phase: str = "auto",
        router_probs: bool = False,
        layers: Iterable[int] | None = None,
        label: str | None = None,
        record: SignalSpec | str | None = None,
    ):
        if phase not in PHASES:
            raise ConfigError(f"phase: {phase!r} is not one of {', '.join(PHASES)}")
        self.model = model
        self.phase = phase
        self.label = label
        self.router_probs = bool(router_probs)
        self.sites: list[ExpertsSite] = select_sites(find_sites(model), layers, model_label(model))
        if self.router_probs:
            blind = [s.layer for s in self.sites if s.router is None]
            if blind:
                raise ConfigError(
                    f"router_probs: {model_label(model)} does not expose its router logits at layer {blind[0]}"
                )
        self.forwards: list[_Forward] = []
        self.record = record if isinstance(record, SignalSpec) else parse_record(record, "record")
        self._signals = SignalHooks(model, self.record, lambda: self.forwards[-1].signals if self.forwards else {}) if self.record.any else None
        self._hooks: list = []
        self._sequence = -1

    def __enter__(self) -> "Capture":
        self._hooks.append(self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        for site in self.sites:
            self._hooks.append(site.experts.register_forward_pre_hook(self._experts_hook(site.layer), with_kwargs=True))
            if self.router_probs:
                self._hooks.append(site.router.register_forward_hook(self._router_hook(site)))
        if self._signals is not None:
            self._hooks += self._signals.register()
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- hooks --------------------------------------------------------------------------------
    def _on_forward(self, module, args, kwargs):
        info = forward_info(args, kwargs)
        if info.batch != 1 and self.router_probs:
            raise ConfigError(f"capture: router_probs records batch-1 forwards; got a batch of {info.batch}")
        if info.batch != 1 and self._signals is not None:
            raise ConfigError(f"capture: record (model-side signals) needs batch-1 forwards; got a batch of {info.batch}")
        if info.starts_sequence or self._sequence < 0:
            self._sequence += 1
        self.forwards.append(_Forward(self._sequence, decode=not info.starts_sequence, batch=max(info.batch, 1)))
        if self._signals is not None:
            self._signals.on_forward(args, kwargs)

    def _current(self, layer: int, what: dict) -> _Forward:
        if not self.forwards or layer in getattr(self.forwards[-1], what):
            # a submodule called directly, outside a top-level forward: a sequence of its own
            self._sequence += 1
            self.forwards.append(_Forward(self._sequence, decode=False))
        return self.forwards[-1]

    def _experts_hook(self, layer: int):
        def hook(module, args, kwargs):
            values = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            index, weights = values[1], values[2]
            rec = self._current(layer, "experts")
            rec.experts[layer] = index.detach().clone()
            rec.probs[layer] = weights.detach().clone()

        return hook

    def _router_hook(self, site: ExpertsSite):
        def hook(module, args, output):
            logits = output[site.router_output_index] if isinstance(output, (tuple, list)) else output
            probs = torch.softmax(logits.detach().float().reshape(-1, logits.shape[-1]), dim=-1)
            self._current(site.layer, "router").router[site.layer] = probs

        return hook

    # -- result -------------------------------------------------------------------------------
    @property
    def trace(self) -> Trace:
        """The recorded positions as a canonical trace (raises if nothing was kept)."""
        saw_decode = any(f.decode for f in self.forwards)
        keep_decode_only = self.phase == "decode" or (self.phase == "auto" and saw_decode)
        kept = [f for f in self.forwards if f.decode or not keep_decode_only]
        kept = [f for f in kept if f.experts]
        if not kept:
            hint = " (the capture keeps decode steps only; pass phase='all' for teacher-forced forwards)" if keep_decode_only else ""
            raise ConfigError(f"capture: no positions recorded{hint}")
        layer_ids = [s.layer for s in self.sites]
        for f in kept:
            missing = [lid for lid in layer_ids if lid not in f.experts]
            if missing:
                raise ConfigError(f"capture: a forward did not reach MoE layer {missing[0]}")
        batch = max(f.batch for f in kept)
        if batch == 1:
            experts = _stack(kept, "experts", layer_ids, torch.int64)
            probs = _stack(kept, "probs", layer_ids, torch.float32)
        else:
            experts, probs = _stack_unions(kept, layer_ids, self.sites[0].num_experts), None
        seq = np.concatenate([np.full(f.experts[layer_ids[0]].shape[0] // f.batch, f.sequence, dtype=np.int64) for f in kept])
        router = _stack(kept, "router", layer_ids, torch.float32) if self.router_probs else None
        extras = {}
        if self._signals is not None:
            extras = stack_signals(kept, self.record, [f.experts[layer_ids[0]].shape[0] for f in kept])
        if self.label:
            phase = self.label
        elif keep_decode_only:
            phase = "decode"
        else:
            phase = "mixed" if saw_decode else "teacher-forced"
        cfg = getattr(self.model, "config", None)
        meta = {
            "model": str(getattr(cfg, "name_or_path", "") or type(self.model).__name__),
            "model_type": getattr(cfg, "model_type", None),
            "num_experts": self.sites[0].num_experts,
            "layer_ids": layer_ids,
            "phase": phase,
            "provenance": {
                "tool": "expertcache.capture",
                "model_class": type(self.model).__name__,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "prefill": "excluded" if keep_decode_only else "included",
            },
        }
        if router is not None:
            meta["router_probs"] = "softmax of the router logits"
        if extras:
            meta["signals"] = self.record.describe()
        if batch > 1:
            meta["batch"] = batch
            meta["provenance"]["batch_rows"] = "union of the rows' experts per step, sorted, -1 padded"
        return Trace.from_arrays(
            experts, seq, probs=probs, router_probs=router, meta=meta, extras=extras,
            source=f"<capture of {model_label(self.model)}>",
        )


def _stack(forwards: list[_Forward], what: str, layer_ids: list[int], dtype: torch.dtype) -> np.ndarray:
    """``[T, L, ...]`` host array of one recorded quantity (the only device-to-host copy a capture makes)."""
    rows = [torch.stack([getattr(f, what)[l].to("cpu", dtype) for l in layer_ids], dim=1) for f in forwards]
    return torch.cat(rows).numpy()


def _stack_unions(forwards: list[_Forward], layer_ids: list[int], num_experts: int) -> np.ndarray:
    """``[T, L, W]`` unions of the batch rows' experts per step (sorted, -1 padded), W the widest union."""
    k = forwards[0].experts[layer_ids[0]].shape[1]
    width = min(max(f.batch for f in forwards) * k, num_experts)
    blocks = []
    for f in forwards:
        rows = f.experts[layer_ids[0]].shape[0]
        n = rows // f.batch
        block = np.full((n, len(layer_ids), width), -1, dtype=np.int64)
        for j, lid in enumerate(layer_ids):
            ids = f.experts[lid].to("cpu", torch.int64).numpy().reshape(f.batch, n, k).transpose(1, 0, 2).reshape(n, -1)
            for t in range(n):
                union = np.unique(ids[t])
                union = union[union >= 0]
                block[t, j, : union.size] = union
        blocks.append(block)
    return np.concatenate(blocks)


def capture(
    model: torch.nn.Module,
    *,
    phase: str = "auto",
    router_probs: bool = False,
    layers: Iterable[int] | None = None,
    record: SignalSpec | str | None = None,
) -> Capture:
    """Record router decisions while the ``with`` block runs; ``cap.trace`` is the result."""
    return Capture(model, phase=phase, router_probs=router_probs, layers=layers, record=record)
