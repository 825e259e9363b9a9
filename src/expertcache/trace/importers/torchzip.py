"""Read a ``torch.save`` file without unpickling it and without torch.

A ``torch.save`` file is a zip archive holding ``<root>/data.pkl`` (the object graph, a pickle)
and one raw member ``<root>/data/<key>`` per tensor storage. :func:`read_torch_save` walks the
pickle's opcodes with :func:`pickletools.genops` and interprets only those torch's writer emits,
building containers, scalars and numpy arrays. Nothing is imported or called by name: the only
globals accepted are ``torch._utils._rebuild_tensor_v2``, ``torch.<Dtype>Storage`` and
``collections.OrderedDict``, each replaced by a fixed local meaning.

Invariants: every other opcode or global is a one-line TraceError; a storage is read once, only
after its member's size equals the element count its reference declares, and only when stored
uncompressed (so the storages' memory is bounded by the file's real size); a tensor is a read-only
view of its storage in native byte order, never a copy; its shape, strides and offset must address
elements inside its storage, and it may not hold more elements than its storage. Views of one
storage cost nothing to read but describe data a consumer will copy, so the elements all tensors
claim, in bytes, may not pass the trace limit (:func:`~expertcache.trace.npz.max_bytes`).
"""

from __future__ import annotations

import math
import os
import pickletools
import zipfile
from typing import Any

import numpy as np

from ...errors import TraceError, is_int
from ..npz import max_bytes
from .records import open_regular
from .values import short

_STORAGES = {
    "DoubleStorage": "f8", "FloatStorage": "f4", "HalfStorage": "f2", "BFloat16Storage": "bf16",
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?",
}
_PUSH_ARG = {"BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_FILL = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "BUILD"}
"""Opcodes that fill a list or dict already on the stack (:meth:`_Machine._fill`)."""


class _Global:
    """An allowed global: ``kind`` is 'tensor', 'ordereddict' or 'storage' (with a dtype code)."""

    def __init__(self, kind: str, code: str = ""):
        self.kind, self.code = kind, code


class _Storage:
    def __init__(self, code: str, key: str, numel: int):
        self.code, self.key, self.numel = code, key, numel


def read_torch_save(path: str | os.PathLike) -> Any:
    """The object a ``torch.save`` file holds, with tensors as numpy arrays."""
    src = str(path)
    with open_regular(path) as fh:
        try:
            zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
            raise TraceError(f"{src}: not a torch.save zip archive ({short(str(exc), 120)})") from None
        size = os.fstat(fh.fileno()).st_size
        for info in zf.infolist():  # torch.save stores every member uncompressed: reads stay within the file
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size or info.compress_size > size:
                raise TraceError(f"{src}: member {short(info.filename)} is not stored as torch.save stores members "
                                 f"(uncompressed, at most the archive's {size:,} bytes)")
        try:
            with zf:
                return _read_archive(src, zf)
        except TraceError:
            raise
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
            raise TraceError(f"{src}: unreadable archive member ({short(str(exc), 120)})") from None


def _read_archive(src: str, zf: zipfile.ZipFile) -> Any:
    pkls = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkls) != 1:
        raise TraceError(f"{src}: not a torch.save archive ({'no' if not pkls else 'more than one'} data.pkl member)")
    root = pkls[0][: -len("data.pkl")]
    order = "<"
    if root + "byteorder" in zf.namelist():
        text = zf.read(root + "byteorder")
        if text not in (b"little", b"big"):
            raise TraceError(f"{src}: byteorder: {short(text)} is neither 'little' nor 'big'")
        order = "<" if text == b"little" else ">"
    with zf.open(pkls[0]) as pkl:
        return _Machine(src, zf, root, order).run(pkl)


class _Machine:
    """The restricted pickle interpreter: a stack, a mark stack and a memo."""

    def __init__(self, src: str, zf: zipfile.ZipFile, root: str, order: str):
        self.src, self.zf, self.root, self.order = src, zf, root, order
        self.storages: dict[str, np.ndarray] = {}
        self.claimed, self.limit = 0, max_bytes()

    def fail(self, pos: int | None, what: str) -> TraceError:
        at = f" at byte {pos}" if pos is not None else ""
        return TraceError(f"{self.src}: data.pkl{at}: {what} (only what torch.save writes is read)")

    def run(self, pkl) -> Any:
        stack: list = []
        marks: list[list] = []
        memo: dict[int, Any] = {}
        pos = None
        try:
            for op, arg, pos in pickletools.genops(pkl):
                name = op.name
                if name in _PUSH_ARG:
                    stack.append(arg)
                elif name in _CONST:
                    stack.append(_CONST[name])
                elif name == "EMPTY_DICT":
                    stack.append({})
                elif name == "EMPTY_LIST":
                    stack.append([])
                elif name == "MARK":
                    marks.append(stack)
                    stack = []
                elif name == "TUPLE":
                    items, stack = stack, marks.pop()
                    stack.append(tuple(items))
                elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                    n = int(name[-1])
                    if len(stack) < n:
                        raise IndexError
                    items = tuple(stack[-n:])
                    del stack[-n:]
                    stack.append(items)
                elif name in _FILL:
                    stack = self._fill(name, stack, marks, pos)
                elif name in ("BINPUT", "LONG_BINPUT"):
                    memo[arg] = stack[-1]
                elif name == "MEMOIZE":
                    memo[len(memo)] = stack[-1]
                elif name in ("BINGET", "LONG_BINGET"):
                    if arg not in memo:
                        raise self.fail(pos, f"memo entry {arg} read before it was written")
                    stack.append(memo[arg])
                elif name == "GLOBAL":
                    module, _, qual = arg.partition(" ")
                    stack.append(self._global(module, qual, pos))
                elif name == "STACK_GLOBAL":
                    qual, module = stack.pop(), stack.pop()
                    if not (isinstance(module, str) and isinstance(qual, str)):
                        raise self.fail(pos, "STACK_GLOBAL needs two strings")
                    stack.append(self._global(module, qual, pos))
                elif name == "BINPERSID":
                    stack.append(self._storage(stack.pop(), pos))
                elif name == "REDUCE":
                    args, func = stack.pop(), stack.pop()
                    stack.append(self._reduce(func, args, pos))
                elif name == "PROTO":
                    if arg > 5:
                        raise self.fail(pos, f"pickle protocol {arg}")
                elif name == "FRAME":
                    pass
                elif name == "STOP":
                    if len(stack) != 1 or marks:
                        raise self.fail(pos, "STOP with a malformed stack")
                    return stack[0]
                else:
                    raise self.fail(pos, f"opcode {name} is not allowed")
        except IndexError:
            raise self.fail(pos, "stack underflow (a malformed pickle)") from None
        except (ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, TraceError):
                raise
            raise self.fail(pos, f"malformed pickle ({str(exc).splitlines()[0][:100]})") from None
        raise self.fail(pos, "ends without STOP")

    # ------------------------------------------------------------------ pieces
    def _fill(self, name: str, stack: list, marks: list[list], pos) -> list:
        """The opcodes that fill a list or dict already on the stack (:data:`_FILL`); returns the
        stack (the marked ones pop back to the stack below their mark)."""
        if name == "APPEND":
            value = stack.pop()
            self._list(stack[-1], pos).append(value)
        elif name == "APPENDS":
            items, stack = stack, marks.pop()
            self._list(stack[-1], pos).extend(items)
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            self._dict(stack[-1], pos)[self._key(key, pos)] = value
        elif name == "SETITEMS":
            items, stack = stack, marks.pop()
            target = self._dict(stack[-1], pos)
            if len(items) % 2:
                raise self.fail(pos, "SETITEMS with an odd number of items")
            for i in range(0, len(items), 2):
                target[self._key(items[i], pos)] = items[i + 1]
        else:  # BUILD
            state = stack.pop()
            if not (isinstance(stack[-1], dict) and isinstance(state, dict)):
                raise self.fail(pos, "BUILD is read only to fill a dict")
            stack[-1].update(state)
        return stack

    def _list(self, x, pos) -> list:
        if not isinstance(x, list):
            raise self.fail(pos, f"APPEND to a {type(x).__name__}")
        return x

    def _dict(self, x, pos) -> dict:
        if not isinstance(x, dict):
            raise self.fail(pos, f"SETITEM on a {type(x).__name__}")
        return x

    def _key(self, key, pos):
        if not isinstance(key, (str, int, float, bool, type(None))):
            raise self.fail(pos, f"a dict key of type {type(key).__name__}")
        return key

    def _global(self, module: str, qual: str, pos) -> _Global:
        if (module, qual) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Global("tensor")
        if (module, qual) == ("collections", "OrderedDict"):
            return _Global("ordereddict")
        if module == "torch" and qual in _STORAGES:
            return _Global("storage", _STORAGES[qual])
        raise self.fail(pos, f"global {short(module + '.' + qual)} is not allowed")

    def _storage(self, pid, pos) -> _Storage:
        ok = (
            isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], _Global) and pid[1].kind == "storage"
            and isinstance(pid[2], str) and isinstance(pid[3], str)
            and is_int(pid[4], 0)
        )
        if not ok:
            raise self.fail(pos, f"persistent id {short(pid)} is not a storage reference")
        return _Storage(pid[1].code, pid[2], pid[4])

    def _reduce(self, func, args, pos):
        if not isinstance(func, _Global) or func.kind == "storage" or not isinstance(args, tuple):
            raise self.fail(pos, "REDUCE of something other than a tensor or an OrderedDict")
        if func.kind == "ordereddict":
            if args:
                raise self.fail(pos, "OrderedDict built from arguments")
            return {}
        return self._tensor(args, pos)

    def _tensor(self, args: tuple, pos) -> np.ndarray:
        if len(args) not in (6, 7) or not isinstance(args[0], _Storage):
            raise self.fail(pos, "_rebuild_tensor_v2 with unexpected arguments")
        storage, offset, size, stride = args[:4]
        ints = lambda t: isinstance(t, tuple) and all(is_int(v, 0) for v in t)
        if not (isinstance(offset, int) and offset >= 0 and ints(size) and ints(stride) and len(size) == len(stride)):
            raise self.fail(pos, f"tensor with offset {short(offset)}, size {short(size)}, stride {short(stride)}")
        count = math.prod(size)
        if count and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.numel:
            raise self.fail(pos, f"tensor of size {size} reaches past its storage of {storage.numel} elements")
        if count > max(storage.numel, 1):
            raise self.fail(pos, f"tensor of size {size} has more elements than its storage ({storage.numel})")
        data = self._load(storage, pos)
        self.claimed += count * data.dtype.itemsize
        if self.claimed > self.limit:
            raise self.fail(pos, f"its tensors claim {self.claimed:,} bytes in all, more than the trace limit of "
                                 f"{self.limit:,} (set EXPERTCACHE_MAX_TRACE_BYTES to allow more)")
        if count == 0:
            return np.zeros(size, dtype=data.dtype)
        item = data.dtype.itemsize
        return np.lib.stride_tricks.as_strided(data[offset:], shape=size, strides=[s * item for s in stride],
                                               writeable=False)

    def _load(self, storage: _Storage, pos) -> np.ndarray:
        if storage.key in self.storages:
            return self.storages[storage.key]
        member = f"{self.root}data/{storage.key}"
        try:
            info = self.zf.getinfo(member)
        except KeyError:
            raise self.fail(pos, f"storage member {short(member)} is missing") from None
        code = storage.code
        raw = np.dtype("u2" if code == "bf16" else code).newbyteorder(self.order)
        nbytes = storage.numel * raw.itemsize
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise self.fail(pos, f"storage member {short(member)} holds {info.file_size} bytes, expected {nbytes} stored uncompressed")
        data = np.frombuffer(self.zf.read(member), dtype=raw)
        if code == "bf16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        elif not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))
        data.flags.writeable = False
        self.storages[storage.key] = data
        return data
