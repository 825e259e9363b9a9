"""What a sizing needs to know about a model: E, k, its MoE layers and the bytes of its weights.

:func:`read_model` takes a Hugging Face ``config.json`` (or a folder holding one), a checkpoint
folder (``config.json`` beside ``*.safetensors``) or a GGUF file and returns a :class:`ModelSpec`:

* ``num_experts`` E (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``; GGUF
  ``<arch>.expert_count``), ``top_k`` k (``num_experts_per_tok``; GGUF ``<arch>.expert_used_count``),
  ``moe_layers`` (layers with routed experts: ``num_hidden_layers`` minus DeepSeek's
  ``first_k_dense_replace`` and Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``; GGUF: the
  blocks holding ``ffn_*_exps`` tensors);
* ``expert_bytes`` S: one routed expert (:func:`~expertcache.costmodel.sizing.expert_bytes_from_config`
  for a config; the routed-expert tensors' bytes / (E x MoE layers) for a checkpoint or a GGUF, the
  mean over layers; a GGUF's per-layer sizes, which differ where tensor types do, are kept in
  ``layer_expert_bytes``);
* ``other_bytes``: every weight that is not a routed expert (embeddings, attention, routers, norms,
  shared experts, dense MLPs), which must stay on the device beside the cache. Exact for a
  checkpoint (the safetensors headers) and a GGUF (its tensor table); from a config alone it is
  estimated from the shapes (``other_source`` says which).

Only headers are read (the safetensors JSON header; the GGUF header by
:func:`expertcache.formats.gguf.read_geometry`, the one GGUF reader, which sizes tensors with the
``gguf`` package's type table); no weight is loaded. Every mistake is a one-line ConfigError naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, is_int
from ..formats.safetensors import checkpoint_files, read_headers
from ..trace.validate import MAX_EXPERTS, MAX_LAYERS
from .sizing import LIMITS, _dtype_bytes, _weight_bytes, config_scopes, expert_bytes_of, read_model_config

EXPERT_MARK = ".experts."
"""A checkpoint tensor whose name holds this is a routed expert's (``mlp.experts.3.w1``,
``block_sparse_moe.experts.0.w2``, fused ``mlp.experts.gate_up_proj``); ``shared_experts`` is not."""


@dataclass(frozen=True)
class ModelSpec:
    """See the module docstring; ``other_bytes`` is ``None`` when unknown."""

    num_experts: int
    top_k: int
    moe_layers: int
    expert_bytes: int
    other_bytes: int | None
    source: str
    other_source: str = ""
    layer_expert_bytes: tuple[int, ...] | None = None
    """One expert's bytes per MoE layer where they are known to differ (a GGUF: Q4_K_M stores some
    layers' ``ffn_down_exps`` as Q6_K); ``None``: every layer's expert is ``expert_bytes``."""

    @property
    def layer_set_bytes(self) -> int:
        """Bytes of one expert of every MoE layer: ``sum(layer_expert_bytes)``, else ``MoE layers x S``."""
        if self.layer_expert_bytes is not None:
            return int(sum(self.layer_expert_bytes))
        return self.moe_layers * self.expert_bytes

    @property
    def all_experts_bytes(self) -> int:
        """``E x MoE layers x S`` (per-layer sizes summed where known): every routed expert of the model."""
        return self.num_experts * self.layer_set_bytes


def read_model(path: str | Path, option: str = "--model-config") -> ModelSpec:
    """A :class:`ModelSpec` from a config.json, a checkpoint folder or a ``.gguf`` file (``option``:
    how the user named it, for messages)."""
    path = Path(path)
    where = f"{option} {path}"
    if not path.exists():
        raise ConfigError(f"{where}: no such file or folder")
    if path.suffix.lower() == ".gguf" and not path.is_dir():  # a FIFO too: refused as not a regular file
        return _from_gguf(path, option)
    config, _, name = read_model_config(path, option)
    spec = _from_config(config, path, where, name)
    shards = checkpoint_files(path) if path.is_dir() else []
    if not shards:
        return spec
    experts, other = _safetensors_bytes(shards)
    if experts == 0:
        raise ConfigError(f"{where}: no tensor named '*{EXPERT_MARK}*' in the safetensors files; not a MoE checkpoint")
    per = experts // (spec.num_experts * spec.moe_layers)
    return ModelSpec(spec.num_experts, spec.top_k, spec.moe_layers, per, other, f"checkpoint {path}",
                     "safetensors headers (exact)")


POSITIVE_KEYS = frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                           "vocab_size", "head_dim", "num_experts", "num_local_experts", "n_routed_experts",
                           "moe_num_experts", "num_experts_per_tok", "moe_topk", "top_k", "moe_intermediate_size",
                           "intermediate_size"})
"""Config keys that must be at least 1 where given: a size or a count of heads, experts or layers (0
KV heads had estimated attention without its k and v projections, exit 0). The others (dense layers
first, a LoRA rank, shared experts) may be 0."""


def _get(config: dict, where: str, *keys: str, default: Any = ...) -> Any:
    for key in keys:
        for scope in config_scopes(config, where):
            if scope.get(key) is not None:
                value = scope[key]
                if not is_int(value, 1 if key in POSITIVE_KEYS else 0):
                    kind = "a positive" if key in POSITIVE_KEYS else "a non-negative"
                    raise ConfigError(f"{where}: {key} = {value!r} is not {kind} integer")
                return value
    if default is not ...:
        return default
    raise ConfigError(f"{where}: config has no {' or '.join(repr(k) for k in keys)}; not a mixture-of-experts config")


def moe_layer_ids(config: dict, where: str = "config") -> list[int]:
    """Layers with routed experts: all ``num_hidden_layers`` but DeepSeek's first
    ``first_k_dense_replace`` (and those off ``moe_layer_freq``) and Qwen's ``mlp_only_layers`` (and
    those off ``decoder_sparse_step``)."""
    n = _get(config, where, "num_hidden_layers")
    if n > MAX_LAYERS:  # the list below is n long
        raise ConfigError(f"{where}: num_hidden_layers {n} is more than {MAX_LAYERS:,}")
    dense_first = _get(config, where, "first_k_dense_replace", default=0)
    freq = max(1, _get(config, where, "moe_layer_freq", default=1))
    step = max(1, _get(config, where, "decoder_sparse_step", default=1))
    listed = next((s["mlp_only_layers"] for s in config_scopes(config, where)
                   if isinstance(s.get("mlp_only_layers"), list)), [])
    mlp_only = {i for i in listed if isinstance(i, int)}
    return [i for i in range(n) if i >= dense_first and i % freq == 0 and (i + 1) % step == 0 and i not in mlp_only]


def _from_config(config: dict, path: Path, where: str, name: str) -> ModelSpec:
    E = _get(config, where, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    k = _get(config, where, "num_experts_per_tok", "moe_topk", "top_k")
    moe = moe_layer_ids(config, where)
    if E < 1 or k < 1 or k > E or not moe:
        raise ConfigError(f"{where}: E = {E}, k = {k}, {len(moe)} MoE layer(s): not a mixture-of-experts config")
    if E > MAX_EXPERTS:  # as a trace's E: 10**31 had been sized, "non-expert weights (6.554e+23 TB)"
        raise ConfigError(f"{where}: {E:,} experts a layer is more than {MAX_EXPERTS:,}")
    S = expert_bytes_of(config, where, name)
    other = estimate_other_params(config, where, len(moe)) * _width(config, where)
    return ModelSpec(E, k, len(moe), S, other, f"config {path}", "estimated from the config's shapes")


def _width(config: dict, where: str) -> int:
    quant = next((s["quantization_config"] for s in config_scopes(config, where)
                  if isinstance(s.get("quantization_config"), Mapping)), None)
    if quant is not None:
        return _weight_bytes(where, quant)
    for scope in config_scopes(config, where):
        for key in ("torch_dtype", "dtype"):
            if scope.get(key) is not None:
                return _dtype_bytes(where, key, scope[key])
    raise ConfigError(f"{where}: config has no torch_dtype")  # pragma: no cover - expert_bytes_from_config refused it


def estimate_other_params(config: dict, where: str, moe_layers: int) -> int:
    """Parameters outside the routed experts, from the shapes: embeddings (twice unless
    ``tie_word_embeddings``), attention per layer (q, k, v, o; MLA's low-rank projections when
    ``kv_lora_rank`` is set), two norms per layer, a router of ``hidden x E`` per MoE layer, shared
    experts and the dense layers' MLPs (``3 x hidden x intermediate_size`` each)."""
    g = lambda *keys, default=0: _get(config, where, *keys, default=default)  # noqa: E731
    h, n = g("hidden_size", default=...), g("num_hidden_layers", default=...)
    heads = g("num_attention_heads", default=...)
    kv = g("num_key_value_heads", default=heads)
    hd = g("head_dim", default=h // max(heads, 1))
    ties = [s["tie_word_embeddings"] for s in config_scopes(config, where) if s.get("tie_word_embeddings") is not None]
    bad = [t for t in ties if not isinstance(t, bool)]
    if bad:  # "x" had been read as untied, exit 0
        raise ConfigError(f"{where}: tie_word_embeddings = {str(bad[0])[:60]!r} is not true or false")
    tied = any(ties)
    embed = g("vocab_size", default=...) * h * (1 if tied else 2)
    if g("kv_lora_rank"):
        q_rank, kv_rank = g("q_lora_rank"), g("kv_lora_rank")
        nope, rope, v = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
        q = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        attn = q + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h
    else:
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    E = g("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    moe_inter = g("moe_intermediate_size", "intermediate_size")
    shared = g("n_shared_experts") * 3 * h * moe_inter + (3 * h * g("shared_expert_intermediate_size") + h
                                                          if g("shared_expert_intermediate_size") else 0)
    dense = (n - moe_layers) * 3 * h * g("intermediate_size")
    return embed + n * (attn + 2 * h) + h + moe_layers * (h * E + shared) + dense


def _safetensors_bytes(shards: list[Path]) -> tuple[int, int]:
    """``(routed-expert bytes, other bytes)`` summed over the tensors of ``shards`` (headers only;
    :func:`~expertcache.formats.safetensors.read_headers` checked every entry's offsets)."""
    experts = other = 0
    for _, header, _ in read_headers(shards):
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            size = stop - start
            if EXPERT_MARK in name:
                experts += size
            else:
                other += size
    return experts, other


def _from_gguf(path: Path, option: str) -> ModelSpec:
    """The GGUF's own tensor table, read by :func:`expertcache.formats.gguf.read_geometry` (the one
    GGUF reader): E, k, the MoE layers, each layer's expert bytes (types may differ by layer) and the
    dense bytes (every byte that is neither an expert tensor nor a skipped MTP block, header included).
    ``expert_bytes`` is the mean over layers, rounded; ``layer_expert_bytes`` keeps them exactly."""
    from ..formats.gguf import read_geometry, type_sizes

    where = f"{option} {path}"
    type_sizes(where)  # the gguf package first: without it, one line saying so
    g = read_geometry(str(path), option)
    per_layer = tuple(g.layer_expert_bytes)
    per = round(g.expert_tensor_bytes / (g.num_experts * len(per_layer)))
    if not 1 <= max(per_layer) <= LIMITS["expert_bytes"]:
        raise ConfigError(f"{where}: experts of {max(per_layer)} bytes are not plausible")
    return ModelSpec(g.num_experts, g.top_k, len(per_layer), per, g.dense_bytes, f"GGUF {path}",
                     "GGUF tensor table (exact)", per_layer)
