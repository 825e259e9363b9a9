"""Model-side signals a capture records on request (``capture(model, record="token-ids,next-top:8,hidden:16")``).

Per trace row (one token position of a batch-1 forward), as trace extras (validated at load by
:mod:`expertcache.trace.model_signals`, which documents them):

* ``token-ids`` -> ``token_ids`` int64 ``[T]``: the input token id of the position;
* ``next-top:M`` -> ``next_top_ids`` int64 ``[T, M]`` and ``next_top_probs`` float32 ``[T, M]``: the
  M most likely next tokens under the model's output softmax at the position (``torch.topk`` of the
  logits, largest first) and their probabilities;
* ``hidden:D`` -> ``hidden_summary`` float16 ``[T, D]``: the final hidden state (the input of the
  output embedding, after the final norm) times a fixed random projection
  ``R = N(0, 1)^{H x D} / sqrt(H)`` drawn by ``numpy.random.default_rng(seed)`` (H the hidden size;
  seed 0 unless given: ``hidden:D:SEED``), clamped to the float16 range.

The signals are read at the output embedding (a pre-hook for the hidden state, a hook for the
logits) and at the top-level forward (the input ids), reduced on the device (top-M, projection) and
kept there until the trace is built. Invariant: each recorded forward gives one signal row per
position it routes; a forward whose logits cover fewer positions (``generate``'s prefill computes
the last one only) cannot be kept with ``next-top`` / ``hidden``: one ConfigError line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError

MAX_TOP = 64
MAX_DIMS = 256


@dataclass(frozen=True)
class SignalSpec:
    """Which signals to record: ``token_ids``; ``top`` (M, 0 = none); ``dims`` (D, 0 = none), ``seed``."""

    token_ids: bool = False
    top: int = 0
    dims: int = 0
    seed: int = 0

    @property
    def any(self) -> bool:
        return self.token_ids or self.top > 0 or self.dims > 0

    def describe(self) -> dict:
        out: dict = {}
        if self.token_ids:
            out["token_ids"] = "input token id of the row"
        if self.top:
            out["next_top"] = {"m": self.top, "of": "softmax of the output logits at the row, top-m, largest first"}
        if self.dims:
            out["hidden_summary"] = {"dims": self.dims, "seed": self.seed, "dtype": "float16",
                                     "projection": "final hidden state @ N(0,1)[H,D]/sqrt(H), numpy default_rng(seed)"}
        return out


def parse_record(text: str | None, option: str = "--record") -> SignalSpec:
    """``token-ids,next-top:M,hidden:D[:SEED]`` (any subset, any order) -> :class:`SignalSpec`; text
    or ``None`` (a Python caller's ``record=True`` had ended as AttributeError)."""
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"{option}: expected text such as 'token-ids,next-top:8' or a SignalSpec, got "
                          f"{type(text).__name__}")
    if text is None or not text.strip():
        return SignalSpec()
    tok, top, dims, seed = False, 0, 0, 0
    seen: set[str] = set()
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, _, rest = part.partition(":")
        if name in seen:  # "next-top:2,next-top:3" kept the last one without a word
            raise ConfigError(f"{option}: {name} is given twice ({text.strip()!r}); give each signal once")
        seen.add(name)
        if name == "token-ids" and not rest:
            tok = True
        elif name == "next-top":
            top = _count(rest or "8", 1, MAX_TOP, option, part)
        elif name == "hidden":
            d, _, s = (rest or "16").partition(":")
            dims = _count(d, 1, MAX_DIMS, option, part)
            seed = _count(s, 0, 2**32 - 1, option, part) if s else 0
        else:
            raise ConfigError(f"{option}: cannot read {part!r} (expected token-ids, next-top:M, hidden:D[:SEED])")
    return SignalSpec(tok, top, dims, seed)


def _count(text: str, lo: int, hi: int, option: str, part: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise ConfigError(f"{option}: {part!r}: expected an integer after ':'") from None
    if not lo <= x <= hi:
        raise ConfigError(f"{option}: {part!r}: {x} is outside [{lo}, {hi}]")
    return x


def projection(hidden_size: int, dims: int, seed: int) -> np.ndarray:
    """float32 ``[hidden_size, dims]``: the fixed random projection of ``hidden_summary``."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hidden_size, dims)) / np.sqrt(hidden_size)).astype(np.float32)


class SignalHooks:
    """Hooks that add the signals of :class:`SignalSpec` to each recorded forward's ``signals`` dict.

    ``current()`` returns that dict for the forward under way (the capture's latest forward)."""

    def __init__(self, model: torch.nn.Module, spec: SignalSpec, current):
        self.model, self.spec, self.current = model, spec, current
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if (spec.top or spec.dims) and self.head is None:
            raise ConfigError(f"capture: record: {type(model).__name__} has no output embedding to read next-top / hidden from")
        vocab = getattr(getattr(self.head, "weight", None), "shape", (None,))[0]
        if spec.top and isinstance(vocab, int) and spec.top > vocab:  # the arrays would hold vocab columns, meta M
            raise ConfigError(f"--record next-top:{spec.top}: more than the model's vocabulary of {vocab} tokens")
        self._proj: torch.Tensor | None = None

    def register(self) -> list:
        hooks = []
        if self.spec.top or self.spec.dims:
            hooks.append(self.head.register_forward_pre_hook(self._on_head_input))
            if self.spec.top:
                hooks.append(self.head.register_forward_hook(self._on_logits))
        return hooks

    def on_forward(self, args, kwargs) -> None:
        """Called by the capture's top-level pre-hook: the input ids of the forward."""
        if not self.spec.token_ids:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        if ids is None:
            raise ConfigError("capture: record token-ids: the forward was given no input_ids (inputs_embeds only)")
        self.current()["token_ids"] = ids.detach().reshape(-1).clone()

    def _on_head_input(self, module, args):
        if not self.spec.dims:
            return
        h = args[0].detach()
        h = h.reshape(-1, h.shape[-1])
        if self._proj is None or self._proj.device != h.device:
            self._proj = torch.from_numpy(projection(h.shape[-1], self.spec.dims, self.spec.seed)).to(h.device)
        s = (h.float() @ self._proj).clamp(-65504.0, 65504.0)
        self.current()["hidden_summary"] = s

    def _on_logits(self, module, args, output):
        logits = output.detach().float()
        logits = logits.reshape(-1, logits.shape[-1])
        m = min(self.spec.top, logits.shape[-1])
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, m, dim=-1)
        rec = self.current()
        rec["next_top_ids"], rec["next_top_probs"] = top.indices, top.values


def stack_signals(forwards, spec: SignalSpec, positions: list[int]) -> dict[str, np.ndarray]:
    """The extras of the kept forwards (``positions[i]`` rows each), in row order; ConfigError when a
    forward lacks a signal or recorded another number of positions."""
    names = (["token_ids"] if spec.token_ids else []) + (["next_top_ids", "next_top_probs"] if spec.top else []) \
        + (["hidden_summary"] if spec.dims else [])
    out: dict[str, list] = {n: [] for n in names}
    for f, n in zip(forwards, positions):
        for name in names:
            a = f.signals.get(name)
            if a is None:
                raise ConfigError(f"capture: record: a forward did not record {name} (no input ids or no output head)")
            if a.shape[0] != n:
                raise ConfigError(f"capture: record: a forward has {a.shape[0]} {name} rows for {n} positions "
                                  "(logits of the last position only, as generate's prefill? record decode steps only)")
            out[name].append(a.to("cpu"))
    dtypes = {"token_ids": np.int64, "next_top_ids": np.int64, "next_top_probs": np.float32,
              "hidden_summary": np.float16}
    return {n: torch.cat(v).numpy().astype(dtypes[n]) for n, v in out.items()}
