"""The page-cache modes of a llama.cpp run: how the kernel tier holding the GGUF is advised.

llama.cpp mmaps the whole GGUF (``MAP_SHARED``, read-only, offset 0; by default also
``MAP_POPULATE``), so the page cache is the expert tier. :class:`PageAdvisor` is an engine
observer acting on that mapping (found in ``/proc/self/maps`` by the file's device and inode) and
on the file through its own descriptor:

* ``mmap``: nothing (llama.cpp's default);
* ``random``: ``madvise(MADV_RANDOM)`` on the expert tensors' pages: a fault reads its page, not
  the device's readahead window;
* ``advise``: random, plus ``posix_fadvise(WILLNEED)`` of exactly the routed experts' byte ranges
  (gate, up, down) as soon as a layer's ``ffn_moe_topk`` is computed, before its expert matmuls;
* ``lookahead``: advise, plus WILLNEED of the NEXT MoE layer's predicted experts when this layer's
  ``ffn_inp`` (the residual stream entering its FFN) is computed. Predictor: the next layer's own
  router applied to this residual, ``topk(W_gate[l+1] . rmsnorm(h) * ffn_norm[l+1], k)`` (the
  paper's router lookahead, section 7; it ignores this layer's MoE output and the next attention).
  Decode steps only (a one-row forward). ``lookahead_recall`` = predicted experts the next layer
  then routed / experts it routed;
* ``pin``: advise, plus the dense part (every tensor but the expert tensors: attention, norms,
  routers, embeddings; read every step) locked in memory with ``mlock`` once loaded, so that only
  experts compete for the page cache (a dense page evicted and refaulted reads the device's whole
  readahead window, mostly expert pages). A wall counts the locked pages as tier bytes;
* ``nocache``: advise (the routed experts read whole, as the incumbent's ``pread`` reads them), plus,
  after each layer's ``ffn_moe_out``, its three expert tensors dropped: ``madvise(MADV_DONTNEED)``
  on the mapping (unmaps this process's pages) then ``posix_fadvise(DONTNEED)`` (evicts the clean
  pages): every use pays the device, the in-engine analogue of the incumbent's F_NOCACHE. Against
  ``advise`` it differs only in admission (the paper's section 9 A/B);
* ``nommap``: the weights are read into anonymous memory at load (no tier; ``Engine(mmap=False)``).

Advice never changes what is computed: all modes give the same tokens (tested).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from ..errors import ConfigError
from .capture import layer_of
from .geometry import Geometry
from .ggml import read_2d

MODES = ("mmap", "random", "advise", "pin", "lookahead", "nocache", "nommap")
MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 1, 3, 4
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def mapping_base(path: str) -> int | None:
    """The address where this process maps byte 0 of ``path`` (llama.cpp's mapping), or None."""
    st = os.stat(path)
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or int(parts[4]) != st.st_ino:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            if os.makedev(major, minor) != st.st_dev:
                continue
            start = int(parts[0].split("-")[0], 16)
            return start - int(parts[2], 16)
    return None


def madvise(addr: int, length: int, advice: int) -> None:
    lo = addr & ~(PAGE - 1)
    hi = (addr + length + PAGE - 1) & ~(PAGE - 1)
    if _libc.madvise(lo, hi - lo, advice) != 0:
        raise ConfigError(f"madvise({advice}) failed: {os.strerror(ctypes.get_errno())}")


def mlock(addr: int, length: int) -> None:
    lo = addr & ~(PAGE - 1)
    hi = (addr + length + PAGE - 1) & ~(PAGE - 1)
    if _libc.mlock(lo, hi - lo) != 0:
        raise ConfigError(f"--mode pin: mlock of {hi - lo} bytes failed: {os.strerror(ctypes.get_errno())} "
                          "(RLIMIT_MEMLOCK: ulimit -l, or CAP_IPC_LOCK)")


class PageAdvisor:
    """The engine observer of one mode (see the module docstring); ``stats()`` its counters."""

    _TOPK, _INP, _OUT = (b"ffn_moe_topk-",), (b"ffn_inp-",), (b"ffn_moe_out-",)

    def __init__(self, geometry: Geometry, mode: str):
        if mode not in MODES:
            raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
        self.g, self.mode = geometry, mode
        self.fd = os.open(geometry.path, os.O_RDONLY)
        self.base: int | None = None
        self.hints = self.hint_bytes = self.drops = self.locked_bytes = 0
        self.predicted: dict[int, set] = {}
        self.look_hits = self.look_total = 0
        self.next_layer = dict(zip(geometry.moe_layers, geometry.moe_layers[1:]))
        self.routers = self._routers() if mode == "lookahead" else {}
        self.n_tokens = 0

    def start(self) -> None:
        """After the engine has loaded: find the mapping and apply MADV_RANDOM where the mode asks."""
        if self.mode == "nommap":
            return
        self.base = mapping_base(self.g.path)
        if self.base is None:
            raise ConfigError(f"{self.g.path}: llama.cpp has not mapped the file (mode {self.mode} needs the mapping)")
        if self.mode != "mmap":
            for layer in self.g.moe_layers:
                for off, n in self.g.layer_span(layer):
                    madvise(self.base + off, n, MADV_RANDOM)
        if self.mode == "pin":
            expert = {(t.offset, t.nbytes) for parts in self.g.experts.values() for t in parts.values()}
            for t in self.g.tensors.values():
                if t.nbytes and (t.offset, t.nbytes) not in expert:
                    mlock(self.base + t.offset, t.nbytes)
                    self.locked_bytes += t.nbytes

    def _routers(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per MoE layer: (ffn_norm weight [H], router [E, H]) as float32, read from the file."""
        out = {}
        for layer in self.g.moe_layers:
            norm = self.g.tensors.get(f"blk.{layer}.ffn_norm.weight")
            gate = self.g.tensors.get(f"blk.{layer}.ffn_gate_inp.weight")
            if norm is None or gate is None or norm.type_name != "f32" or gate.type_name not in ("f32", "f16"):
                raise ConfigError(f"{self.g.path}: lookahead needs f32 ffn_norm and f32/f16 ffn_gate_inp of layer {layer}")
            w = np.fromfile(self.g.path, dtype=np.float32 if gate.type_name == "f32" else np.float16,
                            count=gate.shape[0] * gate.shape[1], offset=gate.offset)
            n = np.fromfile(self.g.path, dtype=np.float32, count=norm.shape[0], offset=norm.offset)
            out[layer] = (n, w.reshape(gate.shape[1], gate.shape[0]).astype(np.float32))
        return out

    # -- observer --------------------------------------------------------------------------
    def begin(self, n_tokens: int, starts_sequence: bool, all_logits: bool) -> None:
        self.n_tokens = n_tokens

    def wants(self, name: bytes) -> bool:
        if self.mode in ("advise", "pin", "lookahead", "nocache") and layer_of(name, self._TOPK) is not None:
            return True
        if self.mode == "lookahead" and layer_of(name, self._INP) is not None:
            return True
        return self.mode == "nocache" and layer_of(name, self._OUT) is not None

    def seen(self, name: bytes, ptr: int) -> None:
        layer = layer_of(name, self._TOPK)
        if layer is not None:
            routed = np.unique(read_2d(ptr, np.int32))
            if layer in self.predicted:
                self.look_hits += len(self.predicted.pop(layer) & set(routed.tolist()))
                self.look_total += routed.size
            self.willneed(layer, routed)
            return
        layer = layer_of(name, self._INP)
        if layer is not None:
            nxt = self.next_layer.get(layer)
            if nxt is not None and self.n_tokens == 1:
                guess = self.predict(nxt, read_2d(ptr, np.float32)[-1])
                self.predicted[nxt] = set(guess.tolist())
                self.willneed(nxt, guess)
            return
        layer = layer_of(name, self._OUT)
        if layer is not None and self.base is not None:
            for off, n in self.g.layer_span(layer):
                madvise(self.base + off, n, MADV_DONTNEED)
                os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)
            self.drops += 1

    def predict(self, layer: int, h: np.ndarray) -> np.ndarray:
        norm, w = self.routers[layer]
        eps = float(self.g.metadata.get(f"{self.g.architecture}.attention.layer_norm_rms_eps", 1e-6))
        x = h / np.sqrt(np.mean(h * h) + eps) * norm
        return np.argsort(-(w @ x), kind="stable")[: self.g.top_k]

    def willneed(self, layer: int, experts: np.ndarray) -> None:
        for e in experts.tolist():
            for off, n in self.g.expert_ranges(layer, int(e)):
                os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)
                self.hints += 1
                self.hint_bytes += n

    def stats(self) -> dict:
        return {"hints": self.hints, "hint_bytes": self.hint_bytes, "layer_drops": self.drops,
                "locked_bytes": self.locked_bytes,
                "lookahead_recall": self.look_hits / self.look_total if self.look_total else None}

    def close(self) -> None:
        os.close(self.fd)
