"""Router traces from llama.cpp: the experts each MoE layer selects, read in the eval callback.

llama.cpp names the selected experts of layer N ``ffn_moe_topk-N``: an int32 view ``[k, n_tokens]``
(row stride E) of the argsort of the router probabilities, best first, so the order equals the
Hugging Face router's ``topk`` order. The gate weights the experts' outputs are multiplied by are
the last of ``ffn_moe_weights-N``, ``ffn_moe_weights_softmax-N``, ``ffn_moe_weights_norm-N``,
``ffn_moe_weights_scaled-N`` the graph computes (graph order is evaluation order).

:class:`RoutingRecorder` is the observer: one :class:`Forward` per ``llama_decode``, the rows of
each layer in token order. :class:`LlamaCapture` turns the forwards into a canonical
:class:`~expertcache.Trace` with the Hugging Face capture's phase rules (``auto``: decode steps
only if any was seen; ``decode``; ``all``). Invariant: a forward whose rows are kept was computed
with every row's logits, otherwise llama.cpp's last layer routed only the last row and the trace
would be short there; such a forward in a kept phase is refused, never silently padded. The one
exception is asked for and flagged: ``keep_prompt`` keeps each generation's prompt forward as
llama.cpp routed it, the rows its last layer did not route being -1 there, and every prompt row
flagged 1 in ``extras["prefill"]`` (what a run's prefill reads, kept apart from the decode steps).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..formats.gguf import read_geometry
from ..trace import Trace
from .engine import MAX_CONTEXT, Engine
from .ggml import read_2d

PHASES = ("auto", "decode", "all")
_TOPK = b"ffn_moe_topk-"
_WEIGHTS = (b"ffn_moe_weights-", b"ffn_moe_weights_softmax-", b"ffn_moe_weights_norm-", b"ffn_moe_weights_scaled-")


def layer_of(name: bytes, prefixes) -> int | None:
    """N of ``<prefix>N`` for one of ``prefixes``; None for other names (views carry a suffix)."""
    for p in prefixes:
        if name.startswith(p) and name[len(p):].isdigit():
            return int(name[len(p):])
    return None


@dataclass
class Forward:
    """What one forward routed: per layer ``[rows, k]`` experts (int64) and gate weights. llama.cpp
    computes a forward longer than its micro-batch as several graphs: each graph's rows follow the
    earlier ones (``parts``: per layer, one array per graph)."""

    n_tokens: int
    starts_sequence: bool
    all_logits: bool
    expert_parts: dict[int, list] = field(default_factory=dict)
    weight_parts: dict[int, list] = field(default_factory=dict)

    def add_experts(self, layer: int, rows: np.ndarray) -> None:
        self.expert_parts.setdefault(layer, []).append(rows)

    def add_weights(self, layer: int, rows: np.ndarray) -> None:
        """The gate weights of the layer's current graph: a later weights tensor of the same graph
        (normalized, scaled) replaces the earlier one."""
        parts = self.weight_parts.setdefault(layer, [])
        if len(parts) == len(self.expert_parts.get(layer, ())) and parts:
            parts[-1] = rows
        else:
            parts.append(rows)

    @property
    def experts(self) -> dict[int, np.ndarray]:
        return {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in self.expert_parts.items()}

    @property
    def weights(self) -> dict[int, np.ndarray]:
        return {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in self.weight_parts.items()}


class RoutingRecorder:
    """The engine observer that keeps every forward's routing (see the module docstring)."""

    def __init__(self, weights: bool = True):
        self.forwards: list[Forward] = []
        self.keep_weights = weights
        self.prefixes = (_TOPK, *_WEIGHTS) if weights else (_TOPK,)

    def begin(self, n_tokens: int, starts_sequence: bool, all_logits: bool) -> None:
        self.forwards.append(Forward(n_tokens, starts_sequence, all_logits))

    def wants(self, name: bytes) -> bool:
        return layer_of(name, (_TOPK,)) is not None or (self.keep_weights and layer_of(name, _WEIGHTS) is not None)

    def seen(self, name: bytes, ptr: int) -> None:
        if not self.forwards:
            return  # outside a forward the engine started (nothing of ours)
        f = self.forwards[-1]
        layer = layer_of(name, (_TOPK,))
        if layer is not None:
            f.add_experts(layer, read_2d(ptr, np.int32).astype(np.int64))
            return
        layer = layer_of(name, _WEIGHTS)
        if layer is not None:
            f.add_weights(layer, read_2d(ptr, np.float32, drop_leading_one=True))


class ContextRouting:
    """The engine observer behind a server's ``return_routed_experts``: the experts every position of
    the context routed, per decoder layer, kept as long as the position stays in the KV cache.

    ``rows[p, l]`` holds the ``top_k`` experts position ``p`` routed in layer ``l`` (every decoder
    layer the main graph runs: a dense layer's rows stay 0, as SGLang and vLLM write them). The
    model sets :attr:`n_past` before each forward; a forward's rows land at ``n_past`` onwards in
    token order (a forward longer than the micro-batch is several graphs, each continuing where the
    last ended). Invariant: the forward computed every row's logits (``ObservedLlama``'s
    ``all_rows``), else llama.cpp's last layer routes only the last row and its other rows would
    keep stale ids; such a forward raises instead. A prefix llama-cpp-python reuses from the
    previous prompt keeps the rows it routed then (the same weights, the same tokens, the same
    positions: the same routing, as SGLang's cached prefixes do)."""

    def __init__(self, n_ctx: int, num_layers: int, top_k: int):
        self.rows = np.zeros((n_ctx, num_layers, top_k), dtype=np.int32)
        self.n_past = 0
        self.prefixes = (_TOPK,)
        self._next: dict[int, int] = {}
        self._all_rows = True

    def begin(self, n_tokens: int, starts_sequence: bool, all_logits: bool) -> None:
        self._next, self._all_rows = {}, all_logits or n_tokens == 1

    def wants(self, name: bytes) -> bool:
        return layer_of(name, (_TOPK,)) is not None

    def seen(self, name: bytes, ptr: int) -> None:
        layer = layer_of(name, (_TOPK,))
        if layer is None or layer >= self.rows.shape[1]:
            return
        if not self._all_rows:
            raise ConfigError("routed experts: a forward computed only its last row's logits, so the last "
                              "layer routed 1 of its rows")
        ids = read_2d(ptr, np.int32)
        at = self._next.get(layer, self.n_past)
        if ids.shape[1] != self.rows.shape[2] or at + len(ids) > len(self.rows):
            raise ConfigError(f"routed experts: layer {layer} routed {ids.shape} at position {at}, outside "
                              f"the context's {self.rows.shape}")
        self.rows[at:at + len(ids), layer] = ids
        self._next[layer] = at + len(ids)

    def since(self, start: int, end: int) -> np.ndarray:
        """Rows ``[start, end)``: ``[end - start, num_layers, top_k]`` int32 (a copy)."""
        return self.rows[start:end].copy()


class LlamaCapture:
    """``with LlamaCapture(engine) as cap: ...`` then ``cap.trace`` (phase rules in the module docstring)."""

    def __init__(self, engine, *, phase: str = "auto", label: str | None = None, keep_prompt: bool = False):
        if phase not in PHASES:
            raise ConfigError(f"phase: {phase!r} is not one of {', '.join(PHASES)}")
        self.engine, self.phase, self.label, self.keep_prompt = engine, phase, label, keep_prompt
        self.recorder = RoutingRecorder()

    def __enter__(self) -> "LlamaCapture":
        self.engine.attach(self.recorder)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.detach(self.recorder)

    @property
    def trace(self) -> Trace:
        g = self.engine.geometry
        forwards = [f for f in self.recorder.forwards if f.expert_parts]
        saw_decode = any(not f.starts_sequence for f in forwards)
        decode_only = self.phase == "decode" or (self.phase == "auto" and saw_decode)
        prompts = self.keep_prompt and decode_only  # the prompts kept too, their rows flagged (extras["prefill"])
        kept = {id(f) for f in forwards if prompts or not (decode_only and f.starts_sequence)}
        if not kept:
            raise ConfigError("capture: no positions recorded" + (" (decode steps only are kept)" if decode_only else ""))
        layers = g.moe_layers
        seq, experts, weights, flags, s = [], [], [], [], -1
        for f in forwards:
            s += f.starts_sequence
            if id(f) not in kept:
                continue
            partial = f.n_tokens > 1 and not f.all_logits
            if partial and not (prompts and f.starts_sequence):
                raise ConfigError("capture: a forward computed only its last row's logits, so llama.cpp's last "
                                  "layer routed 1 of its rows; forward with logits='all'")
            fe, fw = f.experts, f.weights
            missing = [lid for lid in layers if lid not in fe]
            if missing:
                raise ConfigError(f"capture: a forward did not reach MoE layer {missing[0]}")
            if partial:  # a layer that routed only the output rows (llama.cpp's last): the others are -1
                fe = {lid: _pad_rows(a, f.n_tokens, -1) for lid, a in fe.items()}
                fw = {lid: _pad_rows(a, f.n_tokens, 0.0) for lid, a in fw.items()}
            experts.append(np.stack([fe[lid] for lid in layers], axis=1))
            have_w = all(lid in fw for lid in layers)
            weights.append(np.stack([fw[lid] for lid in layers], axis=1) if have_w else None)
            seq.append(np.full(f.n_tokens, max(s, 0), dtype=np.int64))
            flags.append(np.full(f.n_tokens, bool(prompts and f.starts_sequence), dtype=np.uint8))
        probs = np.concatenate(weights).astype(np.float32) if all(w is not None for w in weights) else None
        phase = self.label or ("mixed" if prompts else "decode" if decode_only else "mixed" if saw_decode
                               else "teacher-forced")
        meta = {"model": g.path, "model_type": g.architecture, "num_experts": g.num_experts, "layer_ids": layers,
                "phase": phase, "engine": "llama.cpp", "gguf": g.path, "layer_expert_bytes": g.layer_expert_bytes,
                "provenance": {"tool": "expertcache.llama.capture", "llama_cpp_python": self.engine.bindings,
                               "python": platform.python_version(),
                               "prefill": ("flagged (extras: prefill)" if prompts else
                                           "excluded" if decode_only else "included"),
                               "source": "eval callback: ffn_moe_topk (experts), ffn_moe_weights* (gate weights)"}}
        if g.uniform_expert_bytes is not None:  # one size: the sizing commands' units (else they ask for it)
            meta["expert_bytes"] = g.uniform_expert_bytes
        extras = {"prefill": np.concatenate(flags)} if prompts else None
        return Trace.from_arrays(np.concatenate(experts), np.concatenate(seq), probs=probs, meta=meta, extras=extras,
                                 source=f"<llama.cpp capture of {g.path}>")


def _pad_rows(rows: np.ndarray, n: int, fill) -> np.ndarray:
    """``rows`` (the last rows of an ``n``-row forward) preceded by rows of ``fill``."""
    if rows.shape[0] >= n:
        return rows
    return np.concatenate([np.full((n - rows.shape[0], *rows.shape[1:]), fill, dtype=rows.dtype), rows])


def sequences(ids: np.ndarray, max_len: int, max_sequences: int | None) -> list[np.ndarray]:
    """Rows of a 2-d id array, or ``max_len`` chunks of a 1-d stream (chunks under 2 ids dropped)."""
    ids = np.asarray(ids)
    if ids.ndim not in (1, 2):
        raise ConfigError(f"token ids: expected a 1-d stream or a 2-d [sequences, tokens] array, got shape {ids.shape}")
    rows = [r[:max_len] for r in ids] if ids.ndim == 2 else [ids[i:i + max_len] for i in range(0, ids.size, max_len)]
    return [r for r in rows if r.size >= 2][:max_sequences]


def capture_gguf(path: str, ids: np.ndarray, *, max_len: int = 384, max_sequences: int | None = None,
                 generate: int = 0, threads: int = 1, keep_prompt: bool = False) -> Trace:
    """Teacher-force each sequence (every row's logits, so every row routes in every layer), or with
    ``generate`` > 0 greedy-decode that many tokens after each sequence and keep the decode steps;
    ``keep_prompt`` (with ``generate``) keeps each prompt's forward too, as llama.cpp routed it (the
    last MoE layer routes only the output row: the others are -1 there), its rows flagged 1 in
    ``extras["prefill"]`` (``size --trace`` warms the managed pool with them, as a run's prefill does)."""
    seqs = sequences(ids, max_len, max_sequences)
    if not seqs:
        raise ConfigError("no sequence of at least 2 tokens to capture")
    if generate == 1:  # the prompt's forward gives the first new token; decode steps are the ones after it
        raise ConfigError("--generate 1: no decode step to capture (the first new token comes from the prompt's "
                          "forward); give at least 2")
    need = max(s.size for s in seqs) + max(generate, 0)
    g = read_geometry(path)
    trained = g.context_length
    limit = MAX_CONTEXT if trained is None else min(MAX_CONTEXT, trained)
    if need > limit:  # llama.cpp's context size is 32-bit; beyond the trained positions nothing was learned
        gen = f" and --generate {generate}" if generate > 0 else ""
        raise ConfigError(f"a sequence of {max(s.size for s in seqs)} tokens{gen} needs a context of {need:,} tokens, "
                          f"more than {limit:,}" + (
                              f" (the model's {g.architecture}.context_length)" if limit == trained else ""))
    with Engine(path, n_ctx=max(need, 8), threads=threads, geometry=g) as eng, LlamaCapture(eng, keep_prompt=keep_prompt) as cap:
        for s in seqs:
            if generate > 0:
                eng.generate(s, generate)
            else:
                eng.reset()
                eng.forward(s, logits="all")
        return cap.trace
