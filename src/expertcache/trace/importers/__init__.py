"""Importers: routing logs from other engines into the canonical :class:`~expertcache.trace.Trace`.

=============  ==================================================  ===========================
format         input                                               module
=============  ==================================================  ===========================
vllm-jsonl     JSONL, one record per (sequence, token, layer)      :mod:`.vllm`
token-jsonl    JSONL, one record per (sequence, token)             :mod:`.per_token`
engine-jsonl   JSONL, one record per (iteration, layer) event      :mod:`.engine` (:mod:`.engine_passes`)
sglang         SGLang's per-token expert-distribution dump (.pt)   :mod:`.sglang` (:mod:`.torchzip`)
sglang-r3      JSONL of SGLang responses with routed experts       :mod:`.r3` (:mod:`.r3_wire`)
vllm-r3        JSONL of vLLM responses with routed experts         :mod:`.r3` (:mod:`.r3_wire`)
=============  ==================================================  ===========================

JSONL input may be gzip- or zstd-compressed (found by magic bytes, streamed: :mod:`.records`);
each format registers itself by name (:mod:`.registry`); ``auto`` tells the shapes apart
(:mod:`.detect`). Every user error is a one-line :class:`~expertcache.errors.TraceError` or
:class:`~expertcache.errors.ConfigError` naming the file and line (or record) and the field.
Nothing here unpickles or imports torch.
"""

from .detect import DEFAULT_PHASE, FORMATS, detect_format, import_chunked, import_trace, shapes
from .engine import EngineFields, import_engine_jsonl
from .engine_passes import PASS_KINDS, EngineRecord, TypedPass, TypedPasses, pass_arrays, type_passes
from .per_token import TokenFields, import_token_jsonl
from .r3 import import_r3
from .r3_wire import R3_FORMATS, decode_payload
from .records import MAX_LINE_BYTES
from .sglang import SEQUENCE_MODES, import_sglang
from .torchzip import read_torch_save
from .values import MAX_EXPERTS
from .vllm import JsonlFields, import_vllm_jsonl

__all__ = [
    "DEFAULT_PHASE",
    "FORMATS",
    "MAX_EXPERTS",
    "MAX_LINE_BYTES",
    "PASS_KINDS",
    "R3_FORMATS",
    "SEQUENCE_MODES",
    "EngineFields",
    "EngineRecord",
    "JsonlFields",
    "TokenFields",
    "TypedPass",
    "TypedPasses",
    "decode_payload",
    "detect_format",
    "import_chunked",
    "import_engine_jsonl",
    "import_r3",
    "import_sglang",
    "import_token_jsonl",
    "import_trace",
    "import_vllm_jsonl",
    "pass_arrays",
    "read_torch_save",
    "shapes",
    "type_passes",
]
