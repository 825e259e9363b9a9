"""A llama.cpp model and context driven through llama-cpp-python's low-level bindings, with the
scheduler's eval callback dispatched to observers (:class:`Observer`) by an :class:`EvalHook`.

One :class:`Engine` is one model file, one context (CPU, f32 KV cache, no flash attention, one
sequence), ``n_batch == n_ubatch == n_ctx`` so a forward of up to ``n_ctx`` tokens is one graph.
``forward(ids, logits="all")`` computes every row's logits, so llama.cpp's last layer routes every
row (with ``"last"`` it routes only the last one: the graph drops unused rows before the last
layer's FFN). Observers see every forward (``begin``) and every tensor whose name they asked for
(``wants``), after it is computed and before the rest of the graph runs, which is what lets the
page-cache advice act between a layer's routing and its expert matmuls. An exception inside the
callback is kept and raised after the forward (the callback itself always lets the graph go on).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Protocol, Sequence

import numpy as np

from .._text import short
from ..errors import ConfigError, is_int, max_threads
from ..formats.gguf import Geometry, read_geometry
from .ggml import abort_in_one_line, check_layout, tensor_name


class Observer(Protocol):
    """What the engine calls: ``begin`` at each forward, ``wants`` per tensor name (cached), ``seen``
    with each wanted tensor once computed (``ptr`` is its ``struct ggml_tensor *``). An observer may
    declare ``prefixes``: every name it may want starts with one of them (the compiled filter hands
    it nothing else)."""

    def begin(self, n_tokens: int, starts_sequence: bool, all_logits: bool) -> None: ...
    def wants(self, name: bytes) -> bool: ...
    def seen(self, name: bytes, ptr: int) -> None: ...


class EvalHook:
    """The scheduler's eval callback (``cb_eval``) dispatched to observers: ``ask`` is answered per
    tensor name (cached), each wanted tensor is handed to its observers once computed. An exception
    inside the callback is kept (the callback always lets the graph go on) and raised by
    :meth:`raise_pending` after the forward. One hook serves one llama.cpp context.

    The context gets :attr:`cb_eval` and :attr:`user_data`: where numba can compile it, a filter in
    machine code (:mod:`.evalfilter`) that hands Python only the tensors whose names start with a
    prefix some observer declares (``Observer.prefixes``; an observer without them sees every
    name), else the Python callback itself."""

    def __init__(self, ll):
        from .evalfilter import Table, compiled

        self.observers: list[Observer] = []
        self._wanted: dict[bytes, list[Observer]] = {}
        self.seconds: dict[int, float] = {}
        """Seconds spent in each observer's ``seen`` (by ``id``): :meth:`seconds_in`."""
        self.callback_seconds = 0.0
        """Seconds inside the Python callback, every observer and the dispatch included."""
        self._error: BaseException | None = None
        self.callback = ll.ggml_backend_sched_eval_callback(self._callback)
        address = compiled()
        self._table = None
        if address is not None:
            self._table = Table(ctypes.cast(self.callback, ctypes.c_void_p).value, [])
            self.cb_eval, self.user_data = ll.ggml_backend_sched_eval_callback(address), self._table.address
        else:
            self.cb_eval, self.user_data = self.callback, None

    def _prefixes(self) -> None:
        if self._table is None:
            return
        from .evalfilter import Table

        wanted = sorted({p for o in self.observers for p in getattr(o, "prefixes", (b"",))})
        fresh = Table(ctypes.cast(self.callback, ctypes.c_void_p).value, wanted)
        ctypes.memmove(self._table.buf, fresh.buf, ctypes.sizeof(fresh.buf))  # the context keeps this buffer

    def attach(self, obs: Observer) -> None:
        self.observers.append(obs)
        self._wanted.clear()
        self._prefixes()

    def detach(self, obs: Observer) -> None:
        if obs in self.observers:
            self.observers.remove(obs)
        self._wanted.clear()
        self._prefixes()

    def begin(self, n_tokens: int, starts_sequence: bool, all_logits: bool) -> None:
        """Before a forward of ``n_tokens`` rows: every observer's ``begin``; pending errors cleared."""
        self._error = None
        for o in self.observers:
            o.begin(n_tokens, starts_sequence, all_logits)

    def raise_pending(self) -> None:
        """After a forward: raise what an observer raised inside the callback, if anything."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def seconds_in(self, obs: Observer) -> float:
        """Seconds ``obs`` has spent handling the tensors it was handed (its share of each step)."""
        return self.seconds.get(id(obs), 0.0)

    def _callback(self, ptr, ask, _user) -> bool:
        t0 = time.perf_counter()
        try:
            name = tensor_name(ptr)
            who = self._wanted.get(name)
            if who is None:
                who = self._wanted[name] = [o for o in self.observers if o.wants(name)]
            if not ask:
                for o in who:
                    t1 = time.perf_counter()
                    o.seen(name, ptr)
                    self.seconds[id(o)] = self.seconds.get(id(o), 0.0) + time.perf_counter() - t1
            return bool(who) if ask else True
        except BaseException as exc:  # noqa: BLE001 - kept, raised after the forward
            self._error = self._error or exc
            return False if ask else True
        finally:
            self.callback_seconds += time.perf_counter() - t0


def _llama():
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError("llama.cpp bindings are not installed (pip install 'expertcache[llama]')") from None
    return llama_cpp


_LOG_SINK = None


def _silence(llama_cpp, model: str | os.PathLike | None = None) -> None:
    """Route llama.cpp's log lines to nowhere (they would bury the one-line errors), and make a failed
    check inside llama.cpp one line naming ``model`` (:func:`~expertcache.llama.ggml.abort_in_one_line`)."""
    global _LOG_SINK
    abort_in_one_line(None if model is None else os.fspath(model))
    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p())


MAX_CONTEXT = 1 << 24
"""Largest context an engine asks llama.cpp for (a capture's prompt plus --generate): 16M tokens."""


class Engine:
    """See the module docstring. ``mmap=False`` reads the weights into memory (``nommap``).
    ``n_ctx`` is an integer in ``[1, MAX_CONTEXT]`` and ``threads`` one in ``[1, max_threads()]``,
    else one ConfigError line: llama.cpp's fields are 32-bit, and ctypes had cut ``n_ctx=2**32 + 5``
    to 5 and ``threads=10**30`` to its low bits without a word; 2.5 was truncated, 0 and -1 taken."""

    def __init__(self, path: str, *, n_ctx: int = 512, threads: int = 1, mmap: bool = True,
                 geometry: Geometry | None = None):
        if not is_int(n_ctx, 1, MAX_CONTEXT):
            raise ConfigError(f"n_ctx must be an integer in [1, {MAX_CONTEXT:,}], got {short(n_ctx, 40)}")
        if not is_int(threads, 1, max_threads()):
            raise ConfigError(f"threads must be an integer in [1, {max_threads()}] (4 per core here), got "
                              f"{short(threads, 40)}")
        self.geometry = geometry or read_geometry(path)
        self.bindings = check_layout()
        ll = self.ll = _llama()
        _silence(ll, path)
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.load_mode = 1 if mmap else 0  # LLAMA_LOAD_MODE_MMAP / NONE
        mp.lazy_mode = 0
        mp.use_extra_bufts = False  # no repacking: the weights stay in the file mapping
        self.path, self.n_ctx, self.threads = os.fspath(path), int(n_ctx), int(threads)
        self.model = ll.llama_model_load_from_file(self.path.encode(), mp)
        if not self.model:
            raise ConfigError(f"--model {path}: llama.cpp could not load this GGUF")
        self.hook = EvalHook(ll)
        cp = ll.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
        cp.flash_attn_type = 0
        cp.cb_eval = self.hook.cb_eval
        cp.cb_eval_user_data = self.hook.user_data
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise ConfigError(f"--model {path}: llama.cpp could not create a context of {n_ctx} tokens")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(self.n_ctx, 0, 1)
        self.pos = 0

    # -- observers -------------------------------------------------------------------------
    @property
    def observers(self) -> list[Observer]:
        return self.hook.observers

    def attach(self, obs: Observer) -> None:
        self.hook.attach(obs)

    def detach(self, obs: Observer) -> None:
        self.hook.detach(obs)

    # -- forwards --------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence (clear the KV cache); the next forward starts at position 0."""
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        self.pos = 0

    def forward(self, ids: Sequence[int], logits: str = "all") -> np.ndarray:
        """Append ``ids`` to the sequence; the logits ``[rows, vocab]`` of every row or the last."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = int(ids.size)
        if n == 0:
            raise ConfigError("forward: no tokens")
        if self.pos + n > self.n_ctx:
            raise ConfigError(f"the sequence needs {self.pos + n} positions, the context holds {self.n_ctx}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.n_vocab:
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ConfigError(f"token id {bad} is outside the model's vocabulary [0, {self.n_vocab})")
        b = self.batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = int(ids[i])
            b.pos[i] = self.pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (logits == "all" or i == n - 1) else 0
        self.hook.begin(n, self.pos == 0, logits == "all")
        rc = self.ll.llama_decode(self.ctx, b)
        self.hook.raise_pending()
        if rc != 0:
            raise ConfigError(f"llama_decode failed with status {rc}")
        self.pos += n
        rows = range(n) if logits == "all" else [n - 1]
        out = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        for j, i in enumerate(rows):
            p = self.ll.llama_get_logits_ith(self.ctx, i)
            out[j] = np.ctypeslib.as_array(p, shape=(self.n_vocab,))
        return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, clock=None) -> tuple[list[int], dict]:
        """Greedy decode: the prompt in one forward (last logits), then one token per forward.
        Returns the ``max_new_tokens`` new ids and ``{"prefill_seconds", "decode_seconds",
        "decode_steps"}`` (``clock``: a callable giving seconds, default ``time.perf_counter``);
        as in Hugging Face ``generate``, the last new token is not fed back."""
        import time
        clock = clock or time.perf_counter
        self.reset()
        t0 = clock()
        logits = self.forward(prompt, logits="last")
        t1 = clock()
        out = [int(np.argmax(logits[-1]))]
        for _ in range(max_new_tokens - 1):
            logits = self.forward([out[-1]], logits="last")
            out.append(int(np.argmax(logits[-1])))
        t2 = clock()
        return out, {"prefill_seconds": t1 - t0, "decode_seconds": t2 - t1, "decode_steps": max_new_tokens - 1}

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ll.llama_model_free(self.model)
            self.ctx = self.model = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
