"""What the live harness needs to know about a Hugging Face MoE model.

In transformers v5 every supported MoE family routes a token through one seam,
``mlp.experts(hidden_states, top_k_index, top_k_weights)``, where the experts module is built by
``@use_experts_implementation`` and holds all experts packed in two parameters:

* ``gate_up_proj``: ``[E, 2I, H]`` (gate rows first, then up rows),
* ``down_proj``: ``[E, H, I]``.

:func:`find_sites` lists those modules (one per MoE layer, keyed by decoder-layer index) and refuses
a model whose experts use another layout (transposed, biased, ungated, interleaved, normed after
each expert, expert-parallel, quantized) with one line naming the layer and the reason, so the
offloaded path only ever runs where indexing dimension 0 by expert id is the whole story.

:func:`forward_info` reads where a top-level forward stands in its sequence (how many tokens the
KV cache already holds), which is how a run and a capture tell a new sequence (nothing cached:
a prefill or a teacher-forced pass) from a decode step.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import transformers
from packaging.version import Version

from .._text import first_line, id_ranges, short
from ..errors import ConfigError

#: The transformers releases this package was verified against (the ``hf`` extra pins the same).
TRANSFORMERS_RANGE = (Version("5.17.0"), Version("6"))
SUPPORTED_LAYOUT = "packed gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases"


def require_transformers(version: str | None = None) -> None:
    """Raise :class:`ConfigError` unless the installed transformers is inside :data:`TRANSFORMERS_RANGE`."""
    found = Version(version or transformers.__version__)
    lo, hi = TRANSFORMERS_RANGE
    if not lo <= found < hi:
        raise ConfigError(
            f"expertcache.hf supports transformers >={lo},<{hi}; found {found} "
            "(pip install 'expertcache[hf]')"
        )


@dataclass(frozen=True, eq=False)
class ExpertsSite:
    """One MoE layer: its decoder-layer index, module path, experts module and router (if known)."""

    layer: int
    name: str
    experts: torch.nn.Module
    router: torch.nn.Module | None
    router_output_index: int = 0

    @property
    def num_experts(self) -> int:
        return int(self.experts.gate_up_proj.shape[0])

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert occupies (its gate_up and down rows)."""
        gu, dn = self.experts.gate_up_proj, self.experts.down_proj
        return (gu[0].numel() * gu.element_size()) + (dn[0].numel() * dn.element_size())


def is_experts_module(module: torch.nn.Module) -> bool:
    """True for modules built by transformers' ``@use_experts_implementation`` decorator."""
    forward = getattr(type(module), "forward", None)
    return (
        hasattr(forward, "__wrapped__")
        and all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "config"))
    )


def layout_problem(module: torch.nn.Module) -> str | None:
    """Why ``module``'s experts cannot be offloaded slot by slot, or ``None`` when they can."""
    if not module.has_gate:
        return "are not gated (an up_proj without a gate)"
    if module.has_bias:
        return "have biases"
    if module.is_transposed:
        return "store their weights transposed ([E, H, 2I])"
    if not getattr(module, "is_concatenated", True):
        return "interleave gate and up rows"
    if getattr(module, "has_post_expert_norm", False):
        return "apply a norm after each expert"
    if getattr(module, "_is_expert_parallel", False):
        return "are sharded for expert parallelism"
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor):
        return "have no gate_up_proj / down_proj tensors"
    if "DTensor" in (type(gu).__name__, type(getattr(gu, "data", None)).__name__):
        return "are sharded across devices (tensor or expert parallel)"
    if gu.dim() != 3 or dn.dim() != 3:
        return f"have gate_up_proj {tuple(gu.shape)} / down_proj {tuple(dn.shape)} (expected 3-d packed tensors)"
    E, two_i, H = gu.shape
    if dn.shape != (E, H, two_i // 2) or two_i % 2:
        return f"have gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} (expected [E, 2I, H] and [E, H, I])"
    if E != getattr(module, "num_experts", E):
        return f"hold {E} experts but report num_experts = {module.num_experts}"
    if gu.device.type == "meta" or dn.device.type == "meta":
        return "are not materialized (meta tensors)"
    if not gu.dtype.is_floating_point or not dn.dtype.is_floating_point:
        return f"are quantized ({gu.dtype})"
    return None


def resolve_device(device: "str | torch.device | None") -> torch.device:
    """``device`` as a torch device (default: cuda when available, else cpu), refused in one line if
    unusable: a value torch does not take (``True``, ``2.5``, a list: torch's message is many lines),
    a negative index, or a device this machine lacks. ``offload(device=...)`` and
    ``load_offloaded`` both take it from here (offload had passed it to ``torch.device`` as it was)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"device {short(device, 40)}: {first_line(exc)}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device}: only cpu and cuda devices are supported")
    return dev


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes: its input embeddings' device, else its first weight outside an
    experts module (offloaded experts live in host memory), else the CPU."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    experts = {id(p) for m in model.modules() if is_experts_module(m) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in experts:
            return p.device
    return torch.device("cpu")


def top_k_of(model: torch.nn.Module) -> int:
    """Experts routed per token, from the model's config (or its ``text_config``); 1 when it names none."""
    cfg = getattr(model, "config", None)
    for cfg_ in (cfg, getattr(cfg, "text_config", None)):
        for key in ("num_experts_per_tok", "moe_top_k", "top_k"):
            value = getattr(cfg_, key, None)
            if isinstance(value, int):
                return value
    return 1


def text_config(config):
    """The config of a model's text part (transformers' ``get_text_config``; the config itself where
    it has none): where ``num_hidden_layers``, ``vocab_size`` and their kin live."""
    return getattr(config, "get_text_config", lambda: config)()


def model_label(model: torch.nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} ({model_type})" if model_type else type(model).__name__


def find_sites(model: torch.nn.Module) -> list[ExpertsSite]:
    """Every MoE layer of ``model`` in layer order, after checking each one's experts layout.

    Raises :class:`ConfigError` (one line) when the model has no such layer, when a layer's experts
    use an unsupported layout, or when two experts modules claim the same layer index.
    """
    label = model_label(model)
    routers = _router_classes(model)
    modules = dict(model.named_modules())
    sites: dict[int, ExpertsSite] = {}
    for name, module in modules.items():
        if not is_experts_module(module):
            continue
        layer = _layer_index(name)
        if layer is None:
            raise ConfigError(f"{label}: cannot tell the layer index of experts module {name!r}")
        problem = layout_problem(module)
        if problem:
            raise ConfigError(
                f"{label} is not supported by expertcache.hf: the experts at layer {layer} ({name}) {problem}; "
                f"supported: {SUPPORTED_LAYOUT}"
            )
        if layer in sites:
            raise ConfigError(
                f"{label} is not supported by expertcache.hf: experts modules {sites[layer].name!r} and {name!r} "
                f"both sit at layer {layer} (models with several MoE stacks are not supported)"
            )
        router, index = _router_of(name, modules, routers)
        sites[layer] = ExpertsSite(layer, name, module, router, index)
    if not sites:
        raise ConfigError(
            f"{label} is not supported by expertcache.hf: it has no transformers v5 experts module "
            f"(mlp.experts(hidden_states, top_k_index, top_k_weights) with {SUPPORTED_LAYOUT})"
        )
    return [sites[k] for k in sorted(sites)]


def select_sites(sites: list[ExpertsSite], layers: Iterable[int] | None, label: str = "model") -> list[ExpertsSite]:
    """The sites of the given layer ids (``None``: all), refusing ids that are not MoE layers."""
    if layers is None:
        return list(sites)
    by_layer = {s.layer: s for s in sites}
    wanted = list(layers)
    if not wanted:
        raise ConfigError("layers: the list of layers to offload is empty")
    if len(set(wanted)) != len(wanted):
        raise ConfigError(f"layers: a layer is named twice in {wanted}")
    missing = [lid for lid in wanted if lid not in by_layer]
    if missing:
        raise ConfigError(
            f"layers: {', '.join(map(str, missing))} {'is not an MoE layer' if len(missing) == 1 else 'are not MoE layers'} "
            f"of this {label} (MoE layers: {id_ranges(sorted(by_layer))})"
        )
    return [by_layer[lid] for lid in sorted(wanted)]


@dataclass(frozen=True)
class ForwardInfo:
    """Shape of one top-level forward call: batch size, new tokens per row, tokens already cached."""

    batch: int
    tokens: int
    past: int

    @property
    def starts_sequence(self) -> bool:
        """Nothing is cached yet: a prefill, or a teacher-forced pass over a whole sequence."""
        return self.past == 0


def forward_info(args: tuple, kwargs: dict[str, Any]) -> ForwardInfo:
    """Read :class:`ForwardInfo` from the arguments of a ``model(...)`` call."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    batch, tokens = (int(x.shape[0]), int(x.shape[1])) if x is not None and x.dim() >= 2 else (1, 0)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = 0
    if cache is not None and hasattr(cache, "get_seq_length"):
        past = int(cache.get_seq_length())
    return ForwardInfo(batch, tokens, past)


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes the KV cache (``cache`` in recent v5 releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _layer_index(name: str) -> int | None:
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
    return int(numbers[-1]) if numbers else None


def _router_classes(model: torch.nn.Module) -> dict[type, int]:
    """Router classes the model declares for ``output_router_logits`` (class -> index of the logits)."""
    out: dict[type, int] = {}
    for sub in model.modules():
        spec = (getattr(type(sub), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        cls = getattr(spec, "target_class", spec)
        if isinstance(cls, type):
            out[cls] = int(getattr(spec, "index", 0) or 0)
    return out


def _router_of(experts_name: str, modules: dict[str, torch.nn.Module], routers: dict[type, int]):
    block = experts_name.rpartition(".")[0]
    for name, module in modules.items():
        if name.rpartition(".")[0] == block and type(module) in routers:
            return module, routers[type(module)]
    return None, 0
