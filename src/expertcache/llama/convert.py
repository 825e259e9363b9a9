"""Hugging Face MoE checkpoint -> GGUF, written with the ``gguf`` package's writer (``expertcache convert``).

Supported classes (``model_type`` -> GGUF architecture): ``olmoe`` -> ``olmoe``, ``qwen2_moe`` ->
``qwen2moe``, ``qwen3_moe`` -> ``qwen3moe``, ``mixtral`` -> ``llama`` (Mixtral-class MoE),
``deepseek_v3`` -> ``deepseek2``, ``gpt_oss`` -> ``gpt-oss``, ``glm4_moe`` -> ``glm4moe``.

The mapping is data: one :class:`ArchSpec` per class holds its GGUF architecture, the table of
:class:`Rule` s that turn a checkpoint tensor under ``model.layers.N`` into GGUF tensors (a rename,
or a reshape/split/row permutation), where its router and experts live, the HF config defaults the
converter reads, and small hooks for what one class alone needs (extra refusals, extra metadata).

Invariants (each one checked, a violation refused in one line):

* every GGUF tensor name comes from ``gguf.TENSOR_NAMES`` and is in the architecture's
  ``gguf.MODEL_TENSORS`` list;
* every tensor of the checkpoint is written (renamed, split or permuted) or deliberately dropped:
  ``rotary_emb.inv_freq`` buffers, and blocks at or past ``num_hidden_layers`` that are not written
  as multi-token-prediction blocks (DeepSeek-V3's MTP block: gguf's ``deepseek2`` table has no
  ``nextn`` tensors; transformers does not run those blocks either). Anything else (an FP8 scale,
  an unknown bias) is refused, so no weight the HF model computes with is silently left out;
* routed experts are one ``[E, rows, cols]`` tensor per layer and projection (and ``[E, n]`` per
  expert bias), expert index slowest, so an expert is a contiguous byte range (:mod:`.geometry`).
  The HF side is the per-expert layout transformers 5 saves for OLMoE, Qwen*, Mixtral, DeepSeek-V3
  and GLM-4-MoE (``mlp.experts.N.{gate,up,down}_proj``, Mixtral's ``w1,w3,w2``) or the packed one:
  ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) with ``down_proj [E, H, I]`` (a
  state dict saved as the model holds it), or gpt-oss's ``gate_up_proj [E, H, 2I]`` (gate and up
  columns interleaved, even/odd) with ``down_proj [E, I, H]`` and their ``_bias`` tensors.

Per class: Mixtral's q/k rows are permuted to llama.cpp's rotary layout (its converter's
``permute``); DeepSeek-V3's ``kv_b_proj`` is split into ``attn_k_b`` (transposed per head, for the
absorbed MLA graph) and ``attn_v_b``, and with ``rope_interleave=false`` the rotary rows of
``q_b_proj``/``kv_a_proj_with_mqa`` are reordered from half-split pairs to adjacent pairs (llama.cpp's
``deepseek2`` rotates adjacent pairs); GLM-4-MoE writes its MTP blocks (``nextn_predict_layers``)
when the checkpoint holds them. The others are NeoX-rotary and kept as they are.

Types (``dtype``): ``f32`` everything; ``f16`` matrices in float16; ``q8_0`` matrices whose rows are
a multiple of 32 quantized by ``gguf.quantize``; in every case vectors, biases (expert biases
included), the routers (``ffn_gate_inp``) and the selection bias stay float32, as llama.cpp's own
converter does. Checkpoint weights are read as float32 from f32, f16 or bf16 safetensors (bf16
widened exactly); float8 or integer tensors (a quantized release) are refused.

By design llama.cpp's graphs compute some things differently from transformers, not refused here
(measured in tests/test_llama_convert.py, described in docs/llama.md): DeepSeek-V3's MLA runs
absorbed (the same products reassociated); gpt-oss's YaRN correction range is always truncated
(floor/ceil) where transformers' gpt-oss config says ``truncate: false``, so some rotary
frequencies differ; transformers' DeepSeek-V3 / GLM-4-MoE routers return their top-k from
``torch.topk(sorted=False)``, llama.cpp's in descending order (the same set).

Tokenizer: a byte-level BPE ``tokenizer.json`` (GPT-2 style: ByteLevel pre-tokenizer, merges) is
written as ``tokenizer.ggml.model = gpt2`` with the ``gpt-2`` pre-tokenizer; a checkpoint without
one (or with another kind) gets ``no_vocab`` with ``vocab_size`` dummy tokens, which runs on token
ids. A chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) is
written as ``tokenizer.chat_template`` (named templates as ``tokenizer.chat_template.NAME``).

Refused in one line: an unsupported class; a setting llama.cpp's graph of that class would compute
differently (``norm_topk_prob`` against a graph that fixes it, a rope type other than default/YaRN,
YaRN settings the graph does not read, a hidden activation other than SiLU, and the per-class ones
in :data:`SPECS`' hooks); dense layers in a class whose graph has none; a missing tensor; a
checkpoint tensor with no place in the GGUF.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .._io import read_json, read_text, temporary_name
from ..costmodel.sizing import MAX_CONFIG_BYTES
from ..errors import ConfigError, is_int, is_real
from ..formats.gguf import chat_template_problem
from ..formats.safetensors import checkpoint_files, held_twice, read_header

DTYPES = ("f32", "f16", "q8_0")


# ------------------------------------------------------------------------------ the tables
@dataclass(frozen=True)
class Rule:
    """One GGUF tensor made from one checkpoint tensor: the ``gguf.MODEL_TENSOR`` member, the GGUF
    suffix (``None``: the HF name's last part, ``weight`` or ``bias``), and optional ``shape``
    ``(cfg, hf_shape) -> numpy shape`` and ``convert`` ``(cfg, values) -> values`` for a reshape,
    split or permutation (both or neither). ``f32``: float32 at every ``--dtype`` (routers)."""

    member: str
    suffix: str | None = None
    shape: Callable[[dict, tuple], tuple] | None = None
    convert: Callable[[dict, np.ndarray], np.ndarray] | None = None
    f32: bool = False


def _r(member: str, **kw) -> tuple[Rule, ...]:
    return (Rule(member, **kw),)


# HF name under model.layers.N -> the GGUF tensors made of it (every class; a spec may override)
_LAYER_RULES: dict[str, tuple[Rule, ...]] = {
    "input_layernorm.weight": _r("ATTN_NORM"), "post_attention_layernorm.weight": _r("FFN_NORM"),
    **{f"self_attn.{p}_proj.{s}": _r(m) for p, m in (("q", "ATTN_Q"), ("k", "ATTN_K"), ("v", "ATTN_V"),
                                                      ("o", "ATTN_OUT")) for s in ("weight", "bias")},
    "self_attn.q_norm.weight": _r("ATTN_Q_NORM"), "self_attn.k_norm.weight": _r("ATTN_K_NORM"),
    # leading dense layers (DeepSeek-V3, GLM-4-MoE)
    "mlp.gate_proj.weight": _r("FFN_GATE"), "mlp.up_proj.weight": _r("FFN_UP"), "mlp.down_proj.weight": _r("FFN_DOWN"),
    # shared experts: Qwen2-MoE's gated one, DeepSeek-V3 / GLM-4-MoE's n_shared_experts fused into one FFN
    **{f"mlp.shared_expert{s}.{p}_proj.weight": _r(f"FFN_{p.upper()}_SHEXP") for s in ("", "s")
       for p in ("gate", "up", "down")},
    "mlp.shared_expert_gate.weight": _r("FFN_GATE_INP_SHEXP", shape=lambda c, s: (s[-1],),
                                        convert=lambda c, w: w.reshape(-1), f32=True),
}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "TOKEN_EMBD", "model.norm.weight": "OUTPUT_NORM",
                   "lm_head.weight": "OUTPUT"}


def _router_rules(router: str) -> dict[str, tuple[Rule, ...]]:
    return {f"{router}.weight": _r("FFN_GATE_INP", f32=True), f"{router}.bias": _r("FFN_GATE_INP"),
            f"{router}.e_score_correction_bias": _r("FFN_EXP_PROBS_B", suffix="bias")}


@dataclass(frozen=True)
class ArchSpec:
    """How one HF MoE class maps onto a GGUF architecture.

    ``router``/``experts``: HF module names under ``model.layers.N``; ``projections``: GGUF part
    (gate/up/down) -> HF per-expert projection name; ``packed``: the packed experts layout the class
    may be saved in (``concatenated`` [E, 2I, H] or gpt-oss's ``interleaved_transposed``);
    ``norm_topk``: what llama.cpp's graph does with the top-k weights (``None``: nothing fixed, the
    class's keys say it); ``rules``: tensor rules added to / overriding :data:`_LAYER_RULES`;
    ``dense_lead``: leading dense layers (``first_k_dense_replace``) are allowed; ``nextn``: MTP
    blocks are written; ``output_required``: llama.cpp needs ``output.weight`` (tied embeddings are
    then written twice); ``mla``: DeepSeek's latent attention (key/value lengths, one KV head);
    ``yarn_log_mul``: the graph reads ``rope.scaling.yarn_log_multiplier`` (``mscale_all_dim``);
    ``defaults``: the transformers config class defaults of the keys read here, for a config.json
    that leaves them out; ``check``: extra refusals ``cfg -> message | None``; ``keys``: extra
    metadata ``(writer, cfg, gguf)``."""

    arch: str
    router: str
    experts: str
    projections: dict
    norm_topk: bool | None
    shared_expert: bool = False
    rules: dict = field(default_factory=dict)
    packed: str = "concatenated"
    dense_lead: bool = False
    nextn: bool = False
    output_required: bool = False
    mla: bool = False
    yarn_log_mul: bool = False
    defaults: dict = field(default_factory=dict)
    check: Callable[[dict], str | None] | None = None
    keys: Callable[[object, dict, object], None] | None = None

    def layer_rules(self) -> dict[str, tuple[Rule, ...]]:
        return {**_LAYER_RULES, **_router_rules(self.router), **self.rules}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (its converter's ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _same(c, s):
    return s


_MIXTRAL_RULES = {
    "self_attn.q_proj.weight": _r("ATTN_Q", shape=_same, convert=lambda c, w: _permute(w, c["num_attention_heads"])),
    "self_attn.k_proj.weight": _r("ATTN_K", shape=_same, convert=lambda c, w: _permute(
        w, c.get("num_key_value_heads") or c["num_attention_heads"])),
}


# -- DeepSeek-V3 (deepseek2): MLA tensors, kv_b split, rotary row order
def _adjacent_pairs(rope: int) -> np.ndarray:
    """Row order taking half-split rotary pairs ``(i, i + rope/2)`` to adjacent ones ``(2i, 2i + 1)``."""
    h = rope // 2
    return np.stack([np.arange(h), np.arange(h) + h], axis=1).reshape(-1)


def _ds_q(c: dict, w: np.ndarray) -> np.ndarray:
    """``q_b_proj``/``q_proj`` rows ``[heads * (nope + rope), in]``; rotary rows to adjacent pairs
    when the checkpoint's rope is half-split (``rope_interleave=false``)."""
    if c.get("rope_interleave", True):
        return w
    nope, rope = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    w = w.reshape(c["num_attention_heads"], nope + rope, -1).copy()
    w[:, nope:] = w[:, nope:][:, _adjacent_pairs(rope)]
    return w.reshape(-1, w.shape[-1])


def _ds_kv_a(c: dict, w: np.ndarray) -> np.ndarray:
    """``kv_a_proj_with_mqa`` rows ``[kv_lora_rank + rope, H]``; rotary rows as in :func:`_ds_q`."""
    if c.get("rope_interleave", True):
        return w
    r = c["kv_lora_rank"]
    w = w.copy()
    w[r:] = w[r:][_adjacent_pairs(c["qk_rope_head_dim"])]
    return w


def _kv_b(c: dict, w: np.ndarray) -> np.ndarray:
    """``kv_b_proj`` ``[heads * (nope + v), kv_lora_rank]`` as ``[heads, nope + v, kv_lora_rank]``."""
    return w.reshape(c["num_attention_heads"], c["qk_nope_head_dim"] + c["v_head_dim"], c["kv_lora_rank"])


_DEEPSEEK_RULES = {
    "self_attn.q_a_proj.weight": _r("ATTN_Q_A"), "self_attn.q_a_layernorm.weight": _r("ATTN_Q_A_NORM"),
    "self_attn.q_b_proj.weight": _r("ATTN_Q_B", shape=_same, convert=_ds_q),
    "self_attn.q_proj.weight": _r("ATTN_Q", shape=_same, convert=_ds_q),  # q_lora_rank = None
    "self_attn.kv_a_proj_with_mqa.weight": _r("ATTN_KV_A_MQA", shape=_same, convert=_ds_kv_a),
    "self_attn.kv_a_layernorm.weight": _r("ATTN_KV_A_NORM"),
    # attn_k_b {nope, rank, heads}: per head W_k^T, so q_nope is absorbed into the latent space;
    # attn_v_b {rank, v, heads}: per head W_v
    "self_attn.kv_b_proj.weight": (
        Rule("ATTN_K_B", shape=lambda c, s: (c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"]),
             convert=lambda c, w: _kv_b(c, w)[:, :c["qk_nope_head_dim"]].transpose(0, 2, 1)),
        Rule("ATTN_V_B", shape=lambda c, s: (c["num_attention_heads"], c["v_head_dim"], c["kv_lora_rank"]),
             convert=lambda c, w: _kv_b(c, w)[:, c["qk_nope_head_dim"]:]),
    ),
}
_NEXTN_RULES = {
    "eh_proj.weight": _r("NEXTN_EH_PROJ"), "enorm.weight": _r("NEXTN_ENORM"), "hnorm.weight": _r("NEXTN_HNORM"),
    "embed_tokens.weight": _r("NEXTN_EMBED_TOKENS"), "shared_head.head.weight": _r("NEXTN_SHARED_HEAD_HEAD"),
    "shared_head.norm.weight": _r("NEXTN_SHARED_HEAD_NORM"),
}


def _n_experts(cfg: dict) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def _v3_routing_check(cfg: dict, arch: str) -> str | None:
    """DeepSeek-V3-style routing (sigmoid scores, selection bias, expert groups, shared experts)."""
    if int(cfg.get("n_shared_experts") or 0) < 1:
        return (f"n_shared_experts={cfg.get('n_shared_experts')}, but llama.cpp's {arch} graph always adds "
                "a shared expert")
    E, g, tg = _n_experts(cfg), int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if g > 1 and (E % g or E // g < 2 or tg < 1):
        return f"n_group={g}, topk_group={tg} with {E} experts: not a grouping either graph can compute"
    return None


def _v3_routing_keys(w, cfg: dict, gguf) -> None:
    """Sigmoid gating, ``norm_topk_prob``, ``routed_scaling_factor``, expert groups (written only
    when a group is left out: ``topk_group < n_group``; llama.cpp requires that of the keys), the
    shared experts and the leading dense layers."""
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor") or 1.0))
    w.add_expert_shared_count(int(cfg["n_shared_experts"]))
    w.add_leading_dense_block_count(int(cfg.get("first_k_dense_replace") or 0))
    g, tg = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if 1 < g and tg < g:
        w.add_expert_group_count(g)
        w.add_expert_group_used_count(tg)


def _deepseek_check(cfg: dict) -> str | None:
    if cfg.get("attention_bias"):
        return "attention_bias=true, but llama.cpp's deepseek2 graph has no attention biases"
    L = cfg["num_hidden_layers"]
    if cfg.get("q_lora_rank") and (L in (26, 27) or (L == 48 and cfg.get("vocab_size") == 128256)):
        return (f"q_lora_rank={cfg['q_lora_rank']} with {L} layers: llama.cpp's deepseek2 loader takes a model of "
                "this depth for a 'lite' one without q_lora_rank")
    if int(cfg["qk_rope_head_dim"]) % 2:
        return f"qk_rope_head_dim={cfg['qk_rope_head_dim']} is odd"
    return _v3_routing_check(cfg, "deepseek2")


def _deepseek_keys(w, cfg: dict, gguf) -> None:
    _v3_routing_keys(w, cfg, gguf)
    w.add_q_lora_rank(int(cfg.get("q_lora_rank") or 0))
    w.add_kv_lora_rank(int(cfg["kv_lora_rank"]))
    w.add_key_length_mla(int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]))
    w.add_value_length_mla(int(cfg["v_head_dim"]))


def _glm_check(cfg: dict) -> str | None:
    return _v3_routing_check(cfg, "glm4moe")


def _layer_types(cfg: dict) -> list[str]:
    """gpt-oss's per-layer attention kinds (transformers' default: even layers sliding)."""
    L = cfg["num_hidden_layers"]
    return list(cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)])


def _gpt_oss_check(cfg: dict) -> str | None:
    alpha, limit = float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
    if (alpha, limit) != (1.702, 7.0):
        return (f"swiglu_alpha={alpha}, swiglu_limit={limit}, but llama.cpp's gpt-oss graph computes its SwiGLU "
                "with alpha 1.702 and limit 7.0")
    if not cfg.get("attention_bias", True):
        return "attention_bias=false, but llama.cpp's gpt-oss graph needs the attention biases"
    types = _layer_types(cfg)
    odd = sorted(set(types) - {"sliding_attention", "full_attention"})
    if odd or len(types) != cfg["num_hidden_layers"]:
        return f"layer_types {odd or types}: only sliding_attention / full_attention, one per layer"
    if "sliding_attention" in types and not cfg.get("sliding_window"):
        return "sliding_attention layers without a sliding_window"
    return None


def _gpt_oss_keys(w, cfg: dict, gguf) -> None:
    """Sliding window and which layers use it (a bool per layer, as transformers' ``layer_types``)."""
    types = _layer_types(cfg)
    w.add_sliding_window(int(cfg.get("sliding_window") or 0))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])


_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_V3_DEFAULTS = {"n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 0,
                "norm_topk_prob": True, "num_nextn_predict_layers": 0, "attention_bias": False}
SPECS = {
    "olmoe": ArchSpec("olmoe", "mlp.gate", "mlp.experts", _PROJ, norm_topk=False),
    "qwen2_moe": ArchSpec("qwen2moe", "mlp.gate", "mlp.experts", _PROJ, norm_topk=False, shared_expert=True),
    "qwen3_moe": ArchSpec("qwen3moe", "mlp.gate", "mlp.experts", _PROJ, norm_topk=True),
    "mixtral": ArchSpec("llama", "block_sparse_moe.gate", "block_sparse_moe.experts",
                        {"gate": "w1", "up": "w3", "down": "w2"}, norm_topk=True, rules=_MIXTRAL_RULES),
    "deepseek_v3": ArchSpec(
        "deepseek2", "mlp.gate", "mlp.experts", _PROJ, norm_topk=None, rules=_DEEPSEEK_RULES, dense_lead=True,
        mla=True, yarn_log_mul=True, check=_deepseek_check, keys=_deepseek_keys,
        defaults={**_V3_DEFAULTS, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                  "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                  "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_interleave": True, "num_nextn_predict_layers": 1,
                  "rms_norm_eps": 1e-6}),
    "gpt_oss": ArchSpec(
        "gpt-oss", "mlp.router", "mlp.experts", _PROJ, norm_topk=None, packed="interleaved_transposed",
        rules={"post_attention_layernorm.weight": _r("ATTN_POST_NORM"),
               "self_attn.sinks": _r("ATTN_SINKS", suffix="weight")},
        output_required=True, check=_gpt_oss_check, keys=_gpt_oss_keys,
        defaults={"num_experts_per_tok": 4, "attention_bias": True, "sliding_window": 128, "swiglu_alpha": 1.702,
                  "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "head_dim": 64,
                  "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096,
                                      "rope_theta": 150000.0}}),
    "glm4_moe": ArchSpec(
        "glm4moe", "mlp.gate", "mlp.experts", _PROJ, norm_topk=None,
        rules={"post_attention_layernorm.weight": _r("ATTN_POST_NORM"), **_NEXTN_RULES}, dense_lead=True, nextn=True,
        check=_glm_check, keys=_v3_routing_keys,
        defaults={**_V3_DEFAULTS, "num_experts_per_tok": 8, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                  "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5, "use_qk_norm": False,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError("the gguf package is not installed (pip install 'expertcache[llama]')") from None
    return gguf


@dataclass
class Planned:
    """One GGUF tensor to write: name, numpy shape, ggml type name, and how to produce its float32 values."""

    name: str
    shape: tuple[int, ...]
    qtype: str
    produce: Callable[[], np.ndarray]


def _qtype(dtype: str, shape: tuple[int, ...], f32: bool) -> str:
    if len(shape) == 1 or f32 or dtype == "f32":
        return "F32"
    if dtype == "q8_0" and shape[-1] % 32 == 0:
        return "Q8_0"
    return "F16"


class _Checkpoint:
    """Lazy float32 tensors of a safetensors checkpoint folder (one or more shards). bfloat16, which
    numpy cannot hold, is widened from the file's bytes (exact: bf16 is float32's upper half);
    float8 and other non-float types are refused in one line."""

    def __init__(self, folder: Path):
        from safetensors import SafetensorError, safe_open
        files = checkpoint_files(folder)
        if not files:
            raise ConfigError(f"{folder}: no *.safetensors weights in the checkpoint folder")
        self.where: dict[str, object] = {}
        self.file: dict[str, Path] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
        for f in files:
            try:
                h = safe_open(str(f), "np")
            except SafetensorError as exc:  # its header checked whole: lengths, offsets, shapes, JSON
                raise ConfigError(f"{f}: not a safetensors file convert can read ({str(exc)[:200]})") from None
            for k in h.keys():
                if k in self.file:  # as formats.safetensors.read_headers refuses it
                    raise held_twice(k, f, self.file[k])
                self.where[k], self.file[k] = h, f

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ConfigError(f"checkpoint: tensor {name!r} is missing")
        dtype = self.where[name].get_slice(name).get_dtype()
        if dtype == "BF16":
            return self._bf16(name)
        if dtype not in ("F64", "F32", "F16"):
            raise ConfigError(f"checkpoint: tensor {name!r} is {dtype}, not a float type convert reads "
                              "(f32, f16, bf16); dequantize the checkpoint first")
        return np.asarray(self.where[name].get_tensor(name), dtype=np.float32)

    def _bf16(self, name: str) -> np.ndarray:
        path = self.file[name]
        if path not in self._headers:  # safe_open checked it whole; the format has one reader
            self._headers[path] = read_header(path)
        header, start = self._headers[path]
        begin, end = header[name]["data_offsets"]
        raw = np.fromfile(path, dtype="<u2", count=(end - begin) // 2, offset=start + begin)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(header[name]["shape"])


# ------------------------------------------------------------------------------ config
def _rope_parameters(raw: dict, default: dict | None) -> dict:
    """The rope settings as transformers 5 saves them (``rope_parameters``), else the older
    ``rope_theta`` + ``rope_scaling`` pair, else the class default; ``partial_rotary_factor`` may sit
    at the top level in older configs."""
    if isinstance(raw.get("rope_parameters"), dict):
        p = dict(raw["rope_parameters"])
    elif isinstance(raw.get("rope_scaling"), dict):
        p = dict(raw["rope_scaling"])
    else:
        p = dict(default or {}) if "rope_theta" not in raw else {}
    if "type" in p and "rope_type" not in p:
        p["rope_type"] = p.pop("type")
    p.setdefault("rope_theta", raw.get("rope_theta", (default or {}).get("rope_theta", 10000.0)))
    p.setdefault("rope_type", "default")
    if "partial_rotary_factor" not in p and raw.get("partial_rotary_factor") is not None:
        p["partial_rotary_factor"] = raw["partial_rotary_factor"]
    return p


def _head_dims(cfg: dict, spec: ArchSpec) -> dict:
    """key/value lengths, rotary dims and KV heads as llama.cpp reads them for this class."""
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if spec.mla:  # the absorbed graph's single latent KV head: [kv_lora_rank | rope] keys, kv_lora_rank values
        r, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        return {"key": r + rope, "value": r, "rot": rope, "kv_heads": 1}
    head_dim = int(cfg.get("head_dim") or H // heads)
    rot = int(head_dim * float(cfg["rope_parameters"].get("partial_rotary_factor") or 1.0))
    return {"key": head_dim, "value": head_dim, "rot": rot,
            "kv_heads": int(cfg.get("num_key_value_heads") or heads)}


def _yarn(cfg: dict) -> tuple[float, int]:
    p = cfg["rope_parameters"]
    orig = int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or cfg.get("max_position_embeddings", orig) / orig)
    return factor, orig


def _rope_problem(cfg: dict, spec: ArchSpec) -> str | None:
    """Why llama.cpp's graph of this class would rotate differently from transformers, or None.

    Default rope is written as is. YaRN: llama.cpp's graphs here use beta_fast 32 / beta_slow 1 and,
    for the attention factor, ``0.1 ln(factor) + 1`` (transformers' value without ``mscale``), or for
    deepseek2 ``mscale_all_dim`` read from the log multiplier key with ``mscale`` taken equal to it."""
    p = cfg["rope_parameters"]
    if any(isinstance(v, dict) for v in p.values()):
        return f"per-layer-type rope parameters ({', '.join(k for k, v in p.items() if isinstance(v, dict))})"
    kind = p.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "yarn":
        return f"rope_type={kind!r}: convert writes default or yarn rope only"
    if not p.get("original_max_position_embeddings"):
        return "yarn rope without original_max_position_embeddings"
    if (float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)) != (32.0, 1.0):
        return (f"yarn beta_fast={p.get('beta_fast')}, beta_slow={p.get('beta_slow')}: llama.cpp's {spec.arch} "
                "graph uses 32 and 1")
    if p.get("attention_factor") is not None:
        return (f"yarn attention_factor={p['attention_factor']}: llama.cpp's {spec.arch} graph derives it "
                "from the factor")
    ms, msad = p.get("mscale"), p.get("mscale_all_dim")
    if spec.yarn_log_mul:
        if not (ms and msad and float(ms) == float(msad)):
            return (f"yarn mscale={ms}, mscale_all_dim={msad}: llama.cpp's {spec.arch} graph computes the "
                    "attention scale of transformers only when both are set and equal")
    elif ms or msad:
        return f"yarn mscale={ms}, mscale_all_dim={msad}: llama.cpp's {spec.arch} graph does not read them"
    return None


def design_notes(cfg: dict, spec: ArchSpec) -> list[str]:
    """What llama.cpp's graph computes differently from transformers for ``cfg`` by design (accepted,
    not refused): gpt-oss's ``truncate: false`` YaRN, whose correction range llama.cpp rounds."""
    p, notes = cfg["rope_parameters"], []
    if p.get("rope_type") == "yarn" and p.get("truncate", True) is False:
        rot, base, orig = _head_dims(cfg, spec)["rot"], float(p["rope_theta"]), _yarn(cfg)[1]

        def dim(rotations: float) -> float:
            return rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = max(dim(32.0), 0.0), min(dim(1.0), rot - 1.0)
        notes.append(f"yarn truncate=false: llama.cpp rounds the correction range [{lo:.2f}, {hi:.2f}] to "
                     f"[{max(math.floor(lo), 0)}, {min(math.ceil(hi), rot - 1)}], so some rotary frequencies differ "
                     "from transformers' (docs/llama.md, Convert)")
    return notes


def read_config(folder: Path) -> tuple[dict, ArchSpec]:
    """The checkpoint's config (the class defaults of :attr:`ArchSpec.defaults` under it, the rope
    settings normalized into ``rope_parameters``) and its :class:`ArchSpec`; refusals as in the
    module docstring."""
    raw = read_json(folder / "config.json", str(folder), max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise ConfigError(f"{folder}: config.json is not a JSON object")
    mt = raw.get("model_type")
    if not isinstance(mt, str) or mt not in SPECS:
        raise ConfigError(f"{folder}: model_type {mt!r} is not supported by convert (supported: {', '.join(SPECS)})")
    spec = SPECS[mt]
    for key in ("rope_parameters", "rope_scaling"):  # not a table: it had been passed over, exit 0
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"{folder}: {key} {str(raw[key])[:60]!r} in config.json is not a table (a JSON object)")
    cfg = {**spec.defaults, **raw}
    cfg["rope_parameters"] = _rope_parameters(raw, spec.defaults.get("rope_parameters"))
    problem = config_types(cfg) or config_problem(cfg, spec)
    if problem:
        raise ConfigError(f"{folder}: {problem}")
    return cfg, spec


CONFIG_INTS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "vocab_size", "num_experts", "num_local_experts",
               "n_routed_experts", "num_experts_per_tok", "head_dim", "max_position_embeddings", "n_shared_experts",
               "n_group", "topk_group", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "first_k_dense_replace", "num_nextn_predict_layers", "sliding_window")
"""config.json integers convert computes with: where present and not null, each an integer >= 0
(``q_lora_rank`` and the counts of dense or MTP layers may be 0), the sizes and counts above 0, and
none above :data:`CONFIG_INT_MAX`."""
CONFIG_INT_MAX = 2**32 - 1
"""The largest config.json integer convert takes: GGUF stores these hyperparameters as uint32 (a
``sliding_window`` of 10**400 had ended the write as an internal error, "argument out of range")."""
CONFIG_REALS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "swiglu_limit", "swiglu_alpha",
                "partial_rotary_factor")
"""config.json numbers convert computes with: where present and not null, each a finite number above
0 (an epsilon, a rope base, a scale: a negative one had been written, exit 0) and within a float32's
normal range (GGUF stores them as one: 1e300 had ended the write as an internal error, and 1e-50
would be written as 0)."""
FLOAT32_MIN, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38
"""The least positive normal float32 and the largest."""
ZERO_OK_REALS = ("mscale", "mscale_all_dim")
"""Of :data:`ROPE_REALS`, the two that may be 0 (DeepSeek's YaRN attention-scale terms)."""
ROPE_REALS = ("rope_theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "partial_rotary_factor", "low_freq_factor", "high_freq_factor")
"""``rope_parameters`` keys that hold numbers (a text value among them had been a ValueError, exit 70);
its other keys (``rope_type``, ``truncate``, a per-layer-type table) are checked where they are read."""
CONFIG_BOOLS = ("norm_topk_prob", "attention_bias", "rope_interleave")
"""config.json switches convert reads: where present and not null, each true or false (a string had
been read by its truthiness, so ``"false"`` meant true, exit 0); ``rope_parameters.truncate`` too."""
CONFIG_ZERO_OK = ("q_lora_rank", "first_k_dense_replace", "num_nextn_predict_layers", "n_shared_experts",
                  "sliding_window")


CONFIG_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                   "num_experts_per_tok", "max_position_embeddings", "rms_norm_eps")
"""config.json fields every converted class computes with: ``null`` is refused (it had been exit 70,
a TypeError in the arithmetic); the other fields may be null where the class reads null as a setting
(``q_lora_rank``, ``sliding_window``, ``head_dim``, ...)."""


def config_types(cfg: dict) -> str | None:
    """The one-line reason ``cfg`` holds a value of the wrong type for convert (a size as a string, a
    NaN epsilon, 0 experts per token, a required field null), or None: checked before anything is
    written."""
    for key in CONFIG_REQUIRED:
        if key in cfg and cfg[key] is None:
            return f"{key} is null in config.json; convert needs its value"
    for key in CONFIG_INTS:
        v = cfg.get(key)
        if v is None:
            continue
        if not is_int(v, 0, CONFIG_INT_MAX) or (v == 0 and key not in CONFIG_ZERO_OK):
            kind = "a non-negative" if key in CONFIG_ZERO_OK else "a positive"
            return f"{key} {str(v)[:60]!r} in config.json is not {kind} integer of at most {CONFIG_INT_MAX:,}"
    rope = cfg.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}  # read_config refused any other; its normal form is a table
    orig = rope.get("original_max_position_embeddings")
    if orig is not None and not is_int(orig, 1, CONFIG_INT_MAX):
        return (f"rope_parameters.original_max_position_embeddings {str(orig)[:60]!r} in config.json is not a "
                f"positive integer of at most {CONFIG_INT_MAX:,}")
    for key, v in [(k, cfg.get(k)) for k in CONFIG_BOOLS] + [("rope_parameters.truncate", rope.get("truncate"))]:
        if v is not None and not isinstance(v, bool):
            return f"{key} {str(v)[:60]!r} in config.json is not true or false"
    numbers = [(k, cfg.get(k)) for k in CONFIG_REALS]
    numbers += [(f"rope_parameters.{k}", rope.get(k)) for k in ROPE_REALS]
    for key, v in numbers:
        if v is None:
            continue
        if not is_real(v):
            return f"{key} {str(v)[:60]!r} in config.json is not a finite number"
        zero_ok = key.rpartition(".")[2] in ZERO_OK_REALS
        if not (FLOAT32_MIN <= v <= FLOAT32_MAX or (zero_ok and v == 0)):
            kind = "neither 0 nor" if zero_ok else "not"
            return (f"{key} {str(v)[:60]!r} in config.json is {kind} within a float32's positive range "
                    "(1.2e-38 to 3.4e38)")
    return None


def config_shapes(ckpt, cfg: dict) -> str | None:
    """The one-line reason config.json disagrees with the weights' shapes where llama.cpp takes the
    sizes from the first and checks them against the second (it refused such a GGUF at load, after
    convert had written it with exit 0), or None: the embedding's rows and columns against
    ``vocab_size`` and ``hidden_size``; the first layer's ``q_proj`` / ``k_proj`` rows against the
    heads times ``head_dim`` (not for multi-head latent attention, whose projections differ)."""
    emb = "model.embed_tokens.weight"
    if emb in ckpt.where:
        shape = tuple(ckpt.shape(emb))
        for key, have in (("vocab_size", shape[0]), ("hidden_size", shape[-1])):
            if cfg.get(key) is not None and have != cfg[key]:
                return f"{key} {cfg[key]} in config.json, but {emb} has shape {list(shape)}"
    if cfg.get("kv_lora_rank"):
        return None
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    for proj, key, n in (("q_proj", "num_attention_heads", heads),
                         ("k_proj", "num_key_value_heads", cfg.get("num_key_value_heads") or heads)):
        name = f"model.layers.0.self_attn.{proj}.weight"
        if name in ckpt.where and ckpt.shape(name)[0] != n * head_dim:
            return (f"{key} {n} in config.json (x head_dim {head_dim} = {n * head_dim} rows), but {name} has "
                    f"{ckpt.shape(name)[0]} rows")
    return None


def config_problem(cfg: dict, spec: ArchSpec) -> str | None:
    """The one-line reason llama.cpp's graph of ``spec`` would compute another model than the HF
    class with ``cfg``, or None."""
    mt = cfg.get("model_type")
    if spec.norm_topk is not None:
        norm = bool(cfg.get("norm_topk_prob", mt == "mixtral"))
        if norm != spec.norm_topk:
            return (f"norm_topk_prob={str(norm).lower()}, but llama.cpp's {spec.arch} graph "
                    f"{'normalizes' if spec.norm_topk else 'does not normalize'} the top-k weights: "
                    "the GGUF would compute another model")
    dense = cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers") or cfg.get("moe_layer_freq", 1) != 1
    if dense or (cfg.get("first_k_dense_replace") and not spec.dense_lead):
        return "dense (non-MoE) layers are not supported by convert for this class"
    if spec.arch != "gpt-oss" and cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.get('hidden_act')!r}: llama.cpp's {spec.arch} graph uses SiLU"
    if _n_experts(cfg) < 1:
        return "no expert count (num_experts / num_local_experts / n_routed_experts) in config.json"
    dims = _head_dims(cfg, spec)
    if dims["rot"] % 2 or dims["rot"] > dims["key"]:
        return f"{dims['rot']} rotary dimensions: not an even count within the head"
    return _rope_problem(cfg, spec) or (spec.check(cfg) if spec.check else None)


# ------------------------------------------------------------------------------ tensors
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def nextn_blocks(ckpt, cfg: dict, spec: ArchSpec) -> int:
    """The multi-token-prediction blocks written after the ``num_hidden_layers`` decoder blocks: the
    config's ``num_nextn_predict_layers`` when the class writes them (``spec.nextn``) and the
    checkpoint holds every one (probed by ``model.layers.{L+i}.eh_proj.weight``), else 0 (a
    checkpoint saved by transformers has none; a partial set is refused)."""
    n, L = int(cfg.get("num_nextn_predict_layers") or 0), cfg["num_hidden_layers"]
    if not spec.nextn or n < 1:
        return 0
    have = [f"model.layers.{L + i}.eh_proj.weight" in ckpt.where for i in range(n)]
    if any(have) and not all(have):
        raise ConfigError(f"convert: the checkpoint holds {sum(have)} of the {n} multi-token-prediction blocks")
    return n if all(have) else 0


def _expert_tensors(ckpt, cfg: dict, spec: ArchSpec, pre: str, E: int) -> Iterator[tuple]:
    """``(member, suffix, shape, produce, hf names)`` of one MoE layer's routed experts, from the
    per-expert layout (stacked, E slowest) or, when that is absent, the packed one (split)."""
    base = pre + spec.experts
    per = {part: [f"{base}.{e}.{proj}.weight" for e in range(E)] for part, proj in spec.projections.items()}
    if all(n in ckpt.where for names in per.values() for n in names):
        for part, names in per.items():
            yield (f"FFN_{part.upper()}_EXP", "weight", (E, *ckpt.shape(names[0])),
                   lambda names=names: np.stack([ckpt.get(n) for n in names]), names)
        return
    gu, dn = f"{base}.gate_up_proj", f"{base}.down_proj"
    if gu not in ckpt.where or dn not in ckpt.where:
        missing = next(n for names in per.values() for n in names if n not in ckpt.where)
        raise ConfigError(f"convert: tensor {missing!r} is missing (and the packed {gu!r} layout is not complete)")
    e, a, b = ckpt.shape(gu)
    if spec.packed == "interleaved_transposed":  # gpt-oss: [E, H, 2I], gate columns even, up odd; down [E, I, H]
        H, I = a, b // 2
        gate = lambda: ckpt.get(gu)[:, :, 0::2].transpose(0, 2, 1)  # noqa: E731
        up = lambda: ckpt.get(gu)[:, :, 1::2].transpose(0, 2, 1)  # noqa: E731
        down, want_down = (lambda: ckpt.get(dn).transpose(0, 2, 1)), (E, I, H)
        gate_b, up_b = (lambda: ckpt.get(gu + "_bias")[:, 0::2]), (lambda: ckpt.get(gu + "_bias")[:, 1::2])
        odd = b % 2
    else:  # transformers' in-memory layout: [E, 2I, H] gate rows first; down [E, H, I]
        I, H = a // 2, b
        gate, up = (lambda: ckpt.get(gu)[:, :I]), (lambda: ckpt.get(gu)[:, I:])
        down, want_down = (lambda: ckpt.get(dn)), (E, H, I)
        gate_b, up_b = (lambda: ckpt.get(gu + "_bias")[:, :I]), (lambda: ckpt.get(gu + "_bias")[:, I:])
        odd = a % 2
    if e != E or odd or ckpt.shape(dn) != want_down:
        raise ConfigError(f"convert: packed experts {gu} {ckpt.shape(gu)} / {dn} {ckpt.shape(dn)} do not match "
                          f"{E} experts of hidden size {H} ({spec.packed} layout)")
    yield "FFN_GATE_EXP", "weight", (E, I, H), gate, [gu]
    yield "FFN_UP_EXP", "weight", (E, I, H), up, [gu]
    yield "FFN_DOWN_EXP", "weight", (E, H, I), down, [dn]
    if gu + "_bias" in ckpt.where or dn + "_bias" in ckpt.where:
        yield "FFN_GATE_EXP", "bias", (E, I), gate_b, [gu + "_bias"]
        yield "FFN_UP_EXP", "bias", (E, I), up_b, [gu + "_bias"]
        yield "FFN_DOWN_EXP", "bias", (E, H), (lambda: ckpt.get(dn + "_bias")), [dn + "_bias"]


def plan_tensors(ckpt, cfg: dict, spec: ArchSpec, dtype: str, nextn: int = 0) -> list[Planned]:
    """Every GGUF tensor in write order, with its producer (reads the checkpoint lazily); checks the
    invariants of the module docstring (names in the architecture's table, every checkpoint tensor
    placed or deliberately dropped)."""
    gguf = _gguf()
    L, E = cfg["num_hidden_layers"], _n_experts(cfg)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[_arch_enum(gguf, spec.arch)]}
    out: list[Planned] = []
    used: set[str] = set()

    def add(member: str, bid: int | None, suffix: str, shape, produce, f32=False):
        template = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, member)]
        if template not in allowed:
            raise ConfigError(f"convert: {template} is not a tensor of GGUF architecture {spec.arch}")
        name = template.format(bid=bid) + "." + suffix
        shape = tuple(int(d) for d in shape)
        out.append(Planned(name, shape, _qtype(dtype, shape, f32 or suffix == "bias"), produce))

    for hf, member in _GLOBAL_TENSORS.items():
        src = hf
        if hf == "lm_head.weight" and hf not in ckpt.where:
            if not spec.output_required:
                continue  # tied embeddings: llama.cpp reuses token_embd
            src = "model.embed_tokens.weight"
        used.add(src)
        add(member, None, "weight", ckpt.shape(src), lambda n=src: ckpt.get(n))
    rules = spec.layer_rules()
    dense_lead = int(cfg.get("first_k_dense_replace") or 0) if spec.dense_lead else 0
    for bid in range(L + nextn):
        pre = f"model.layers.{bid}."
        moe = bid >= dense_lead
        if moe and f"{pre}{spec.router}.weight" not in ckpt.where:
            raise ConfigError(f"convert: tensor {pre}{spec.router}.weight is missing (MoE layer {bid})")
        for hf, targets in rules.items():
            if pre + hf not in ckpt.where:
                continue
            used.add(pre + hf)
            for r in targets:
                shape = r.shape(cfg, ckpt.shape(pre + hf)) if r.shape else ckpt.shape(pre + hf)
                produce = ((lambda n=pre + hf, r=r: r.convert(cfg, ckpt.get(n))) if r.convert
                           else (lambda n=pre + hf: ckpt.get(n)))
                add(r.member, bid, r.suffix or hf.rsplit(".", 1)[1], shape, produce, r.f32)
        if moe:
            for member, suffix, shape, produce, names in _expert_tensors(ckpt, cfg, spec, pre, E):
                used.update(names)
                add(member, bid, suffix, shape, produce)
    left = sorted(n for n in set(ckpt.where) - used if not n.endswith("rotary_emb.inv_freq")
                  and not (_LAYER.match(n) and int(_LAYER.match(n).group(1)) >= L + nextn))
    if left:
        raise ConfigError(f"convert: checkpoint tensor {left[0]!r} has no place in a {spec.arch} GGUF "
                          f"({len(left)} such tensor{'s' if len(left) > 1 else ''}); nothing was written")
    return out


def _arch_enum(gguf, arch: str):
    for member, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return member
    raise ConfigError(f"convert: gguf {getattr(gguf, '__version__', '')} does not know architecture {arch}")


# ------------------------------------------------------------------------------ metadata
def write_hparams(writer, cfg: dict, spec: ArchSpec, dtype: str, nextn: int = 0) -> None:
    """The architecture keys llama.cpp reads for these classes (``cfg`` as :func:`read_config`
    returns it); ``nextn`` MTP blocks follow the ``num_hidden_layers`` decoder blocks."""
    gguf = _gguf()
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    dims = _head_dims(cfg, spec)
    rope = cfg["rope_parameters"]
    writer.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(H)
    writer.add_block_count(cfg["num_hidden_layers"] + nextn)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_key_length(dims["key"])
    writer.add_value_length(dims["value"])
    writer.add_rope_dimension_count(dims["rot"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "yarn":
        factor, orig = _yarn(cfg)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(orig)
        if spec.yarn_log_mul:  # llama.cpp divides the key by 0.1 (its converter's convention)
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_expert_count(_n_experts(cfg))
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    moe_ff = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_expert_feed_forward_length(int(moe_ff))
    if spec.shared_expert:
        writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    if spec.keys:
        spec.keys(writer, cfg, gguf)
    writer.add_vocab_size(int(cfg["vocab_size"]))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])


MAX_TOKENIZER_BYTES = 1 << 27
"""The largest ``tokenizer.json``, ``tokenizer_config.json`` or ``chat_template.jinja`` convert
reads (128 MiB; released tokenizers are tens of MB: Gemma 3's 262k-token tokenizer.json is 33 MB)."""


def _tokenizer_file(folder: Path, name: str):
    """The JSON value of ``folder/name``, or None when there is no such entry; a file that is
    there but unreadable, too large, not JSON or not a JSON object is one ConfigError line."""
    path = folder / name
    if not os.path.lexists(path):
        return None
    value = read_json(path, str(folder), max_bytes=MAX_TOKENIZER_BYTES)
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return value


def read_chat_template(folder: Path | None):
    """The checkpoint's chat template: ``chat_template.jinja`` (transformers 5 saves it so), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}``);
    None when there is none (or it is empty). One that is there but is not UTF-8 text, or is
    neither a string nor such a list, is refused in one line (each had been exit 70, or passed
    over with exit 0)."""
    if folder is None:
        return None
    jinja = folder / "chat_template.jinja"
    if os.path.lexists(jinja):
        text = read_text(jinja, str(folder), max_bytes=MAX_TOKENIZER_BYTES)
        return text if text.strip() else None
    tc = _tokenizer_file(folder, "tokenizer_config.json") or {}
    value = tc.get("chat_template")
    if value is None or (isinstance(value, str) and not value.strip()) or value == []:
        return None
    if isinstance(value, str) or (isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) and isinstance(t.get("name", ""), str)
            for t in value)):
        return value
    raise ConfigError(f"{folder / 'tokenizer_config.json'}: chat_template {str(value)[:60]!r} is neither a string "
                      "nor a list of {name, template} tables")


@dataclass
class Vocabulary:
    """A GPT-2-style byte-level BPE vocabulary as the GGUF stores it, read and checked before
    anything is written: ``tokens``/``types`` of the model's ``vocab_size`` (ids the tokenizer leaves
    unused are ``[PADi]``), ``merges`` as ``"a b"``, ``special`` ids (``bos``/``eos``/``unk``/``pad``
    ``_token`` -> id), ``add_bos`` and ``dropped``: tokenizer ids at or past ``vocab_size``, which
    the model has no embedding for and the GGUF leaves out (said in convert's notes)."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    special: dict[str, int]
    add_bos: bool
    dropped: int = 0


def read_vocabulary(folder: Path | None, vocab: int,
                    config: dict | None = None) -> tuple[Vocabulary | None, str | None]:
    """``(vocabulary, None)`` for a GPT-2-style byte-level BPE ``tokenizer.json``; ``(None, note)``
    for a checkpoint without one (note None) or with another kind (the note says which, since
    the GGUF then runs on token ids only). A tokenizer.json or tokenizer_config.json that is there
    but malformed is one ConfigError line: a wrong type anywhere convert reads had been exit 70 or
    passed over (a GGUF without vocabulary, or with llama.cpp's default id 11 as EOS), exit 0."""
    tok = _tokenizer_file(folder, "tokenizer.json") if folder is not None else None
    if tok is None:
        return None, None
    where = f"{folder / 'tokenizer.json'}"
    model, pre = tok.get("model"), tok.get("pre_tokenizer")
    for key, value in (("model", model), ("pre_tokenizer", pre)):
        if not isinstance(value, dict) and (key == "model" or value is not None):
            raise ConfigError(f"{where}: {key} {str(value)[:40]!r} is not a table (a JSON object)")
    kind = (model.get("type"), (pre or {}).get("type"))
    if kind != ("BPE", "ByteLevel"):
        return None, (f"tokenizer.json is a {str(kind[0])[:20]} model with a {str(kind[1])[:20]} pre-tokenizer, not "
                      "GPT-2-style byte-level BPE: the GGUF has no vocabulary and runs on token ids")
    table = model.get("vocab")
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: model.vocab {str(table)[:40]!r} is not a table of token -> id")
    tokens, types, dropped = [f"[PAD{i}]" for i in range(vocab)], [1] * vocab, 0  # 1: NORMAL
    for text, i in table.items():
        if not is_int(i, 0):
            raise ConfigError(f"{where}: model.vocab gives {text[:40]!r} the id {str(i)[:40]!r}, not an integer >= 0")
        if i < vocab:
            tokens[i] = text
        else:
            dropped += 1
    merges = model.get("merges", [])
    if not isinstance(merges, list):
        raise ConfigError(f"{where}: model.merges {str(merges)[:40]!r} is not a list")
    for m in merges:
        if not (isinstance(m, str) or (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m))):
            raise ConfigError(f"{where}: the merge {str(m)[:40]!r} is neither \"a b\" nor [\"a\", \"b\"]")
    added = tok.get("added_tokens") or []
    if not isinstance(added, list):
        raise ConfigError(f"{where}: added_tokens {str(added)[:40]!r} is not a list")
    for a in added:
        if not (isinstance(a, dict) and is_int(a.get("id"), 0) and isinstance(a.get("content"), str)
                and isinstance(a.get("special", False), bool)):
            raise ConfigError(f"{where}: the added token {str(a)[:60]!r} needs an integer id >= 0, a string content "
                              "and special true or false")
        if a["id"] < vocab:
            tokens[a["id"]], types[a["id"]] = a["content"], 3 if a.get("special") else 4  # CONTROL / USER
        elif a["content"] not in table:
            dropped += 1
    special, add_bos = _special_tokens(folder, tokens, config or {})
    return Vocabulary(tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges], special, add_bos,
                      dropped), None


def write_tokenizer(writer, v: Vocabulary | None) -> str:
    """``v`` as ``gpt2``/``gpt-2`` (:func:`read_vocabulary`), else ``no_vocab``; returns which."""
    if v is None:
        writer.add_tokenizer_model("no_vocab")
        return "no_vocab"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.types)
    writer.add_token_merges(v.merges)
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if key in v.special:
            add(v.special[key])
    writer.add_add_bos_token(v.add_bos)
    return "gpt2"


def _special_tokens(folder: Path, tokens: list[str], config: dict) -> tuple[dict[str, int], bool]:
    """The special tokens ``tokenizer_config.json`` names (``bos_token``, ``eos_token``,
    ``unk_token``, ``pad_token``: a string or ``{"content": ...}``) as their ids, and whether a BOS is
    prepended (``add_bos_token``, default false as for GPT-2). Without them llama.cpp takes its
    defaults for a ``gpt2`` vocabulary (id 11 as BOS and EOS), so generation would stop at whatever
    token 11 is: a BOS or EOS the file does not name is taken from config.json's ``bos_token_id`` /
    ``eos_token_id`` (an integer, or a list whose first is taken). A ``tokenizer_config.json`` that
    is not a JSON object, a BOS or EOS not in the vocabulary, config.json's id that is not a token
    id, and ``add_bos_token`` with no BOS are refused in one line (each had been written with
    llama.cpp's id 11 in its place, exit 0)."""
    path = folder / "tokenizer_config.json"
    cfg = _tokenizer_file(folder, "tokenizer_config.json") or {}
    ids = {t: i for i, t in enumerate(tokens)}
    written: dict[str, int] = {}
    for key, fallback in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", None),
                          ("pad_token", None)):
        value = cfg.get(key)
        if value is None:
            token = config.get(fallback) if fallback else None
            token = token[0] if isinstance(token, list) and token else token  # several EOS ids: the first
            if token is None or token == []:
                continue
            if not (is_int(token, 0) and token < len(tokens)):
                raise ConfigError(f"{folder}: config.json's {fallback} {str(config.get(fallback))[:40]!r} is not a "
                                  f"token id below vocab_size {len(tokens)}")
            written[key] = token
            continue
        text = value.get("content") if isinstance(value, dict) else value
        if not isinstance(text, str) or (text not in ids and fallback):
            raise ConfigError(f"{path}: {key} {str(value)[:60]!r} is not a token of tokenizer.json's vocabulary")
        if text in ids:
            written[key] = ids[text]
    add_bos = cfg.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise ConfigError(f"{path}: add_bos_token {str(add_bos)[:40]!r} is not true or false")
    if add_bos and "bos_token" not in written:
        raise ConfigError(f"{path}: add_bos_token is true but no bos_token is named (nor config.json's bos_token_id)")
    return written, add_bos


# ------------------------------------------------------------------------------ writing
def write_gguf(out: str | os.PathLike, arch: str, planned: list[Planned], add_keys: Callable[[object], None],
               name: str) -> int:
    """Write ``planned`` tensors (streamed, one in memory at a time) and the keys to ``out``
    atomically (a temporary beside it, renamed on success). Returns the file's size."""
    gguf = _gguf()
    out = Path(out)
    tmp = temporary_name(out)
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        writer.add_name(name)
        add_keys(writer)
        for p in planned:
            qt = getattr(gguf.GGMLQuantizationType, p.qtype)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            nbytes = int(np.prod(p.shape[:-1], dtype=np.int64)) * (p.shape[-1] // block) * size
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), nbytes, raw_dtype=qt)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in planned:
            data = p.produce()
            if data.shape != p.shape:
                raise ConfigError(f"convert: {p.name} has shape {data.shape}, planned {p.shape}")
            writer.write_tensor_data(_encode(gguf, data, p.qtype))
        writer.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out.stat().st_size


def _encode(gguf, data: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "F32":
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == "F16":
        return np.ascontiguousarray(data, dtype=np.float16)
    return gguf.quantize(np.ascontiguousarray(data, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)


def convert(folder: str | os.PathLike, out: str | os.PathLike, dtype: str = "f32") -> dict:
    """Convert the HF MoE checkpoint ``folder`` to the GGUF ``out``; returns a summary record."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a checkpoint folder")
    cfg, spec = read_config(folder)
    ckpt = _Checkpoint(folder)
    nextn = nextn_blocks(ckpt, cfg, spec)
    planned = plan_tensors(ckpt, cfg, spec, dtype, nextn)
    problem = config_shapes(ckpt, cfg)
    if problem:
        raise ConfigError(f"{folder}: {problem}; llama.cpp would not load the GGUF")
    template = read_chat_template(folder)
    problem = None if template is None else chat_template_problem(template)
    if problem:  # llama-cpp-python would fail to load the GGUF, for a prompt as for a chat
        raise ConfigError(f"{folder}: its chat template does not compile ({problem}); fix it, or remove it "
                          "(chat_template.jinja / tokenizer_config.json's chat_template)")
    vocabulary, note = read_vocabulary(folder, int(cfg["vocab_size"]), cfg)
    notes = design_notes(cfg, spec) + ([note] if note else [])
    if vocabulary is not None and vocabulary.dropped:
        notes.append(f"tokenizer.json: {vocabulary.dropped} token(s) with ids at or past vocab_size "
                     f"{cfg['vocab_size']} (no embedding row) are left out")

    def keys(writer):
        write_hparams(writer, cfg, spec, dtype, nextn)
        write_tokenizer(writer, vocabulary)
        if template is not None:
            writer.add_chat_template(template)

    size = write_gguf(out, spec.arch, planned, keys, folder.name)
    return {"out": os.fspath(out), "model": os.fspath(folder), "architecture": spec.arch, "dtype": dtype,
            "tensors": len(planned), "bytes": size, "tokenizer": "no_vocab" if vocabulary is None else "gpt2",
            "chat_template": template is not None, "nextn_layers": nextn, "notes": notes}


class RandomWeights:
    """A stand-in for a checkpoint: the tensors an HF ``config`` implies, filled with seeded normal
    values (scale 0.02, norms 1), drawn per tensor from ``seed`` and the tensor's position. Used to
    build large random-weight GGUFs for benchmarks without writing an HF checkpoint first."""

    def __init__(self, cfg: dict, spec: ArchSpec, seed: int = 0):
        H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        E = _n_experts(cfg)
        ff = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
        head = H // cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head
        per_head = spec.arch == "qwen3moe"  # Qwen3's q/k norms are over one head; OLMoE's over all of them
        shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
        for b in range(L):
            pre = f"model.layers.{b}."
            shapes.update({pre + "input_layernorm.weight": (H,), pre + "post_attention_layernorm.weight": (H,),
                           pre + "self_attn.q_proj.weight": (H, H), pre + "self_attn.k_proj.weight": (kv, H),
                           pre + "self_attn.v_proj.weight": (kv, H), pre + "self_attn.o_proj.weight": (H, H),
                           pre + "self_attn.q_norm.weight": (head if per_head else H,),
                           pre + "self_attn.k_norm.weight": (head if per_head else kv,),
                           pre + spec.router + ".weight": (E, H)})
            for e in range(E):
                for part, proj in spec.projections.items():
                    shapes[f"{pre}{spec.experts}.{e}.{proj}.weight"] = (H, ff) if part == "down" else (ff, H)
        self.shapes, self.seed = shapes, seed
        self.where = dict.fromkeys(shapes)
        self.index = {n: i for i, n in enumerate(shapes)}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def get(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        rng = np.random.default_rng([self.seed, self.index[name]])
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def convert_random(cfg: dict, out: str | os.PathLike, dtype: str = "f16", seed: int = 0,
                   tokenizer: str | os.PathLike | None = None) -> dict:
    """A random-weight GGUF of the OLMoE- or Qwen3-MoE-class ``cfg`` (an HF config dict, ``model_type``
    olmoe by default), no checkpoint needed;
    ``tokenizer``: a folder whose byte-level BPE ``tokenizer.json`` (and ``tokenizer_config.json``) to
    write, of the config's vocabulary size (else the file runs on token ids only)."""
    cfg = {"model_type": "olmoe", **cfg}
    spec = SPECS.get(cfg["model_type"])
    if spec is None or spec.arch not in ("olmoe", "qwen3moe"):
        raise ConfigError("convert_random: only the olmoe and qwen3_moe classes are supported")
    cfg["rope_parameters"] = _rope_parameters(cfg, None)
    problem = config_problem(cfg, spec)
    if problem:
        raise ConfigError(f"convert_random: {problem}")
    planned = plan_tensors(RandomWeights(cfg, spec, seed), cfg, spec, dtype)
    vocabulary, _ = read_vocabulary(Path(tokenizer) if tokenizer is not None else None, int(cfg["vocab_size"]), cfg)

    def keys(writer):
        write_hparams(writer, cfg, spec, dtype)
        write_tokenizer(writer, vocabulary)

    size = write_gguf(out, spec.arch, planned, keys, f"random-{spec.arch}-seed{seed}")
    return {"out": os.fspath(out), "architecture": spec.arch, "dtype": dtype, "bytes": size, "seed": seed}
