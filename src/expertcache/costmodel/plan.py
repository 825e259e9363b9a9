"""The sizing question in one place: does every expert fit, and if not, what capacity meets a target?

Inputs: the model (E, k, MoE layers ``L``, expert bytes ``S``, non-expert bytes ``N`` when known:
:class:`~expertcache.costmodel.model.ModelSpec`), the device memory ``D`` and memory kept back
for activations and the KV cache ``R``, copy time ``tau`` and compute ``c`` (optional), and a target.

* ``available = D - N - R``: the bytes left for experts (``N`` = 0 when the model's weights are unknown);
* ``all_experts_bytes = E x L x S``; ``fits_entirely`` when it is ``<= available``: keep every
  expert resident, zero copies, nothing else to decide;
* otherwise ``memory_capacity = floor(available / (L x S))``, the most experts per layer the device holds
  (``L x S`` the exact sum of one expert per layer where layers differ: a GGUF's types);
* a target is ``hit_rate >= X``, ``copies_per_token <= Y``, or ``tokens_per_s >= N``, which with
  blocking copies (``ms = c + rho x tau``) is ``rho <= (1000 / N - c) / tau`` (:func:`copies_for_rate`);
* per lossless rule, the answer is the smallest capacity per layer meeting the target (or, without
  a target, the rule at ``memory_capacity``); the **recommended** rule is the causal one (not
  needing the future) with the smallest such capacity, ties to fewer copies/token, then the name.

The search (:func:`search`) evaluates LRU at every capacity in one stack pass and the other rules
on a coarse grid refined between the last miss and the first hit, so it returns the exact smallest
capacity wherever a rule's curve is monotone in between grid points, and reports it as found.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .sizing import Sizing

GRID = 12
"""Coarse capacities per rule before refining (LRU needs none: one stack pass gives all)."""
KEYS = ("fits_entirely", "expert_bytes", "all_experts_bytes", "policy", "capacity_per_layer", "hit_rate",
        "copies_per_token", "misses_per_token", "ms_per_token", "ms_per_token_overlapped", "tokens_per_s", "cache_bytes",
        "recommended", "fits", "copy_bytes_per_s", "available_bytes", "memory_capacity_per_layer", "host_tier")
"""The fields of every ``size --json`` record, in order (docs/sizing.md)."""


def copies_for_rate(tokens_per_s: float, tau_ms: float | None, c_ms: float | None) -> float:
    """The most copies per token that still decode at ``tokens_per_s`` with blocking copies:
    ``(1000 / N - c) / tau``; a ConfigError when tau or c is unknown or c alone is too slow."""
    if tau_ms is None or c_ms is None:
        raise ConfigError("--target-tokens-per-s needs --tau and --c (ms/token = c + copies/token x tau)")
    budget = 1000.0 / tokens_per_s - c_ms
    if budget < 0:
        raise ConfigError(f"--target-tokens-per-s {tokens_per_s:g}: out of reach even with every expert resident "
                          f"(c = {c_ms:.4g} ms/token is {1000 / c_ms:.4g} tok/s)")
    return budget / tau_ms


@dataclass(frozen=True)
class Fit:
    """Whether every expert fits (see the module docstring)."""

    expert_bytes: int
    num_experts: int
    moe_layers: int
    device_bytes: int
    other_bytes: int
    reserve_bytes: int
    layer_set_bytes: int | None = None
    """Bytes of one expert of every MoE layer (``ModelSpec.layer_set_bytes``: exact where layers'
    expert sizes differ); ``None``: ``moe_layers x expert_bytes``."""

    @property
    def set_bytes(self) -> int:
        return self.layer_set_bytes if self.layer_set_bytes is not None else self.moe_layers * self.expert_bytes

    @property
    def all_experts_bytes(self) -> int:
        return self.num_experts * self.set_bytes

    def cache_bytes(self, capacity: int) -> int:
        """Memory of ``capacity`` experts in every MoE layer's pool."""
        return capacity * self.set_bytes

    @property
    def available(self) -> int:
        return self.device_bytes - self.other_bytes - self.reserve_bytes

    @property
    def fits_entirely(self) -> bool:
        return self.all_experts_bytes <= self.available

    @property
    def memory_capacity(self) -> int:
        """Experts per layer the available memory holds, at most E."""
        return max(0, min(self.num_experts, self.available // self.set_bytes))


@dataclass(frozen=True)
class Answer:
    """One rule's answer: ``capacity`` None when no capacity up to E meets the target."""

    policy: str
    needs_future: bool
    capacity: int | None
    hit_rate: float | None
    copies_per_token: float | None
    misses_per_token: float | None = None
    """Every miss per token, the cold fills of empty pools included (``copies_per_token`` counts
    only the steady copies that evict)."""


def meets(hit: float, copies: float, target_hit_rate: float | None, target_copies: float | None) -> bool:
    from ..sim.curves.targets import TOLERANCE

    ok = True
    if target_hit_rate is not None:
        ok &= bool(hit >= target_hit_rate - TOLERANCE)
    if target_copies is not None:
        ok &= bool(copies <= target_copies + TOLERANCE)
    return ok


def search(layout, policies, *, target_hit_rate: float | None, target_copies: float | None,
           at_capacity: int | None = None) -> list[Answer]:
    """Each rule's :class:`Answer`: at ``at_capacity`` when no target is given, else the smallest
    capacity in ``[widest group, n_items]`` meeting the targets (see the module docstring)."""
    from ..policies import make_policy
    from ..sim.curves import capacity_bounds, sweep_layout

    lo, hi = capacity_bounds(layout)
    targeted = target_hit_rate is not None or target_copies is not None
    out = []
    for spec in policies:
        policy = make_policy(spec)
        if not targeted:
            found = int(at_capacity)
            curve = sweep_layout(layout, [found], [spec])[0]
        else:
            caps = list(range(lo, hi + 1)) if policy.stack_curve else sorted(
                {int(round(x)) for x in np.linspace(lo, hi, GRID)})
            curve = sweep_layout(layout, caps, [spec])[0]
            found = _first(curve, target_hit_rate, target_copies)
            if found is not None and not policy.stack_curve:  # refine between the last miss and the first hit
                i = caps.index(found)
                if i > 0 and caps[i - 1] + 1 < found:
                    finer = sweep_layout(layout, list(range(caps[i - 1] + 1, found)), [spec])[0]
                    better = _first(finer, target_hit_rate, target_copies)
                    if better is not None:
                        found, curve = better, finer
        r = curve.at(found) if found is not None else None
        out.append(Answer(policy.spec, bool(policy.needs_future), found, r.hit_rate if r else None,
                          r.copies_per_token if r else None, r.copies_total / r.tokens if r and r.tokens else None))
    return out


def _first(curve, target_hit_rate, target_copies) -> int | None:
    if target_hit_rate is None and target_copies is None:
        return None
    for cap, hit, copies in zip(curve.capacities, curve.hit_rate, curve.copies_per_token):
        if meets(float(hit), float(copies), target_hit_rate, target_copies):
            return int(cap)
    return None


def recommended(answers: list[Answer]) -> Answer | None:
    """The causal rule with the smallest capacity meeting the target, then fewest copies, then name."""
    ok = [a for a in answers if not a.needs_future and a.capacity is not None]
    return min(ok, key=lambda a: (a.capacity, a.copies_per_token, a.policy)) if ok else None


def record(fit: Fit, sizing: Sizing, answer: Answer | None, best: Answer | None) -> dict:
    """One ``size --json`` record with exactly :data:`KEYS`."""
    S = fit.expert_bytes
    room = (fit.available, fit.memory_capacity)
    if answer is None:  # fits entirely: every expert resident, zero copies
        ms = sizing.c_ms
        return dict(zip(KEYS, (True, S, fit.all_experts_bytes, None, fit.num_experts, None, 0.0, None, ms, ms,
                               1000.0 / ms if ms else None, fit.all_experts_bytes, None, True, 0.0, *room, None)))
    figures = Sizing(S, sizing.tau_ms, sizing.c_ms).figures(
        answer.copies_per_token if answer.copies_per_token is not None else math.nan,
        capacity=answer.capacity, num_layers=fit.moe_layers) if answer.capacity is not None else None
    get = (lambda k: getattr(figures, k)) if figures is not None else (lambda k: None)
    rate, copies = get("tokens_per_s_predicted"), answer.copies_per_token
    return dict(zip(KEYS, (False, S, fit.all_experts_bytes, answer.policy, answer.capacity, answer.hit_rate,
                           copies, answer.misses_per_token, get("ms_per_token"),
                           get("ms_per_token_overlapped"), rate,
                           None if answer.capacity is None else fit.cache_bytes(answer.capacity),
                           best is not None and answer.policy == best.policy,
                           None if answer.capacity is None else answer.capacity <= fit.memory_capacity,
                           None if rate is None or copies is None else copies * S * rate, *room, None)))


def synthetic_trace(model, seed: int = 0, *, tokens: int | None = None):
    """``(trace, label)``: a synthetic trace with the model's E, k and MoE layers, when the user
    gave none. A preset of exactly those dimensions is used as it is; otherwise the preset nearest
    in E (log scale) lends its locality with E, k and the layer count replaced. ``tokens``: instead,
    one stream of that many tokens with the (matched or nearest) preset's locality (a decode long
    enough for a steady state). The label says SYNTHETIC and which: it is the locality of a
    published model, not of the user's workload."""
    from ..trace.synth import PRESETS, synthesize_preset

    dims = (model.num_experts, model.top_k, model.moe_layers)
    stream = f", one stream of {tokens} tokens" if tokens is not None else ""
    for name, preset in PRESETS.items():
        p = preset.params
        if (p.num_experts, p.top_k, p.num_layers) == dims and preset.targets:
            trace = (synthesize_preset(name, seed) if tokens is None
                     else synthesize_preset(name, seed, sequences=1, tokens=int(tokens)))
            return trace, (f"SYNTHETIC trace (no --trace given): preset {name}, which matches E={dims[0]}, k={dims[1]}, "
                           f"{dims[2]} layers{stream}; give --trace for your own workload")
    candidates = [(name, pr) for name, pr in PRESETS.items() if pr.targets]
    name, preset = min(candidates, key=lambda np_: abs(math.log(np_[1].params.num_experts / dims[0])))
    shape = dict(sequences=4, tokens=min(preset.params.tokens, 400)) if tokens is None else dict(sequences=1,
                                                                                                 tokens=int(tokens))
    trace = synthesize_preset(name, seed, num_experts=dims[0], top_k=dims[1], num_layers=dims[2], **shape)
    return trace, (f"SYNTHETIC trace (no --trace given): preset {name}'s locality with E={dims[0]}, k={dims[1]}, "
                   f"{dims[2]} layers (no preset has these){stream}; give --trace for your own workload")
