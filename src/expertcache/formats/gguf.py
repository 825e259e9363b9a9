"""The expert geometry of a GGUF MoE file, read from its header with bounded memory.

A GGUF file is a header (magic ``GGUF``, version, tensor and key counts, key/value metadata, tensor
infos) followed by aligned tensor data. :func:`read_header` parses the header itself (every count
and length is checked against :data:`LIMITS` and the file size before anything is allocated; no
third-party reader, whose arrays of strings would be built whole) and sizes every tensor with the
``gguf`` package's table of ggml types (``GGML_QUANT_SIZES``: every float, k-quant, i-quant, MXFP4
...). :func:`read_geometry` returns a :class:`Geometry`: the architecture, E, k, the MoE layers and,
per layer, its *expert tensors*.

An expert tensor is every tensor ``blk.N.<kind>.<suffix>`` whose kind ends in ``_exps`` and whose
slowest ggml dimension is E: ``ffn_{gate,up,down}_exps.weight``, a fused ``ffn_gate_up_exps``, and
per-expert vectors such as gpt-oss's ``ffn_*_exps.bias`` or per-expert ``scale`` tensors. Types may
differ between tensors and layers (llama.cpp's Q4_K_M recipe stores ``ffn_down_exps`` as Q6_K in
some layers and Q4_K in others). Everything else (attention, embeddings, norms, routers
``ffn_gate_inp``, the selection bias ``exp_probs_b``, shared experts ``*_shexp``, the FFNs of
leading dense layers, a 1-d ``ffn_norm_exps``) is *dense*: read on every forward. The layers of a
multi-token-prediction head (``<arch>.nextn_predict_layers``: GLM-4.5's last blocks) are never run
by llama.cpp's main graph: their tensors are *skipped* (``skipped_bytes``), neither dense nor expert.

Invariant (checked here, relied on by the page-cache modes): expert ``e`` of an expert tensor is the
contiguous byte range ``[offset + e * nbytes / E, offset + (e + 1) * nbytes / E)`` of the file,
because the expert index is the slowest ggml dimension and ggml stores rows (and quantization
blocks) contiguously. ``expert_bytes_of(layer)`` sums one expert's slices over the layer's expert
tensors; it may differ between layers.

Architectures: :data:`TESTED` are run by the test suite (routes, every page-cache mode, quantized
files); :data:`READ` are the other GGUF architectures whose tensor table (``gguf.MODEL_TENSORS``)
holds routed-expert tensors, whose llama.cpp graph routes through ``build_moe_ffn`` (which names the
``ffn_moe_topk-N`` tensor the observers read) in the pinned llama.cpp, and which decode text;
:data:`NEWER` the pinned llama.cpp's MoE architectures that package does not know yet. A
file of any other architecture with expert tensors is refused in one line, as are: not a GGUF file,
an unsupported GGUF version, a header or tensor data that runs past the end of the file
(truncated), a count or string beyond :data:`LIMITS`, a ggml type the ``gguf`` package does not
know, a file without expert tensors (not an MoE), expert tensors whose slowest dimension is not E;
and, as llama.cpp refuses them or aborts on them: tensors that overlap, share a name, have no name,
a zero dimension or an offset off the alignment; arrays nested deeper than ``LIMITS["nesting"]``;
a ``block_count`` other than the tensors' blocks; a malformed architecture name; an expert count of
the wrong type (named); a non-finite ``<arch>.`` float, an out-of-range :data:`HPARAM_INTS` or
:data:`HPARAM_FLOATS` value; gate and up expert tensors of different shapes
(tests/test_gguf_header.py). What llama.cpp checks beyond these (a head size against the rotary
dimension, per architecture) ends a run in one line through its abort callback
(:func:`expertcache.llama.ggml.abort_in_one_line`).
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field

from .._io import regular_size
from ..errors import ConfigError, is_int

TESTED = ("olmoe", "qwen2moe", "qwen3moe", "llama", "deepseek2", "gpt-oss", "glm4moe")
"""``general.architecture`` values the test suite runs (``llama`` covers Mixtral-class MoE)."""
READ = ("llama4", "deci", "grok", "qwen3next", "qwen3vlmoe", "qwen35moe", "phimoe", "minicpm", "gemma4", "jamba",
        "dbrx", "arctic", "deepseek", "deepseek2-ocr", "ernie4_5-moe", "glm-dsa", "nemotron_h_moe", "exaone-moe",
        "granitemoe", "granitehybrid", "bailingmoe", "bailingmoe2", "dots1", "afmoe", "hunyuan-moe", "lfm2moe",
        "smallthinker", "llada-moe", "minimax-m2", "rnd1", "mistral3", "mistral4", "mimo2", "step35", "kimi-linear")
"""Other architectures read as described in the module docstring (not run by the test suite).
Derived from gguf 0.19's ``MODEL_TENSORS`` (archs with ``FFN_{GATE,UP,DOWN,GATE_UP}_EXP``) less
embedding-only models (``nomic-bert-moe``, ``llama-embed``) and ``grovemoe`` (chunked experts
``*_chexps`` whose count is not E), each checked to reach ``build_moe_ffn`` in the llama.cpp
vendored by llama-cpp-python 0.3.36."""
NEWER = ("deepseek32", "deepseek4", "kimi-k3", "minimax-m3", "glm5-next", "hy_v3", "hy_v4", "laguna", "dots3note",
         "bailingmoe3", "cohere2moe", "qwen4exp", "mellum")
"""Architectures of the pinned llama.cpp (names in its architecture table) that the ``gguf``
package's tables do not know yet, read as :data:`READ`'s are (not run by the test suite): DeepSeek-V3.2
with its sparse attention (``deepseek32``), DeepSeek-V4, Kimi K3, MiniMax-M3, GLM-5's next,
Hunyuan V3 and V4, Laguna, dots3, Ling 3, Cohere's MoE, Qwen4-Exp, Mellum. Audited from llama.cpp's
graph sources (``src/models/<arch>.cpp``): routed experts in ``*_exps`` tensors with E slowest
(Kimi K3's first dimension is a latent width, not the embedding), every layer that holds them
routed through ``build_moe_ffn``; DeepSeek-V4's hash-routed layers too: the experts its table gives
a token are passed in as the selection, and ``ffn_moe_topk`` holds them. Their MTP blocks are the
``nextn_predict_layers`` ones, skipped as GLM-4.5's are."""
LIMITS = {"tensors": 1 << 20, "keys": 1 << 16, "string": 1 << 20, "array": 1 << 24, "dims": 4, "nesting": 4}
"""Most tensors, metadata keys, bytes in one string, items in one array, dimensions per tensor,
arrays within arrays."""
# GGUF metadata value types: id -> struct format (None: string 8, array 9)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf(where: str):
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"{where}: reading a GGUF needs the gguf package (pip install 'expertcache[gguf]')") from None
    return gguf


def type_sizes(where: str = "GGUF") -> dict[int, tuple[int, int, str]]:
    """ggml type id -> (block size in elements, bytes per block, lower-case name), from the ``gguf``
    package's ``GGML_QUANT_SIZES`` (the one table; nothing here is written by hand)."""
    gguf = _gguf(where)
    return {int(t): (int(b), int(s), t.name.lower()) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, ggml dims (``ne[0]`` fastest), ggml type, absolute byte offset,
    size, and the type's name."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int
    type_name: str = ""


@dataclass
class Geometry:
    """What expertcache needs of a GGUF MoE: see the module docstring for the byte-range invariant."""

    path: str
    file_bytes: int
    architecture: str
    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: list[int]
    experts: dict[int, dict[str, TensorInfo]]
    """MoE layer -> expert tensor kind (``ffn_gate_exps.weight``, ...) -> tensor, in file order."""
    tensors: dict[str, TensorInfo] = field(repr=False)
    metadata: dict = field(repr=False)
    skipped_layers: list[int] = field(default_factory=list)

    def expert_bytes_of(self, layer: int) -> int:
        """Bytes of one expert of MoE layer ``layer``: its slice of every expert tensor of the layer."""
        return sum(t.nbytes // self.num_experts for t in self.experts[layer].values())

    @property
    def layer_expert_bytes(self) -> list[int]:
        """:meth:`expert_bytes_of` per MoE layer, in ``moe_layers`` order."""
        return [self.expert_bytes_of(layer) for layer in self.moe_layers]

    @property
    def uniform_expert_bytes(self) -> int | None:
        """The bytes of one expert when every MoE layer agrees, else None (see :attr:`layer_expert_bytes`)."""
        sizes = set(self.layer_expert_bytes)
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def expert_tensor_bytes(self) -> int:
        """Bytes of all expert tensors of all MoE layers (sum over layers of E x expert_bytes_of)."""
        return sum(t.nbytes for parts in self.experts.values() for t in parts.values())

    @property
    def context_length(self) -> int | None:
        """The positions the model was trained for (``<arch>.context_length``), or None where the file
        does not say (or says it per layer)."""
        n = self.metadata.get(f"{self.architecture}.context_length")
        return n if is_int(n, 1) else None

    @property
    def skipped_bytes(self) -> int:
        """Bytes of the tensors of layers llama.cpp's main graph never runs (``skipped_layers``)."""
        skip = {f"blk.{i}." for i in self.skipped_layers}
        return sum(t.nbytes for t in self.tensors.values() if t.name.startswith(tuple(skip))) if skip else 0

    @property
    def dense_bytes(self) -> int:
        """Every byte of the file that is neither an expert tensor nor skipped: header, attention,
        embeddings, norms, routers, shared experts, dense FFNs (read on every forward)."""
        return self.file_bytes - self.expert_tensor_bytes - self.skipped_bytes

    @property
    def dense_tensors(self) -> list[TensorInfo]:
        """The tensors counted in :attr:`dense_bytes` (the header aside), in file order."""
        expert = {t.name for parts in self.experts.values() for t in parts.values()}
        skip = tuple(f"blk.{i}." for i in self.skipped_layers)
        return sorted((t for t in self.tensors.values() if t.name not in expert and not (skip and t.name.startswith(skip))),
                      key=lambda t: t.offset)

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        """File ``(offset, length)`` of expert ``expert`` of MoE layer ``layer``: one per expert tensor."""
        E = self.num_experts
        return [(t.offset + expert * (t.nbytes // E), t.nbytes // E) for t in self.experts[layer].values()]

    def compute_ranges(self, layer: int, experts) -> list[tuple[int, int]]:
        """File ``(offset, length)`` of ``experts`` of MoE layer ``layer``, in the order llama.cpp's
        graph consumes them: tensor by tensor in :data:`COMPUTE_ORDER` (gate, up, then down; a
        bias after its weight), and within a tensor the experts by ascending id, as ggml's
        ``mul_mat_id`` walks them. Reads issued in this order let the first experts' matmuls start
        while the rest are read (file order puts ``down`` first in a quantized file)."""
        E, ids = self.num_experts, sorted({int(e) for e in experts})
        tensors = sorted(self.experts[layer].items(), key=lambda kv: compute_rank(kv[0]))
        return [(t.offset + e * (t.nbytes // E), t.nbytes // E) for _, t in tensors for e in ids]

    def layer_span(self, layer: int) -> list[tuple[int, int]]:
        """File ``(offset, length)`` of the whole expert tensors of ``layer``."""
        return [(t.offset, t.nbytes) for t in self.experts[layer].values()]

    @property
    def tested(self) -> bool:
        return self.architecture in TESTED

    def summary(self) -> dict:
        types = sorted({t.type_name for parts in self.experts.values() for t in parts.values()})
        per_layer = self.layer_expert_bytes
        return {"gguf": self.path, "architecture": self.architecture, "tested": self.tested,
                "file_bytes": self.file_bytes, "num_experts": self.num_experts, "top_k": self.top_k,
                "num_layers": self.num_layers, "moe_layers": len(self.moe_layers), "moe_layer_ids": list(self.moe_layers),
                "expert_bytes": self.uniform_expert_bytes, "expert_bytes_min": min(per_layer),
                "expert_bytes_max": max(per_layer), "layer_expert_bytes": per_layer,
                "expert_tensor_bytes": self.expert_tensor_bytes, "dense_bytes": self.dense_bytes,
                "skipped_bytes": self.skipped_bytes, "skipped_layers": list(self.skipped_layers),
                "expert_tensors": sorted({kind for parts in self.experts.values() for kind in parts}),
                "expert_types": types}


def tensor_nbytes(shape: tuple[int, ...], type_id: int, where: str, sizes: dict) -> int:
    if type_id not in sizes:
        raise ConfigError(f"{where}: ggml type {type_id} is not known to the gguf package "
                          f"(known: {', '.join(v[2] for v in sizes.values())})")
    block, size, _ = sizes[type_id]
    if shape[0] % block:
        raise ConfigError(f"{where}: first dimension {shape[0]} is not a multiple of the type's block {block}")
    n = size * (shape[0] // block)
    for d in shape[1:]:
        n *= d
    return n


class _Reader:
    """Sequential little-endian reads that refuse to run past the file's end or the limits."""

    def __init__(self, fh, size: int, where: str):
        self.fh, self.size, self.where = fh, size, where

    def take(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise ConfigError(f"{self.where}: truncated GGUF header (ends at byte {self.fh.tell()} of {self.size})")
        return data

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = self.scalar("Q")
        if n > LIMITS[what]:
            raise ConfigError(f"{self.where}: GGUF header claims {n} {what}, more than the {LIMITS[what]} allowed")
        return n

    def string(self) -> str:
        n = self.count("string")
        if self.fh.tell() + n > self.size:
            raise ConfigError(f"{self.where}: truncated GGUF header (a string runs past the end of the file)")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9:
            raise ConfigError(f"{self.where}: unknown GGUF metadata type {vtype}")
        if depth >= LIMITS["nesting"]:
            raise ConfigError(f"{self.where}: GGUF metadata nests arrays deeper than {LIMITS['nesting']}")
        itype, n = self.scalar("I"), self.count("array")
        if itype in _SCALARS and not keep:  # skip big arrays (token scores, types) without reading them
            skip = n * struct.calcsize(_SCALARS[itype])
            if self.fh.tell() + skip > self.size:
                raise ConfigError(f"{self.where}: truncated GGUF header (an array runs past the end of the file)")
            self.fh.seek(skip, os.SEEK_CUR)
            return n
        items = [self.value(itype, keep, depth + 1) for _ in range(n)]
        return items if keep else n


# arrays whose values are kept (small, per-layer settings); other arrays are kept as their length
_KEEP_ARRAYS = ("feed_forward_length", "head_count", "head_count_kv", "swa_layers")


def read_header(path: str, where: str = "--model") -> tuple[dict, dict[str, TensorInfo], int]:
    """``(metadata, tensors, file size)`` of a GGUF file; refusals as in the module docstring."""
    if not isinstance(path, (str, os.PathLike)):  # an int had been opened as a file descriptor (True: stdout)
        raise ConfigError(f"{where}: expected a file name, got {type(path).__name__}")
    where = f"{where} {path}"
    size = regular_size(path, where)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    with fh:
        r = _Reader(fh, size, where)
        if fh.read(4) != b"GGUF":
            raise ConfigError(f"{where}: not a GGUF file (no GGUF magic)")
        if size < 24:
            raise ConfigError(f"{where}: truncated GGUF file ({size} bytes: its header alone is 24)")
        version = r.scalar("I")
        if version not in (2, 3):
            raise ConfigError(f"{where}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_keys = r.count("tensors"), r.count("keys")
        meta: dict = {}
        for _ in range(n_keys):
            key = r.string()
            meta[key] = r.value(r.scalar("I"), keep=key.endswith(_KEEP_ARRAYS))
        infos, names = [], set()
        for _ in range(n_tensors):
            name, nd = r.string(), r.scalar("I")
            if not name or name in names:
                raise ConfigError(f"{where}: " + (f"tensor {name!r} appears twice" if name else "a tensor has no name"))
            names.add(name)
            if not 1 <= nd <= LIMITS["dims"]:
                raise ConfigError(f"{where}: tensor {name!r} has {nd} dimensions")
            shape = tuple(r.scalar("Q") for _ in range(nd))
            if 0 in shape:
                raise ConfigError(f"{where}: tensor {name!r} has a zero dimension ({list(shape)})")
            infos.append((name, shape, r.scalar("I"), r.scalar("Q")))
        align = meta.get("general.alignment", 32)
        if not is_int(align, 1) or align & (align - 1):
            raise ConfigError(f"{where}: general.alignment {align!r} is not a power of two")
        data_start = -(-fh.tell() // align) * align
    sizes = type_sizes(where)
    tensors = {}
    for name, shape, tid, off in infos:
        nbytes = tensor_nbytes(shape, tid, f"{where}: tensor {name!r}", sizes)
        if off % align:
            raise ConfigError(f"{where}: tensor {name!r} at data offset {off}, not a multiple of the alignment {align}")
        t = TensorInfo(name, shape, tid, data_start + off, nbytes, sizes[tid][2])
        if t.offset + nbytes > size:
            raise ConfigError(f"{where}: truncated file: tensor {name!r} ends at byte {t.offset + nbytes}, "
                              f"the file has {size}")
        tensors[name] = t
    end, last = 0, None
    for t in sorted(tensors.values(), key=lambda t: t.offset):  # llama.cpp's tensors never share bytes
        if t.offset < end:
            raise ConfigError(f"{where}: tensor {t.name!r} at byte {t.offset} overlaps {last!r}, which ends at {end}")
        end, last = t.offset + t.nbytes, t.name
    return meta, tensors, size


def _positive_int(value) -> bool:
    return is_int(value, 1)


HPARAM_INTS = ("context_length", "embedding_length", "feed_forward_length", "expert_feed_forward_length",
               "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length")
"""``<arch>.`` keys llama.cpp sizes the graph with: where present, each a positive integer, or a
per-layer array of non-negative ones not all 0 (hybrid models mark layers without attention or FFN
with 0); ``feed_forward_length`` may be 0 (every FFN routed). llama.cpp asserts on some of these
when it builds the graph, which ends the process (an abort, not an error); a file with an
out-of-range one is refused here first."""

HPARAM_FLOATS = {"rope.freq_base": 0.0, "attention.layer_norm_rms_epsilon": None, "attention.layer_norm_epsilon": None}
"""``<arch>.`` floats with a floor: above the value given, or at least 0 where it is None. A rope base
of 0 or below makes every rotation angle infinite, so the logits are NaN and greedy decoding stops
at once with no text and no error; a negative norm epsilon trips an assert in ggml's CPU ops."""


def check_hparams(meta: dict, arch: str, label: str) -> None:
    """Refuse a ``<arch>.`` float that is not finite (NaN, inf: llama.cpp would compute garbage, or
    nothing, without an error) and a :data:`HPARAM_INTS` or :data:`HPARAM_FLOATS` value out of range,
    in one line."""
    prefix = f"{arch}."
    for key, value in meta.items():
        if key.startswith(prefix) and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{label}: {key} is {value}, not a finite number")
    for name in HPARAM_INTS:
        value = meta.get(prefix + name)
        if value is None or _positive_int(value):
            continue
        if name == "feed_forward_length" and value == 0 and not isinstance(value, bool):
            continue  # every FFN routed
        if isinstance(value, list) and value and any(value) and all(
                is_int(v, 0) for v in value):
            continue  # per layer; 0 where a hybrid model's layer has no attention or FFN
        raise ConfigError(f"{label}: {prefix}{name} {str(value)[:80]} is not a positive integer")
    for name, floor in HPARAM_FLOATS.items():
        value = meta.get(prefix + name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                value < 0 if floor is None else value <= floor):
            bound = "at least 0" if floor is None else f"above {floor:g}"
            raise ConfigError(f"{label}: {prefix}{name} is {value}, not {bound}")


def chat_template_problem(template) -> str | None:
    """Why a chat template (a string, or transformers' list of ``{name, template}``) does not compile
    as llama-cpp-python compiles it when it loads a model, or None; None too where jinja2 is not
    installed (then nothing here compiles it). Compiled by llama-cpp-python's own formatter where it
    is installed (imported here, on demand: the core runs without it), else by the environment it
    and transformers use: jinja2's sandbox with loop controls (``{% break %}``) and transformers'
    ``{% generation %}`` blocks, which render their inside (:func:`_generation_extension`)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    texts = [template] if isinstance(template, str) else [t.get("template") for t in template]
    try:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        def compile_(text):
            Jinja2ChatFormatter(template=text, eos_token="", bos_token="")
    except ImportError:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_extension(), jinja2.ext.loopcontrols])
        compile_ = env.parse
    for text in texts:
        try:
            compile_(text)
        except (jinja2.TemplateError, TypeError) as exc:
            return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def _generation_extension():
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's tokens for
    training): the inside rendered as it is."""
    from jinja2.ext import Extension

    class _Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return _Generation


COMPUTE_ORDER = ("gate_up", "gate", "up", "down")
"""The expert matmuls of one MoE layer in llama.cpp's graph order (``ffn_moe_gate``, ``ffn_moe_up``,
``ffn_moe_down``; a fused ``gate_up`` first)."""


def compute_rank(kind: str) -> tuple[int, int]:
    """Sort key of an expert tensor kind (``ffn_gate_exps.weight``) in :data:`COMPUTE_ORDER`; an
    unknown kind last, a bias after its weight."""
    stem = kind.split(".")[0].removeprefix("ffn_").removesuffix("_exps")
    return (COMPUTE_ORDER.index(stem) if stem in COMPUTE_ORDER else len(COMPUTE_ORDER), kind.endswith(".bias"))


def _layer_and_kind(name: str) -> tuple[int, str] | None:
    """``(N, "kind.suffix")`` of an expert-kind tensor ``blk.N.<kind>_exps.<suffix>``, else None."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2].endswith("_exps"):
        return int(parts[1]), ".".join(parts[2:])
    return None


def read_geometry(path: str, where: str = "--model") -> Geometry:
    """The :class:`Geometry` of the GGUF MoE at ``path`` (refusals in the module docstring)."""
    meta, tensors, size = read_header(path, where)
    label = f"{where} {path}"
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{label}: no general.architecture in the GGUF metadata")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}", arch):
        raise ConfigError(f"{label}: general.architecture {arch[:80]!r} is not an architecture name")
    check_hparams(meta, arch, label)
    n_layers = meta.get(f"{arch}.block_count")
    E, k = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    if not _positive_int(n_layers):
        raise ConfigError(f"{label}: {arch}.block_count {n_layers!r} is not a positive integer")
    blocks = [int(p[1]) for p in (name.split(".", 2) for name in tensors) if p[0] == "blk" and len(p) == 3
              and p[1].isdigit()]
    if blocks and max(blocks) + 1 != n_layers:  # llama.cpp loads every block's tensors, and no others
        raise ConfigError(f"{label}: {arch}.block_count {n_layers} but the file has tensors of blocks 0..{max(blocks)}")
    nextn = meta.get(f"{arch}.nextn_predict_layers", 0)
    nextn = nextn if is_int(nextn) and 0 <= nextn < n_layers else 0
    skipped = list(range(n_layers - nextn, n_layers))
    experts: dict[int, dict[str, TensorInfo]] = {}
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].offset):
        lk = _layer_and_kind(name)
        if lk is None or lk[0] in skipped:
            continue
        if len(t.shape) == 1 and lk[1].startswith("ffn_norm_exps"):
            continue  # a norm shared by the layer's experts: dense
        experts.setdefault(lk[0], {})[lk[1]] = t
    if not experts:
        raise ConfigError(f"{label}: not a mixture-of-experts GGUF (no expert tensors blk.N.ffn_*_exps)")
    if E is None:
        raise ConfigError(f"{label}: not a mixture-of-experts GGUF (no {arch}.expert_count)")
    if not _positive_int(E) or E < 2:
        raise ConfigError(f"{label}: {arch}.expert_count {E!r} is not an integer of at least 2")
    if not _positive_int(k):
        raise ConfigError(f"{label}: {arch}.expert_used_count {k!r} is not a positive integer")
    if arch not in TESTED and arch not in READ and arch not in NEWER:
        raise ConfigError(f"{label}: architecture {arch!r} is not read by expertcache (tested: {', '.join(TESTED)}; "
                          f"also read: {', '.join(READ + NEWER)})")
    if k > E:
        raise ConfigError(f"{label}: expert_used_count {k} exceeds expert_count {E}")
    for layer, parts in sorted(experts.items()):
        if layer >= n_layers:
            raise ConfigError(f"{label}: {arch}.block_count {n_layers} disagrees with expert tensors of layer {layer}")
        for t in parts.values():
            if t.shape[-1] != E or t.nbytes % E:
                raise ConfigError(f"{label}: {t.name} has shape {list(t.shape)}: its slowest dimension is not the "
                                  f"{E} experts")
        if not any(kind.startswith(("ffn_down_exps.", "ffn_gate_up_exps.", "ffn_up_exps.")) for kind in parts):
            raise ConfigError(f"{label}: layer {layer} has expert tensors but no ffn_up/down/gate_up_exps weight")
        gate, up = parts.get("ffn_gate_exps.weight"), parts.get("ffn_up_exps.weight")
        if gate is not None and up is not None and gate.shape != up.shape:  # llama.cpp refuses such a file
            raise ConfigError(f"{label}: {up.name} {list(up.shape)} does not match {gate.name} {list(gate.shape)}")
    return Geometry(os.fspath(path), size, arch, E, k, n_layers, sorted(experts), experts, tensors, meta, skipped)
