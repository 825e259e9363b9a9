"""A ctypes mirror of ``struct ggml_tensor`` (ggml.h of the llama.cpp that llama-cpp-python 0.3.36
vendors), with its layout asserted against the loaded library before any callback reads a tensor.

The bindings expose the scheduler's eval callback (``cb_eval``) but no tensor accessor, so the
callback reads the tensor through this mirror. :func:`check_layout` is the guard: the library's
``ggml_tensor_overhead()`` minus ``sizeof(struct ggml_object)`` must equal the mirror's size, and
``ggml_get_name``, ``ggml_get_data`` and ``ggml_nelements`` called on a mirror instance must return
the mirror's own ``name`` and ``data`` addresses and the product of its ``ne``. Any difference (a
bindings version whose struct differs) is refused in one line before a model is loaded.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

import numpy as np

from .._io import remove_pending
from ..errors import ConfigError

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_OBJECT_SIZE = 32
"""sizeof(struct ggml_object): offs, size, next (8 bytes each), type (4) and 4 bytes of padding."""
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26


class GGMLTensor(ctypes.Structure):
    """``struct ggml_tensor`` field for field (ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GGMLTensor.name.offset
_checked: str | None = None


def _libggml_base():
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError("llama.cpp bindings are not installed (pip install 'expertcache[llama]')") from None
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    # the wheel holds copies, not links (libggml-base.so, .so.0, .so.0.25.3): opening another copy than
    # the one libllama loaded would give a second instance of ggml, whose abort callback nobody calls
    for path in [_mapped("libggml-base")] + [os.path.join(libdir, name) for name in (
            "libggml-base.so.0", "libggml-base.so", "libggml-base.dylib", "ggml-base.dll")]:
        if path and os.path.exists(path):
            return ctypes.CDLL(path), llama_cpp.__version__
    raise ConfigError(f"llama-cpp-python {llama_cpp.__version__}: no ggml-base library under {libdir}")


def _mapped(stem: str) -> str | None:
    """The path of the loaded library whose file name starts with ``stem`` (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith(stem + ".") and path.startswith("/"):
                    return path
    except OSError:
        pass
    return None


def check_layout() -> str:
    """Assert the mirror against the library (see the module docstring); returns the bindings' version."""
    global _checked
    if _checked is not None:
        return _checked
    lib, version = _libggml_base()
    where = f"llama-cpp-python {version}: struct ggml_tensor"
    try:
        lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        for fn in (lib.ggml_get_name, lib.ggml_get_data):
            fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        lib.ggml_nelements.restype, lib.ggml_nelements.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    except AttributeError as exc:
        raise ConfigError(f"{where}: the library lacks {exc}; this bindings version is not supported") from None
    size = lib.ggml_tensor_overhead() - GGML_OBJECT_SIZE
    if size != ctypes.sizeof(GGMLTensor):
        raise ConfigError(f"{where} is {size} bytes, the mirror {ctypes.sizeof(GGMLTensor)}: this bindings version "
                          "has another layout (supported: 0.3.36)")
    probe = GGMLTensor()
    probe.ne[:] = (3, 5, 7, 2)
    probe.data = ctypes.addressof(probe)
    base = ctypes.addressof(probe)
    if lib.ggml_get_name(base) != base + NAME_OFFSET or lib.ggml_get_data(base) != probe.data \
            or lib.ggml_nelements(base) != 210:
        raise ConfigError(f"{where}: the offsets of name/data/ne differ from the mirror; this bindings version is "
                          "not supported (supported: 0.3.36)")
    _checked = version
    return version


_abort_model: str | None = None
_abort_sink = None
_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


def abort_in_one_line(model: str | None) -> None:
    """ggml stops on a failed ``GGML_ASSERT`` or ``GGML_ABORT`` by printing the message and a backtrace
    (through gdb where one is installed) and calling ``abort()``: a core dump, where a file breaks one
    of llama.cpp's own checks that the header checks do not make (an OLMoE ``rope.dimension_count``
    other than its head size, a negative ``layer_norm_rms_epsilon``). From the first call on, ggml's
    abort callback instead prints one line on stderr, ``expertcache: error: MODEL <model>: llama.cpp
    stopped on it (<file:line: message>)``, flushes stdout, removes the temporaries of the outputs
    being written (:func:`expertcache._io.remove_pending`), and ends the process with exit status 2,
    from whichever thread tripped the check; later calls only change the model named."""
    global _abort_model, _abort_sink
    _abort_model = model
    if _abort_sink is not None:
        return
    lib, _ = _libggml_base()

    def stop(message: bytes | None) -> None:
        text = re.sub(r"^\S*/", "", (message or b"").decode("utf-8", "replace").strip()).splitlines() or ["no message"]
        try:
            sys.stdout.flush()
        except Exception:  # a closed or broken stdout: the line below is what matters
            pass
        where = f"MODEL {_abort_model}: " if _abort_model else ""
        os.write(2, f"expertcache: error: {where}llama.cpp stopped on it ({text[0][:400]})\n".encode())
        remove_pending()  # os._exit runs no finally: the outputs half written go here
        os._exit(2)

    sink = _ABORT_CALLBACK(stop)
    lib.ggml_set_abort_callback.restype = ctypes.c_void_p
    lib.ggml_set_abort_callback.argtypes = [_ABORT_CALLBACK]
    lib.ggml_set_abort_callback(sink)
    _abort_sink = sink  # kept: ggml holds the pointer for the life of the process


def tensor_name(ptr: int) -> bytes:
    """The tensor's name (bytes up to the first NUL) without building the whole struct."""
    return ctypes.string_at(ptr + NAME_OFFSET)


_TYPE, _NE, _NB, _DATA = GGMLTensor.type.offset, GGMLTensor.ne.offset, GGMLTensor.nb.offset, GGMLTensor.data.offset


def read_ids(ptr: int) -> np.ndarray:
    """The distinct ids of an int32 tensor's first two dimensions, sorted (``np.unique`` of
    :func:`read_2d`): a layer's routed experts. One row with contiguous ids (a decode step's
    ``ffn_moe_topk``) is read straight from the header's fields, without building the struct (the
    managed step runs this once a layer, a token); anything else goes through :func:`read_2d`."""
    ne0, ne1, ne2, ne3 = np.frombuffer(ctypes.string_at(ptr + _NE, 32), dtype=np.int64)
    if ctypes.c_int.from_address(ptr + _TYPE).value == GGML_TYPE_I32 and ne1 * ne2 * ne3 == 1 \
            and ctypes.c_size_t.from_address(ptr + _NB).value == 4:
        data = ctypes.c_void_p.from_address(ptr + _DATA).value
        return np.unique(np.frombuffer(ctypes.string_at(data, 4 * int(ne0)), dtype=np.int32))
    return np.unique(read_2d(ptr, np.int32))


def read_2d(ptr: int, dtype, drop_leading_one: bool = False) -> np.ndarray:
    """A copy of the tensor's first two dimensions as ``[ne1, ne0]`` (rows of ``ne0``), following
    its byte strides ``nb`` (views such as ``ffn_moe_topk`` are strided). ``drop_leading_one``: a
    ``[1, a, b]`` tensor (ggml order, e.g. gate weights ``[1, k, n_tokens]``) reads as ``[b, a]``."""
    t = GGMLTensor.from_address(ptr)
    want = GGML_TYPE_I32 if np.dtype(dtype) == np.int32 else GGML_TYPE_F32
    if t.type != want:
        raise ConfigError(f"tensor {t.name.decode(errors='replace')}: ggml type {t.type}, expected {want}")
    ne0, ne1 = int(t.ne[0]), int(t.ne[1]) * int(t.ne[2]) * int(t.ne[3])
    nb0, nb1 = int(t.nb[0]), int(t.nb[1])
    if drop_leading_one and int(t.ne[0]) == 1:  # [1, k, n] weights: collapse to [n, k]
        ne0, ne1, nb0, nb1 = int(t.ne[1]), int(t.ne[2]) * int(t.ne[3]), int(t.nb[1]), int(t.nb[2])
    itemsize = np.dtype(dtype).itemsize
    span = (ne1 - 1) * nb1 + (ne0 - 1) * nb0 + itemsize if ne0 and ne1 else 0
    raw = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype=np.uint8) if span else np.zeros(0, np.uint8)
    view = np.lib.stride_tricks.as_strided(raw.view(np.uint8), shape=(ne1, ne0, itemsize), strides=(nb1, nb0, 1))
    return np.array(view, copy=True).view(dtype).reshape(ne1, ne0)  # a copy: the buffer is reused
