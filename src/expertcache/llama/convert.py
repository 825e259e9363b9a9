"""Hugging Face MoE checkpoint -> GGUF, written with the ``gguf`` package's writer (``expertcache convert``).

Supported classes (``model_type`` -> GGUF architecture): ``olmoe`` -> ``olmoe``, ``qwen2_moe`` ->
``qwen2moe``, ``qwen3_moe`` -> ``qwen3moe``, ``mixtral`` -> ``llama`` (Mixtral-class MoE). Tensor
names on the GGUF side come from ``gguf.TENSOR_NAMES`` and every name is checked against the
architecture's tensor list ``gguf.MODEL_TENSORS``; the HF side is the per-expert layout
``transformers`` saves (``mlp.experts.N.{gate,up,down}_proj`` / Mixtral's ``w1,w3,w2``), stacked
into one ``[E, rows, cols]`` tensor per layer and projection, expert index slowest (so an expert is
a contiguous byte range: :mod:`.geometry`).

Types (``dtype``): ``f32`` everything; ``f16`` matrices in float16; ``q8_0`` matrices whose rows are
a multiple of 32 quantized by ``gguf.quantize``; in every case vectors (norms, biases) and the
routers (``ffn_gate_inp``) stay float32, as llama.cpp's own converter does. Mixtral's q/k rows are
permuted to llama.cpp's rotary layout (its converter's ``permute``); the others are NeoX-rotary and
kept as they are.

Tokenizer: a byte-level BPE ``tokenizer.json`` (GPT-2 style: ByteLevel pre-tokenizer, merges) is
written as ``tokenizer.ggml.model = gpt2`` with the ``gpt-2`` pre-tokenizer; a checkpoint without
one (or with another kind) gets ``no_vocab`` with ``vocab_size`` dummy tokens, which runs on token
ids. Refused in one line: an unsupported class, router settings llama.cpp's graph of that class
would compute differently (``norm_topk_prob``), sparse-step or dense layers, a missing tensor.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import ConfigError

DTYPES = ("f32", "f16", "q8_0")


@dataclass(frozen=True)
class ArchSpec:
    """How one HF MoE class maps onto a GGUF architecture."""

    arch: str
    router: str          # HF name of the router under model.layers.N
    experts: str         # HF prefix of the experts under model.layers.N
    projections: dict    # GGUF part (gate/up/down) -> HF per-expert projection name
    norm_topk: bool      # what llama.cpp's graph of this class does with the top-k weights
    permute_qk: bool = False
    shared_expert: bool = False


SPECS = {
    "olmoe": ArchSpec("olmoe", "mlp.gate", "mlp.experts", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                      norm_topk=False),
    "qwen2_moe": ArchSpec("qwen2moe", "mlp.gate", "mlp.experts", {"gate": "gate_proj", "up": "up_proj",
                          "down": "down_proj"}, norm_topk=False, shared_expert=True),
    "qwen3_moe": ArchSpec("qwen3moe", "mlp.gate", "mlp.experts", {"gate": "gate_proj", "up": "up_proj",
                          "down": "down_proj"}, norm_topk=True),
    "mixtral": ArchSpec("llama", "block_sparse_moe.gate", "block_sparse_moe.experts", {"gate": "w1", "up": "w3",
                        "down": "w2"}, norm_topk=True, permute_qk=True),
}
# HF name under model.layers.N -> gguf MODEL_TENSOR member name
_LAYER_TENSORS = {
    "input_layernorm.weight": "ATTN_NORM", "post_attention_layernorm.weight": "FFN_NORM",
    "self_attn.q_proj.weight": "ATTN_Q", "self_attn.k_proj.weight": "ATTN_K", "self_attn.v_proj.weight": "ATTN_V",
    "self_attn.o_proj.weight": "ATTN_OUT", "self_attn.q_norm.weight": "ATTN_Q_NORM",
    "self_attn.k_norm.weight": "ATTN_K_NORM", "self_attn.q_proj.bias": "ATTN_Q", "self_attn.k_proj.bias": "ATTN_K",
    "self_attn.v_proj.bias": "ATTN_V", "mlp.shared_expert.gate_proj.weight": "FFN_GATE_SHEXP",
    "mlp.shared_expert.up_proj.weight": "FFN_UP_SHEXP", "mlp.shared_expert.down_proj.weight": "FFN_DOWN_SHEXP",
    "mlp.shared_expert_gate.weight": "FFN_GATE_INP_SHEXP",
}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "TOKEN_EMBD", "model.norm.weight": "OUTPUT_NORM",
                   "lm_head.weight": "OUTPUT"}


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


def _qtype(dtype: str, shape: tuple[int, ...], router: bool) -> str:
    if len(shape) == 1 or router or dtype == "f32":
        return "F32"
    if dtype == "q8_0" and shape[-1] % 32 == 0:
        return "Q8_0"
    return "F16" if dtype != "f32" else "F32"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (its converter's ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Checkpoint:
    """Lazy float32 tensors of a safetensors checkpoint folder (one or more shards)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{folder}: no *.safetensors weights in the checkpoint folder")
        self.where: dict[str, object] = {}
        for f in files:
            h = safe_open(str(f), "np")
            for k in h.keys():
                self.where[k] = h

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ConfigError(f"checkpoint: tensor {name!r} is missing")
        return np.asarray(self.where[name].get_tensor(name), dtype=np.float32)


def read_config(folder: Path) -> tuple[dict, ArchSpec]:
    """The checkpoint's config and its :class:`ArchSpec`; refusals as in the module docstring."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder}: cannot read config.json ({getattr(exc, 'strerror', None) or exc})") from None
    mt = cfg.get("model_type")
    if mt not in SPECS:
        raise ConfigError(f"{folder}: model_type {mt!r} is not supported by convert (supported: {', '.join(SPECS)})")
    spec = SPECS[mt]
    norm = bool(cfg.get("norm_topk_prob", mt == "mixtral"))
    if norm != spec.norm_topk:
        raise ConfigError(f"{folder}: norm_topk_prob={str(norm).lower()}, but llama.cpp's {spec.arch} graph "
                          f"{'normalizes' if spec.norm_topk else 'does not normalize'} the top-k weights: "
                          "the GGUF would compute another model")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers") or cfg.get("first_k_dense_replace"):
        raise ConfigError(f"{folder}: dense (non-MoE) layers are not supported by convert")
    return cfg, spec


def plan_tensors(ckpt, cfg: dict, spec: ArchSpec, dtype: str) -> list[Planned]:
    """Every GGUF tensor in write order, with its producer (reads the checkpoint lazily)."""
    gguf = _gguf()
    L, E = cfg["num_hidden_layers"], cfg.get("num_experts", cfg.get("num_local_experts"))
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[_arch_enum(gguf, spec.arch)]}
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    out: list[Planned] = []

    def add(template: str, bid: int | None, suffix: str, shape, produce, router=False):
        if template not in allowed:
            raise ConfigError(f"convert: {template} is not a tensor of GGUF architecture {spec.arch}")
        name = template.format(bid=bid) + "." + suffix
        out.append(Planned(name, tuple(shape), _qtype(dtype, tuple(shape), router), produce))

    for hf, member in _GLOBAL_TENSORS.items():
        if hf == "lm_head.weight" and hf not in ckpt.where:
            continue  # tied embeddings: llama.cpp reuses token_embd
        add(gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, member)], None, "weight", ckpt.shape(hf),
            lambda hf=hf: ckpt.get(hf))
    for bid in range(L):
        pre = f"model.layers.{bid}."
        for hf, member in _LAYER_TENSORS.items():
            if pre + hf not in ckpt.where:
                continue
            produce = lambda n=pre + hf: ckpt.get(n)
            shape = ckpt.shape(pre + hf)
            if member == "FFN_GATE_INP_SHEXP":
                shape, produce = (shape[-1],), (lambda n=pre + hf: ckpt.get(n).reshape(-1))
            elif spec.permute_qk and member in ("ATTN_Q", "ATTN_K") and hf.endswith("weight"):
                nh = heads if member == "ATTN_Q" else kv_heads
                produce = lambda n=pre + hf, nh=nh: _permute(ckpt.get(n), nh)
            add(gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, member)], bid, hf.rsplit(".", 1)[1], shape, produce,
                router=member == "FFN_GATE_INP_SHEXP")
        router = f"{pre}{spec.router}.weight"
        add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP], bid, "weight", ckpt.shape(router),
            lambda n=router: ckpt.get(n), router=True)
        for part, proj in spec.projections.items():
            names = [f"{pre}{spec.experts}.{e}.{proj}.weight" for e in range(E)]
            missing = [n for n in names if n not in ckpt.where]
            if missing:
                raise ConfigError(f"convert: tensor {missing[0]!r} is missing (only the per-expert layout is supported)")
            member = getattr(gguf.MODEL_TENSOR, f"FFN_{part.upper()}_EXP")
            add(gguf.TENSOR_NAMES[member], bid, "weight", (E, *ckpt.shape(names[0])),
                lambda names=names: np.stack([ckpt.get(n) for n in names]))
    return out


def _arch_enum(gguf, arch: str):
    for member, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return member
    raise ConfigError(f"convert: gguf {getattr(gguf, '__version__', '')} does not know architecture {arch}")


def write_hparams(writer, cfg: dict, spec: ArchSpec, dtype: str) -> None:
    """The architecture keys llama.cpp reads for these classes."""
    gguf = _gguf()
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or H // heads
    E = cfg.get("num_experts", cfg.get("num_local_experts"))
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    writer.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(H)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_expert_count(int(E))
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    moe_ff = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_expert_feed_forward_length(int(moe_ff))
    if spec.shared_expert:
        writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    writer.add_vocab_size(int(cfg["vocab_size"]))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])


def write_tokenizer(writer, folder: Path | None, vocab: int) -> str:
    """GPT-2-style byte-level BPE as ``gpt2``/``gpt-2``, else ``no_vocab``; returns which."""
    tok = None
    if folder is not None and (folder / "tokenizer.json").is_file():
        try:
            tok = json.loads((folder / "tokenizer.json").read_text())
        except (OSError, ValueError):
            tok = None
    model = (tok or {}).get("model") or {}
    pre = (tok or {}).get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not isinstance(model.get("vocab"), dict):
        writer.add_tokenizer_model("no_vocab")
        return "no_vocab"
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [1] * vocab  # NORMAL
    for text, i in model["vocab"].items():
        if 0 <= i < vocab:
            tokens[i] = text
    for added in tok.get("added_tokens") or []:
        i = added.get("id")
        if isinstance(i, int) and 0 <= i < vocab:
            tokens[i], types[i] = added.get("content", tokens[i]), 3 if added.get("special") else 4  # CONTROL / USER
    merges = [" ".join(m) if isinstance(m, list) else str(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    return "gpt2"


def write_gguf(out: str | os.PathLike, arch: str, planned: list[Planned], add_keys: Callable[[object], None],
               name: str) -> int:
    """Write ``planned`` tensors (streamed, one in memory at a time) and the keys to ``out``
    atomically (a temporary beside it, renamed on success). Returns the file's size."""
    gguf = _gguf()
    out = Path(out)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
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
    planned = plan_tensors(ckpt, cfg, spec, dtype)
    info: dict = {}

    def keys(writer):
        write_hparams(writer, cfg, spec, dtype)
        info["tokenizer"] = write_tokenizer(writer, folder, int(cfg["vocab_size"]))

    size = write_gguf(out, spec.arch, planned, keys, folder.name)
    return {"out": os.fspath(out), "model": os.fspath(folder), "architecture": spec.arch, "dtype": dtype,
            "tensors": len(planned), "bytes": size, "tokenizer": info["tokenizer"]}


class RandomWeights:
    """A stand-in for a checkpoint: the tensors an HF ``config`` implies, filled with seeded normal
    values (scale 0.02, norms 1), drawn per tensor from ``seed`` and the tensor's position. Used to
    build large random-weight GGUFs for benchmarks without writing an HF checkpoint first."""

    def __init__(self, cfg: dict, spec: ArchSpec, seed: int = 0):
        H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        E = cfg.get("num_experts", cfg.get("num_local_experts"))
        ff = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (H // cfg["num_attention_heads"])
        shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
        for b in range(L):
            pre = f"model.layers.{b}."
            shapes.update({pre + "input_layernorm.weight": (H,), pre + "post_attention_layernorm.weight": (H,),
                           pre + "self_attn.q_proj.weight": (H, H), pre + "self_attn.k_proj.weight": (kv, H),
                           pre + "self_attn.v_proj.weight": (kv, H), pre + "self_attn.o_proj.weight": (H, H),
                           pre + "self_attn.q_norm.weight": (H,), pre + "self_attn.k_norm.weight": (kv,),
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


def convert_random(cfg: dict, out: str | os.PathLike, dtype: str = "f16", seed: int = 0) -> dict:
    """A random-weight GGUF of the OLMoE-class ``cfg`` (an HF config dict), no checkpoint needed."""
    cfg = {"model_type": "olmoe", **cfg}
    spec = SPECS[cfg["model_type"]]
    if spec.arch != "olmoe":
        raise ConfigError("convert_random: only the olmoe class is supported")
    planned = plan_tensors(RandomWeights(cfg, spec, seed), cfg, spec, dtype)

    def keys(writer):
        write_hparams(writer, cfg, spec, dtype)
        write_tokenizer(writer, None, int(cfg["vocab_size"]))

    size = write_gguf(out, spec.arch, planned, keys, f"random-olmoe-seed{seed}")
    return {"out": os.fspath(out), "architecture": spec.arch, "dtype": dtype, "bytes": size, "seed": seed}
