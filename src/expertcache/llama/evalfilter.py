"""The eval callback's first answer in compiled code: which graph tensors reach Python at all.

llama.cpp's scheduler asks the eval callback about every node of every graph (``ask`` true) and,
for the nodes it said yes to, calls it again once they are computed. A ``ctypes`` callback is a
Python call each time: about 500 a decode token at OLMoE's geometry, of which the observers want a
handful (a layer's ``ffn_moe_topk``, gate weights, ``ffn_inp``, ``ffn_moe_out``). :func:`compiled`
returns a numba ``cfunc`` that compares the tensor's name with the observers' name prefixes in
machine code and calls the Python callback only where one matches; every other node is answered
"not wanted" (ask) or "go on" without entering Python.

The prefixes and the Python callback's address travel in the callback's ``user_data``: a buffer
(:class:`Table`) of the callback's address (8 bytes), the number of prefixes (8 bytes) and each
prefix in a 32-byte slot (its length, then its bytes). Invariant: for every tensor the compiled
filter answers exactly as the Python callback would, because it hands every name that starts with
one of the prefixes to it and the Python callback answers "not wanted" for any name none of its
observers wants (``tests/test_llama.py`` checks captures and advice through both). Where numba
is absent (``expertcache._jit.AVAILABLE`` false) or cannot compile it, :func:`compiled` is None
and the Python callback is installed directly.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .._jit import AVAILABLE
from .ggml import GGML_MAX_NAME, NAME_OFFSET

SLOT = 32
"""Bytes of one prefix in the table: its length, then up to 31 bytes of it."""
MAX_PREFIXES = 16


class Table:
    """The ``user_data`` buffer of the compiled filter (see the module docstring)."""

    def __init__(self, callback_address: int, prefixes: list[bytes]):
        if len(prefixes) > MAX_PREFIXES or any(len(p) >= SLOT for p in prefixes):
            raise ValueError("eval filter: at most 16 prefixes of at most 31 bytes (an empty one matches every name)")
        self.buf = (ctypes.c_uint8 * (16 + SLOT * MAX_PREFIXES))()
        ctypes.c_uint64.from_buffer(self.buf, 0).value = callback_address
        ctypes.c_uint64.from_buffer(self.buf, 8).value = len(prefixes)
        for i, p in enumerate(prefixes):
            base = 16 + SLOT * i
            self.buf[base] = len(p)
            for j, b in enumerate(p):
                self.buf[base + 1 + j] = b

    @property
    def address(self) -> int:
        return ctypes.addressof(self.buf)


@functools.cache
def compiled():
    """The compiled filter's C address, or None where numba cannot provide it."""
    if not AVAILABLE:
        return None
    try:
        return _build()
    except Exception:  # noqa: BLE001 - any numba/llvmlite failure: the Python callback serves alone
        return None


_NAME_END = NAME_OFFSET + GGML_MAX_NAME
_TABLE_LEN = 16 + SLOT * MAX_PREFIXES


if AVAILABLE:  # numba is imported by _jit already where it is available
    from llvmlite import ir
    from numba import carray, types
    from numba.extending import intrinsic

    @intrinsic
    def call_python(typingctx, address, tensor, ask, user):
        """Call the C function at ``address`` as ``bool f(void *, bool, void *)``."""
        sig = types.boolean(types.uint64, types.voidptr, types.boolean, types.voidptr)

        def codegen(context, builder, signature, args):
            addr, t, a, u = args
            i8 = ir.IntType(8)
            fnty = ir.FunctionType(i8, [i8.as_pointer(), i8, i8.as_pointer()])  # C's bool: a byte, 0 or 1
            fn = builder.inttoptr(addr, fnty.as_pointer())
            ret = builder.call(fn, [t, builder.zext(a, i8), u])
            return builder.icmp_unsigned("!=", ret, ir.Constant(i8, 0))

        return sig, codegen


def _filter(tensor, ask, user):
    """The filter, compiled by :func:`_build` as a ``cfunc``. A function of the module, not a
    closure: numba's on-disk cache keys a closure by its captured objects, which differed in every
    process, so each process compiled it again (0.38 s, against 0.12 s loaded from the cache) and
    added an entry to the cache (583 in one ``__pycache__``, 18 MB); this one is compiled once."""
    table = carray(user, (_TABLE_LEN,), dtype=np.uint8)
    address = np.uint64(0)
    for i in range(8):
        address |= np.uint64(table[i]) << np.uint64(8 * i)
    n = 0
    for i in range(8):
        n |= int(table[8 + i]) << (8 * i)
    raw = carray(tensor, (_NAME_END,), dtype=np.uint8)
    for k in range(n):
        base = 16 + SLOT * k
        length = int(table[base])
        match = True
        for j in range(length):
            if raw[NAME_OFFSET + j] != table[base + 1 + j]:
                match = False
                break
        if match:
            return call_python(address, tensor, ask, user)
    return not ask


def _build() -> int:
    from numba import cfunc

    return cfunc(types.boolean(types.voidptr, types.boolean, types.voidptr), cache=True)(_filter).address
