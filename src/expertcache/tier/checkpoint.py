"""Real expert bytes from a transformers checkpoint's ``*.safetensors`` files (``tier write --from-safetensors``).

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON header (tensor name
-> dtype, shape, data_offsets relative to the data section), then the raw tensor bytes. The header is
parsed here (bounded to 100 MB) and tensors are read as raw bytes, whatever their dtype (bf16
included), so no tensor library is needed and the pool holds exactly the checkpoint's bytes.

Expert tensors are recognised in two shapes:

* per expert: ``...layers.{l}.<block>.experts.{e}.<name>`` (e.g. OLMoE, Mixtral, Qwen-MoE);
* packed: ``...layers.{l}.<block>.experts.<name>`` whose first dimension is the expert count
  (e.g. ``gate_up_proj`` of shape ``[E, ...]``); expert e's bytes are the e-th slice.

An expert's entry is the concatenation of its tensors in name order. Invariant: every layer must
hold the same expert ids 0..E-1, else the checkpoint is refused with one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError
from ..formats.safetensors import checkpoint_files, read_headers

_PER_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\..*?experts\.(\d+)\.(.+)$")
_PACKED = re.compile(r"(?:^|\.)layers\.(\d+)\..*?experts\.([A-Za-z_][\w.]*)$")


def expert_tensors(model_dir: str | Path) -> tuple[list[int], int, dict, str]:
    """Index a checkpoint folder: (layer ids, num_experts, {(layer, expert): [(file, offset, size)]}, dtype)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir) if model_dir.is_dir() else []
    if not files:
        raise ConfigError(f"--from-safetensors {model_dir}: no *.safetensors files in this folder")
    parts: dict[tuple[int, int], list] = {}
    dtypes = set()
    for path, header, start in read_headers(files):
        for name in sorted(header):
            info = header[name]
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            m = _PER_EXPERT.search(name)
            if m:
                key = (int(m.group(1)), int(m.group(2)))
                parts.setdefault(key, []).append((m.group(3), str(path), start + a, b - a))
                dtypes.add(info.get("dtype"))
                continue
            m = _PACKED.search(name)
            shape = info.get("shape") or []
            if m and len(shape) >= 2 and shape[0] > 0 and (b - a) % shape[0] == 0:
                step = (b - a) // shape[0]
                for e in range(shape[0]):
                    parts.setdefault((int(m.group(1)), e), []).append((m.group(2), str(path), start + a + e * step, step))
                dtypes.add(info.get("dtype"))
    if not parts:
        raise ConfigError(f"--from-safetensors {model_dir}: no expert tensors found (looked for "
                          "'layers.N....experts.E.NAME' and packed 'layers.N....experts.NAME' with an expert dimension)")
    layers = sorted({lay for lay, _ in parts})
    num_experts = 1 + max(e for _, e in parts)
    for lay in layers:
        for e in range(num_experts):
            if (lay, e) not in parts:
                raise ConfigError(f"--from-safetensors {model_dir}: layer {lay} has no tensors for expert {e}")
    index = {key: [(f, o, s) for _, f, o, s in sorted(v)] for key, v in parts.items()}
    return layers, num_experts, index, "+".join(sorted(d for d in dtypes if d)) or "unknown"


def expert_reader(index: dict, layers: list[int]):
    """``source(layer_index, expert) -> bytes`` reading the expert's tensors in name order."""
    handles: dict[str, object] = {}

    def source(li: int, e: int) -> bytes:
        chunks = []
        for path, offset, size in index[(layers[li], e)]:
            fh = handles.get(path)
            if fh is None:
                fh = handles[path] = open(path, "rb")
            fh.seek(offset)
            data = fh.read(size)
            if len(data) != size:
                raise ConfigError(f"{path}: truncated inside tensor data at byte {offset}")
            chunks.append(data)
        return b"".join(chunks)

    def close() -> None:
        for fh in handles.values():
            fh.close()

    source.close = close  # type: ignore[attr-defined]
    return source
