"""Text in, text out: llama-cpp-python's ``Llama`` (tokenizer, chat templates, sampling, KV cache)
with expertcache's page-cache modes attached (``expertcache llama generate``, ``expertcache serve``).

:class:`ObservedLlama` is a ``llama_cpp.Llama`` whose context carries an :class:`~.engine.EvalHook`
and whose weights stay in the file mapping: the high-level class makes its model and context
parameters inside ``__init__`` and loads with them at once, with no argument for ``cb_eval`` or
``use_extra_bufts``, so the subclass receives each struct as ``__init__`` assigns it (a property
setter) and sets the callback, and turns repacking off (a repacked weight is a copy in anonymous
memory, outside the page cache: llama.cpp's ``--no-repack``). ``eval`` tells the hook where each
forward begins; ``sample`` counts the tokens sampled and, when asked
(:attr:`ObservedLlama.logprobs`), reads each one's log-probabilities (:func:`token_logprobs`);
``detokenize`` writes every token's whole text (llama-cpp-python's drops a token longer than 32
bytes: :func:`token_bytes`); given a ``chat_template`` (``--chat-template-file``), ``metadata``
holds it in place of the GGUF's. Nothing else of ``Llama`` is changed: tokenizer, chat templates and
sampling are llama-cpp-python's own; the streamed completion loop is :mod:`.completion`'s
(llama-cpp-python's stalls on text that is not UTF-8).

:class:`Session` is one GGUF opened in one page-cache mode (:mod:`.advice`): the geometry, the
mode's :class:`~.advice.PageAdvisor` (started once the model is mapped), the ``ObservedLlama``
(a hook only where the mode reads the routing, so ``mmap``, ``random`` and ``nommap`` run llama.cpp
with no callback at all), and the counters a server exports. ``cache_bytes`` bounds the
``managed`` pool (``--cache-memory``: the dense part plus the experts the pool may hold, the same
bytes a ``--memory-wall`` of that size proves); the other modes leave residency to the kernel and
refuse it. ``managed`` starts cold, as a walled run does: the file's clean pages are evicted before
llama.cpp maps it, because pages a write or an earlier reader left may sit in large folios (ext4
on kernel 6.16+) that span several experts, and the kernel drops a folio only whole: the pool could
not then drop one expert at a time (seen on a freshly quantized file: evicted experts stayed). Advice never changes what is computed: greedy text is the same in every mode (tested).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from dataclasses import dataclass

import llama_cpp
import numpy as np

from ..errors import ConfigError
from . import KV_CACHE_TYPES
from .advice import MODES, PageAdvisor, readers_for
from .capture import ContextRouting
from .completion import stream_chat, stream_completion
from .constraints import GrammarFirst
from .engine import EvalHook, _silence
from ..formats.gguf import Geometry, chat_template_problem, read_geometry, read_header
from .runner import check_managed, io_counters
from ..wall.procfs import SELF_IO, OpenProcFile, read_self_io

DEFAULT_CTX = 2048
"""Context (tokens) of ``generate`` and ``serve`` unless ``--ctx`` says otherwise (or the model was
trained for less: :meth:`Session.open`)."""


def token_logprobs(llm: llama_cpp.Llama, token: int, top: int,
                   row: int = -1) -> tuple[int, float, list[tuple[int, float]]]:
    """``(token, its log-probability, [(id, log-probability)] of the ``top`` most likely tokens, most
    likely first, ties by lower id)``: the log-softmax of the logits of output ``row`` of the last
    forward (-1: the last, the row a token is sampled from; llama-cpp-python keeps only that row
    unless built with ``logits_all``). That is the model's distribution, before temperature, top-p
    and the penalties reshape it, as llama-cpp-python's and OpenAI's ``logprobs`` are. The exponentials of the logits
    less their largest are taken in float32 and summed in float64: 0.4 ms a token for a vocabulary
    of 151,936 here, against 1.7 all in float64, the normaliser 3e-9 apart."""
    n = llm.n_vocab()
    x = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, row), shape=(n,))
    peak = float(x.max())
    lse = peak + float(np.log(np.exp(x - np.float32(peak)).sum(dtype=np.float64)))
    top = min(top, n)
    best = np.argpartition(-x, top - 1)[:top] if top else np.empty(0, dtype=np.int64)
    best = best[np.lexsort((best, -x[best]))]
    return int(token), float(x[token]) - lse, [(int(i), float(x[i]) - lse) for i in best]


def token_bytes(vocab, tokens, special: bool = False) -> bytes:
    """The bytes of ``tokens``' texts in the vocabulary ``vocab`` (a ``llama_vocab`` pointer), each
    as llama.cpp's ``llama_token_to_piece`` writes it, its buffer grown to what a piece needs.
    llama-cpp-python 0.3.36's ``detokenize`` gives each piece 32 bytes and writes nothing for a
    longer one (llama.cpp answers with the size it needs, negated, and the slice of that is empty):
    a token of 33 or more bytes, such as a run of spaces that indents code, vanished from the text
    without a word (abetlen/llama-cpp-python#2362; ``tests/test_serve.py`` checks the premise)."""
    size = 64
    buf = ctypes.create_string_buffer(size)
    piece = llama_cpp.llama_token_to_piece
    out = bytearray()  # bytes += bytes copies the whole text at each token: 80,000 tokens took 5.7 s
    for token in tokens:
        n = piece(vocab, int(token), buf, size, 0, special)
        if n < 0:  # the piece needs -n bytes
            size = -n
            buf = ctypes.create_string_buffer(size)
            n = piece(vocab, int(token), buf, size, 0, special)
        out += buf.raw[:max(n, 0)]
    return bytes(out)


class ObservedLlama(llama_cpp.Llama):
    """``llama_cpp.Llama`` with an :class:`EvalHook` on its context (see the module docstring)."""

    def __init__(self, model_path: str, *, hook: EvalHook | None = None, routing: ContextRouting | None = None,
                 io: OpenProcFile | None = None, chat_template: str | None = None, **kwargs):
        self.chat_template = chat_template
        """A Jinja chat template that stands for the GGUF's ``tokenizer.chat_template`` (llama.cpp's
        ``--chat-template-file``): :attr:`metadata` holds it from the moment ``Llama.__init__`` reads
        the file's, so llama-cpp-python makes its chat handler of it, and whatever reads the
        template from the metadata (the server's call and thinking formats) reads this one."""
        self.hook = hook
        self.routing = routing
        """Where each position's routing is kept (``serve --enable-return-routed-experts``): every
        forward then computes every row (llama.cpp otherwise drops all rows but the last from the
        last layer, its MoE included)."""
        self.io = io if io is not None else OpenProcFile(SELF_IO)
        """This process's /proc/self/io (closed with this object), opened before the load: inside a
        wall the load fills, opening it at each step could fail
        (:class:`~expertcache.wall.procfs.OpenProcFile`)."""
        self.stats = {"prefill_forwards": 0, "prefill_tokens": 0, "prefill_seconds": 0.0, "decode_steps": 0,
                      "decode_seconds": 0.0, "decode_read_bytes": 0, "resident_steps": 0, "resident_seconds": 0.0}
        """Cumulative forwards: a decode step is the one-token forward of a token just sampled;
        every other forward is a prefill (a prefix cached from the previous prompt is not evaluated
        again, so not counted). ``decode_read_bytes``: what this process read from the device during
        decode steps (``/proc/self/io``, the mode's reader threads included); ``resident_steps`` /
        ``resident_seconds``: the decode steps that read nothing (every expert they routed was
        resident) and their time, whose rate is the compute rate of the roofline."""
        self.sampled = 0
        """Tokens sampled since the model was loaded."""
        self.last_sampled_is_eog = False
        self.prompt_length = 0
        """Context tokens when the current generation sampled its first token: its whole prompt."""
        self.logprobs: int | None = None
        """None, or N: each token :meth:`sample` draws (but an end-of-generation token, which the
        usage leaves out too) appends :func:`token_logprobs` with N alternatives to
        :attr:`logprob_rows`."""
        self.logprob_rows: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.prompt_logprobs: int | None = None
        """None, or N: a prompt's forward computes every row's logits, and each row appends to
        :attr:`prompt_rows` the :func:`token_logprobs` (N alternatives) of the prompt token after it:
        one row per prompt token but the first (``echo`` with ``logprobs``). The prompt must be
        evaluated whole (``reset`` first: a prefix kept in the KV cache is not evaluated again)."""
        self.prompt_rows: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._decoding = False
        self._grammar: GrammarFirst | None = None  # a generation's grammar, checked after the chain draws
        super().__init__(model_path, **kwargs)

    # ``Llama.__init__`` makes both parameter structs and loads with them at once, with no argument for
    # either setting below: these setters receive each struct as it is made.
    @property
    def model_params(self):
        return self._model_params

    @model_params.setter
    def model_params(self, params) -> None:
        params.use_extra_bufts = False  # no repacked copy: every weight stays in the file mapping (the tier)
        self._model_params = params

    @property
    def context_params(self):
        return self._context_params

    @context_params.setter
    def context_params(self, params) -> None:
        if self.hook is not None:
            params.cb_eval = self.hook.cb_eval
            params.cb_eval_user_data = self.hook.user_data
        self._context_params = params

    def close(self) -> None:
        super().close()
        self.io.close()

    def _read_bytes(self) -> int | None:
        counters, _ = read_self_io(self.io)
        return counters["read_bytes"] if counters else None

    def generate(self, *args, grammar=None, **kwargs):
        """``Llama.generate``, a ``grammar`` applied as llama.cpp's own sampler applies it
        (:class:`~.constraints.GrammarFirst`) instead of in the chain, where it matched the whole
        vocabulary at every token."""
        self._decoding = False
        mine = self._grammar = GrammarFirst(self._model.vocab, grammar, self._n_vocab) if grammar is not None else None
        try:
            return (yield from super().generate(*args, **kwargs))
        finally:
            if mine is not None:
                mine.close()
            if self._grammar is mine:
                self._grammar = None

    @property
    def metadata(self) -> dict:
        return self._metadata

    @metadata.setter
    def metadata(self, value: dict) -> None:
        if self.chat_template is not None:
            value = {**value, "tokenizer.chat_template": self.chat_template}
        self._metadata = value

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        """llama-cpp-python's ``detokenize``, every token's text whole (:func:`token_bytes`), the
        leading space after a BOS dropped as its own does."""
        if not isinstance(self.tokenizer_, llama_cpp.llama_tokenizer.LlamaTokenizer):  # a Hugging Face tokenizer's
            return super().detokenize(tokens, prev_tokens=prev_tokens, special=special)
        out = token_bytes(self._model.vocab, tokens, special)
        return out[1:] if tokens and tokens[0] == self.token_bos() and out[:1] == b" " else out

    def sample(self, *args, **kwargs) -> int:
        if self._grammar is not None and self._sampler is not None and kwargs.get("grammar") is None:
            idx = kwargs.get("idx")
            token = self._grammar.sample(self._ctx.ctx, self._sampler.sampler,
                                         idx - self.n_tokens if idx is not None else -1)
        else:
            token = super().sample(*args, **kwargs)
        if not self._decoding:
            self.prompt_length, self._decoding = self.n_tokens, True
        self.sampled += 1
        self.last_sampled_is_eog = bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))
        if self.logprobs is not None and not self.last_sampled_is_eog:
            self.logprob_rows.append(token_logprobs(self, token, self.logprobs))
        return token

    def eval(self, tokens) -> None:
        decode = self._decoding and len(tokens) == 1
        self._decoding = decode
        r0 = self._read_bytes() if decode else None
        t0 = time.perf_counter()
        if not decode and self.prompt_logprobs is not None:
            self._eval_every_row(tokens)
        elif self.hook is None:
            super().eval(tokens)
        elif self.routing is None or self._logits_all:
            if self.routing is not None:
                self.routing.n_past = self.n_tokens
            self.hook.begin(len(tokens), self.n_tokens == 0, bool(self._logits_all))
            super().eval(tokens)
            self.hook.raise_pending()
        else:
            self._eval_every_row(tokens)
        dt, st = time.perf_counter() - t0, self.stats
        if decode:
            st["decode_steps"] += 1
            st["decode_seconds"] += dt
            read = self._read_bytes()
            if read is not None and r0 is not None:
                st["decode_read_bytes"] += read - r0
                if read == r0:
                    st["resident_steps"] += 1
                    st["resident_seconds"] += dt
        else:
            st["prefill_forwards"] += 1
            st["prefill_tokens"] += len(tokens)
            st["prefill_seconds"] += dt


    def _eval_every_row(self, tokens) -> None:
        """``Llama.eval`` with every row an output, so that each layer routes every row (``routing``)
        and each row's logits can be read (``prompt_logprobs``: before the next batch replaces
        them); the logits stay in the context (``Llama.scores`` holds ``n_batch`` rows unless
        ``logits_all``, and the sampler reads the last row from the context either way). The loop is
        ``Llama.eval``'s."""
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i: min(len(tokens), i + self.n_batch)]
            n_past, n = self.n_tokens, len(batch)
            if self.routing is not None:
                self.routing.n_past = n_past
            if self.hook is not None:
                self.hook.begin(n, n_past == 0, True)
            self._batch.set_batch(batch=batch, n_past=n_past, logits_all=True)
            self._ctx.decode(self._batch)
            if self.hook is not None:
                self.hook.raise_pending()
            if self.prompt_logprobs is not None:  # row j predicts the token after it
                self.prompt_rows += [token_logprobs(self, tokens[i + j + 1], self.prompt_logprobs, j)
                                     for j in range(min(n, len(tokens) - i - 1))]
            self.input_ids[n_past: n_past + n] = batch
            self.n_tokens += n
            self._requires_eval = False


QUANTIZED_KV = frozenset(KV_CACHE_TYPES) - {"f32", "f16", "bf16"}
"""Cache types llama.cpp stores in blocks: a V cache of them needs flash attention."""


def check_context(n_ctx: int, flash_attn: bool, type_k: str, type_v: str, n_batch: int | None,
                  n_ubatch: int | None) -> tuple[int, int]:
    """``(n_batch, n_ubatch)`` for a context of ``n_ctx`` tokens (defaults: 512 or ``n_ctx`` where
    smaller; ``n_batch``), each refused in one line where llama.cpp would not take it as given: a
    batch above the context or a physical batch above the logical one (llama.cpp would clamp them), a
    type not in :data:`~expertcache.llama.KV_CACHE_TYPES`, a quantized V cache without flash attention
    (llama.cpp refuses the context)."""
    for opt, name in (("--cache-type-k", type_k), ("--cache-type-v", type_v)):
        if name not in KV_CACHE_TYPES:
            raise ConfigError(f"{opt} {name}: not one of llama.cpp's cache types ({', '.join(KV_CACHE_TYPES)})")
    if type_v in QUANTIZED_KV and not flash_attn:
        raise ConfigError(f"--cache-type-v {type_v}: a quantized V cache needs --flash-attn on (llama.cpp refuses it "
                          "without)")
    n_batch = min(512, n_ctx) if n_batch is None else n_batch
    if n_batch > n_ctx:
        raise ConfigError(f"--batch-size {n_batch}: above the context of {n_ctx} tokens (--ctx)")
    n_ubatch = n_batch if n_ubatch is None else n_ubatch
    if n_ubatch > n_batch:
        raise ConfigError(f"--ubatch-size {n_ubatch}: above --batch-size {n_batch}")
    return n_batch, n_ubatch


@dataclass
class Session:
    """One GGUF in one page-cache mode, ready to complete text (see the module docstring)."""

    geometry: Geometry
    mode: str
    policy: str
    advisor: PageAdvisor
    llama: ObservedLlama
    cache_bytes: int | None
    n_ctx: int
    load_seconds: float
    chat_format_given: bool = False
    warm_up_tokens: int = 0
    """Tokens of the start's warm-up forward (:meth:`warm_up`; 0: none)."""

    @classmethod
    def open(cls, path: str, *, mode: str = "mmap", cache_bytes: int | None = None, policy: str = "lru",
             n_ctx: int | None = None, threads: int = 1, seed: int = 0, chat_format: str | None = None,
             chat_template: str | None = None, where: str = "MODEL", readers: int | None = None,
             routed_experts: bool = False, before_load=None, loading=None, settled=None, flash_attn: bool = False,
             type_k: str = "f16", type_v: str = "f16", n_batch: int | None = None,
             n_ubatch: int | None = None) -> "Session":
        """``before_load``: called once the options are checked and the managed rule compiled, before
        more than its header is read (a following memory wall begins there:
        :func:`~expertcache.wall.capacity.begin_following`, so that the start-up's compiling and
        importing happen before the wall hugs the process); ``loading``: a context manager held
        around llama.cpp's load and the advisor's start (the wall's load phase:
        :func:`~expertcache.wall.capacity.model_load`); ``settled``: with the managed mode, called
        after a warm-up (:meth:`warm_up`) once the load is over (a following wall restarts its
        window of own-memory samples there: :func:`~expertcache.wall.capacity.settled`). ``chat_template``:
        a Jinja chat template in place of the GGUF's own (:attr:`ObservedLlama.chat_template`).
        ``flash_attn``, ``type_k``, ``type_v`` (names of :data:`~expertcache.llama.KV_CACHE_TYPES`),
        ``n_batch`` (default 512, or ``n_ctx`` where smaller; at most ``n_ctx``) and ``n_ubatch`` (default
        ``n_batch``; at most it): llama.cpp's context settings (:func:`check_context`)."""
        if mode not in MODES:
            raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
        g = read_geometry(path, where)
        check_tokenizer(g.metadata, path, template_given=chat_template is not None)
        trained = g.context_length
        if n_ctx is None:
            n_ctx = min(DEFAULT_CTX, trained or DEFAULT_CTX)
        elif trained is not None and n_ctx > trained:  # as vLLM refuses a max_model_len above the model's
            raise ConfigError(f"--ctx {n_ctx}: above the {trained} tokens of context {path} was trained for "
                              f"({g.architecture}.context_length); llama.cpp would allocate its KV cache first")
        n_batch, n_ubatch = check_context(n_ctx, flash_attn, type_k, type_v, n_batch, n_ubatch)
        budget = None
        if cache_bytes is not None and mode != "managed":
            raise ConfigError(f"--cache-memory bounds the managed mode's pool; --mode {mode} leaves residency to "
                              "the kernel (bound it with a --memory-wall)")
        if mode == "managed":
            budget = check_managed(g, cache_bytes, policy)
        formats = llama_cpp.llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers
        if chat_format is not None and (chat_format not in formats or chat_format in NEEDS_HF_TOKENIZER):
            known = ", ".join(sorted(set(formats) - set(NEEDS_HF_TOKENIZER)))
            why = ("needs a Hugging Face tokenizer beside the model (llama-cpp-python's hf_tokenizer_path), which "
                   "expertcache does not load" if chat_format in NEEDS_HF_TOKENIZER else
                   "is not one of llama-cpp-python's formats")
            raise ConfigError(f"--chat-format: {chat_format!r} {why} ({known})")
        _silence(llama_cpp, path)
        if before_load is not None:  # checked and compiled (check_managed); next the advisor reads the file
            before_load()
        advisor = PageAdvisor(g, mode, capacity=budget, policy=policy, count_hits=True,
                              readers=readers_for(mode, readers))
        selfio = OpenProcFile(SELF_IO)  # like the advisor's maps: opened before the load fills the wall
        hook = routing = None
        if advisor.observes_routing or routed_experts:
            hook = EvalHook(llama_cpp)
        if advisor.observes_routing:
            hook.attach(advisor)
        if routed_experts:
            routing = ContextRouting(n_ctx, g.num_layers - len(g.skipped_layers), g.top_k)
            hook.attach(routing)
        if mode == "managed":  # cold: whatever wrote or read the file before leaves no folios of its own
            from ..wall.pagecache import evict_file_pages

            evict_file_pages([g.path])
        with loading if loading is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            try:
                llm = ObservedLlama(g.path, hook=hook, routing=routing, io=selfio, n_ctx=n_ctx, n_batch=n_batch,
                                    n_ubatch=n_ubatch, flash_attn=flash_attn, type_k=KV_CACHE_TYPES[type_k],
                                    type_v=KV_CACHE_TYPES[type_v], n_threads=threads, n_threads_batch=threads,
                                    use_mmap=mode != "nommap", seed=seed, verbose=False, chat_format=chat_format,
                                    chat_template=chat_template)
            except ValueError as exc:  # llama-cpp-python's "Failed to load model from file" and the like
                advisor.close()
                selfio.close()
                if "context" in str(exc):  # the model loaded; its context could not be made with these settings
                    raise ConfigError(f"{where} {path}: llama.cpp could not make its context with --ctx {n_ctx}, "
                                      f"--cache-type-k {type_k}, --cache-type-v {type_v}, --flash-attn "
                                      f"{'on' if flash_attn else 'off'} ({exc}; its model may not take a quantized "
                                      "cache)") from None
                raise ConfigError(f"{where} {path}: llama.cpp could not load it ({exc})") from None
            load_s = time.perf_counter() - t0
            try:
                advisor.start()
            except BaseException:
                llm.close()
                advisor.close()
                raise
        session = cls(g, mode, policy, advisor, llm, budget, n_ctx, load_s, chat_format is not None)
        if mode == "managed" and settled is not None:
            try:
                session.warm_up()
                settled()
            except BaseException:
                session.close()
                raise
        return session

    def context_settings(self) -> dict:
        """llama.cpp's context settings this session runs with (:meth:`open`'s)."""
        p = self.llama.context_params
        types = {v: k for k, v in KV_CACHE_TYPES.items()}
        flash = "on" if p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED else "off"
        return {"flash_attn": flash, "cache_type_k": types.get(p.type_k), "cache_type_v": types.get(p.type_v),
                "n_batch": p.n_batch, "n_ubatch": p.n_ubatch}

    def warm_up(self) -> int:
        """One forward of a full batch through the managed pool, then forgotten: the context emptied,
        the pool emptied and its counts reset (:meth:`PageAdvisor.restart`), the forward counters
        zeroed. A first forward touches llama.cpp's compute buffers (the largest batch touches the
        most); done before the pool fills, a following wall's limit has counted them by the time it
        does, as ``llama run --mode managed`` does with its prompt (docs/robustness.md). The tokens
        are ids ``0, 1, 2, ...``: what they route does not matter, since the pool is emptied after.
        Returns how many tokens it ran."""
        llm = self.llama
        n = max(1, min(llm.n_batch, self.n_ctx - 1))
        llm.reset()
        llm.eval([i % llm.n_vocab() for i in range(n)])
        llm.reset()
        for key, value in llm.stats.items():
            llm.stats[key] = type(value)(0)
        self.advisor.restart()
        self.warm_up_tokens = n
        return n

    @property
    def chat_ready(self) -> bool:
        """Whether chats can be formatted: the GGUF carries ``tokenizer.chat_template``, or a
        ``chat_format`` of llama-cpp-python's was named (llama-cpp-python would otherwise fall back
        to llama-2's format silently)."""
        return self.chat_format_given or "tokenizer.chat_template" in self.llama.metadata

    def check_chat(self) -> None:
        if not self.chat_ready:
            raise ConfigError(f"{self.geometry.path} has no chat template (tokenizer.chat_template): use a plain "
                              "prompt, or name one of llama-cpp-python's formats with --chat-format (e.g. chatml)")

    def tokenize(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def snapshot(self) -> dict:
        """Cumulative counters now: the forwards (:attr:`ObservedLlama.stats`), this process's own read
        bytes and major faults, the mode's expert hits and misses (None where it does not observe
        the routing)."""
        io = io_counters(self.llama.io)
        hits, misses = self.advisor.hit_counts()  # moves nothing: /metrics calls this beside the decode
        return {**self.llama.stats, "read_bytes": io["read_bytes"], "major_faults": io["major_faults"],
                "expert_hits": hits, "expert_misses": misses}

    def close(self) -> None:
        self.llama.close()
        self.advisor.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


NEEDS_HF_TOKENIZER = ("functionary-v1", "functionary-v2")
"""llama-cpp-python chat formats whose handler asserts an HF tokenizer was given to ``Llama`` (every
chat was a 500 in serve, exit 70 in generate)."""


def completion_kwargs(max_tokens: int, temperature: float, top_p: float, seed: int | None,
                      top_k: int | None = None) -> dict:
    """Sampling arguments of ``Llama.create_completion``: temperature 0 is greedy (top-1 whatever
    ``top_k`` says); else ``top_k`` (None or 0: off)."""
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
            "top_k": (top_k or 0) if temperature > 0 else 1, "repeat_penalty": 1.0}


def stream_text(session: Session, *, prompt: str | None = None, messages: list | None = None, max_tokens: int = 64,
                temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, grammar=None, top_k: int = 0,
                min_p: float = 0.05, repeat_penalty: float = 1.0):
    """Yield the generated text piece by piece (``prompt``: a completion; ``messages``: a chat with
    the model's template; ``grammar``: a ``LlamaGrammar`` the tokens keep to,
    :func:`~.constraints.response_grammar`; ``top_k`` (0: off), ``min_p``, ``repeat_penalty``:
    llama.cpp's, as the server takes them), then a final ``dict``: :func:`request_figures`, ``finish_reason``,
    ``prompt_tokens``, ``completion_tokens`` (sampled; an end-of-generation token not counted),
    ``ttft_seconds`` (call to first piece) and ``stream_seconds`` (first piece to last)."""
    llm = session.llama
    kw = completion_kwargs(max_tokens, temperature, top_p, seed, top_k)
    kw.update(min_p=min_p, repeat_penalty=repeat_penalty)
    if grammar is not None:
        kw["grammar"] = grammar
    before = session.snapshot()
    sampled0 = llm.sampled
    t0 = time.perf_counter()
    first = last = finish = None
    chunks = stream_chat(llm, messages, **kw) if messages is not None else stream_completion(llm, prompt, **kw)
    for chunk in chunks:
        choice = chunk["choices"][0]
        piece = choice["delta"].get("content") if messages is not None else choice.get("text")
        finish = choice.get("finish_reason") or finish
        if piece:
            last = time.perf_counter()
            first = last if first is None else first
            yield piece
    out = request_figures(before, session.snapshot())
    sampled = llm.sampled - sampled0
    out.update(ttft_seconds=(first - t0) if first is not None else None, finish_reason=finish,
               context_tokens=llm.n_tokens, prompt_tokens=llm.prompt_length,
               completion_tokens=sampled - (1 if sampled and llm.last_sampled_is_eog else 0),
               stream_seconds=(last - first) if first is not None else None)
    yield out


def request_figures(before: dict, after: dict) -> dict:
    """One request's figures from two :meth:`Session.snapshot`: ``prefill_tokens`` (evaluated; a
    prefix cached from the previous request is not), ``prefill_tokens_per_s``, ``decode_steps``,
    ``decode_tokens_per_s`` (decode steps / their forwards' seconds), ``read_bytes`` (this process's
    own), ``major_faults``, ``expert_hits``, ``expert_misses``."""
    d = {k: _delta(before, after, k) for k in ("prefill_tokens", "prefill_seconds", "decode_steps", "decode_seconds",
                                                "read_bytes", "major_faults", "expert_hits", "expert_misses")}
    d["prefill_tokens_per_s"] = d["prefill_tokens"] / d["prefill_seconds"] if d["prefill_seconds"] else None
    d["decode_tokens_per_s"] = d["decode_steps"] / d["decode_seconds"] if d["decode_seconds"] else None
    return d


def _delta(a: dict, b: dict, key: str):
    return b[key] - a[key] if a.get(key) is not None and b.get(key) is not None else None


def check_tokenizer(meta: dict, path: str, template_given: bool = False) -> None:
    """Refuse, in one line, a GGUF without a tokenizer where text goes in or out: llama.cpp asserts
    on it (an abort that ends the process) the first time it tokenizes or detokenizes; and one whose
    chat template does not compile (but its default one where ``template_given``: it is replaced)."""
    if not meta.get("tokenizer.ggml.model") or not meta.get("tokenizer.ggml.tokens"):
        raise ConfigError(f"MODEL {path}: has no tokenizer (no tokenizer.ggml.model / tokens in its metadata): "
                          "convert it with the checkpoint's tokenizer files beside config.json, or give token ids "
                          "(llama run --tokens IDS.npy)")
    for key, value in meta.items():  # llama-cpp-python compiles these when it loads the model, prompt or chat
        if template_given and key == "tokenizer.chat_template":
            continue
        problem = chat_template_problem(value) if key.startswith("tokenizer.chat_template") and isinstance(
            value, str) else None
        if problem:
            instead = (" (serve and llama generate take --chat-template-file PATH in its place)"
                       if key == "tokenizer.chat_template" else "")
            raise ConfigError(f"MODEL {path}: its {key} is not a template Jinja compiles ({problem}); "
                              f"llama-cpp-python compiles it at load: write the GGUF again with a valid one, or "
                              f"none{instead}")


@contextlib.contextmanager
def _vocabulary(path: str):
    """The model's vocabulary alone (``Llama(vocab_only=True)``: no weight is loaded)."""
    check_tokenizer(read_header(path, "MODEL")[0], path)
    _silence(llama_cpp, path)
    try:
        vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    except ValueError as exc:
        raise ConfigError(f"MODEL {path}: llama.cpp could not read its vocabulary ({exc})") from None
    try:
        yield vocab
    finally:
        vocab.close()


def tokenize(path: str, text: str, where: str = "--prompt") -> list[int]:
    """``text`` as the model's own token ids (its BOS first where its vocabulary adds one)."""
    with _vocabulary(path) as vocab:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    if not ids:
        raise ConfigError(f"{where}: the text is empty")
    return ids


def detokenize_file(path: str, ids) -> str:
    """Token ids of the model at ``path`` as text (invalid UTF-8 replaced)."""
    with _vocabulary(path) as vocab:
        return token_bytes(vocab._model.vocab, ids).decode("utf-8", errors="replace")
