"""Teacher-forced passes over token sequences, one row or a batch of rows at a time: NLL and time.

A *batch* is a ``[b, n]`` array of b sequences of equal length n, served together (one forward per
token position in ``decode`` mode, one forward in ``forward`` mode). NLL is summed over every
predicted position of every row (a row of n tokens predicts n - 1); ``tokens`` counts every
position of every row; ``steps`` counts token positions (n per batch: one cache step per offloaded
layer each). Time: a :class:`~.timing.Stopwatch` around each forward (CUDA events on the current
stream of the model's device, ``perf_counter`` on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import ConfigError, is_int
from .model import cache_argument, model_device, text_config
from .timing import Stopwatch

MODES = ("decode", "forward")


@dataclass
class PassResult:
    """NLL and time of one pass over the batches."""

    nll_sum: float
    predictions: int
    tokens: int
    seconds: float
    steps: int = 0
    seq_nll: tuple = ()
    """Each sequence's summed NLL, in batch-row order (the order of the sequences evaluated)."""
    seq_predictions: tuple = ()
    """Each sequence's predicted tokens (its length - 1), in the same order."""

    @property
    def nll(self) -> float:
        return self.nll_sum / self.predictions if self.predictions else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ms_per_step(self) -> float:
        """Milliseconds per token position (a decode step: one token of each row of the batch)."""
        return 1000.0 * self.seconds / self.steps if self.steps else float("nan")


def run_pass(model: torch.nn.Module, batches: Sequence[np.ndarray], mode: str, progress=None) -> PassResult:
    """Teacher-force every batch (``[n]`` or ``[b, n]`` token ids; ``decode``: one token position per
    forward with a KV cache; ``forward``: one forward per batch) and return NLL and timed seconds."""
    device = model_device(model)
    watch = Stopwatch(device)
    nll_sum, predictions, tokens, steps = 0.0, 0, 0, 0
    seq_nll, seq_pred = [], []
    with torch.inference_mode():
        for ids in batches:
            x = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=device)
            x = x[None] if x.dim() == 1 else x
            if mode == "forward":
                with watch.time():
                    logits = model(input_ids=x, use_cache=False).logits
            else:
                logits = _decode(model, x, watch)
            b, n = x.shape
            if n > 1:
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                picked = -logp.gather(2, x[:, 1:, None])
                nll_sum += float(picked.sum())  # summed as one tensor, as always (the same bits)
                seq_nll.extend(float(v) for v in picked.sum(dim=(1, 2)))
            else:
                seq_nll.extend([0.0] * b)
            seq_pred.extend([n - 1] * b)
            predictions += b * (n - 1)
            tokens += b * n
            steps += n
            if progress is not None:  # the caller's bar (it closes it)
                progress.update(b)
    return PassResult(nll_sum, predictions, tokens, watch.seconds, steps, tuple(seq_nll), tuple(seq_pred))


def _decode(model: torch.nn.Module, x: torch.Tensor, watch: Stopwatch) -> torch.Tensor:
    key = cache_argument(model)
    cache, rows = None, []
    for i in range(x.shape[1]):
        with watch.time():
            out = model(input_ids=x[:, i : i + 1], use_cache=True, **{key: cache})
        cache = out["cache"] if "cache" in out else out.get("past_key_values")
        rows.append(out.logits[:, -1])
    return torch.stack(rows, dim=1)


# ---------------------------------------------------------------------- inputs
def check_sequences(sequences: Sequence[Sequence[int]], vocab: int | None) -> list[np.ndarray]:
    """Validate token sequences: at least one, each >= 2 ids, ids in ``[0, vocab)``."""
    out = []
    for i, s in enumerate(sequences):
        a = np.asarray(s)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ConfigError(f"sequence {i}: expected a 1-d array of integer token ids, got {a.dtype} {a.shape}")
        if a.size < 2:
            raise ConfigError(f"sequence {i}: needs at least 2 tokens to predict one, got {a.size}")
        if vocab is not None and (a.min() < 0 or a.max() >= vocab):
            bad = int(a[(a < 0) | (a >= vocab)][0])
            raise ConfigError(f"sequence {i}: token id {bad} is outside the model's vocabulary [0, {vocab})")
        out.append(a.astype(np.int64))
    if not out:
        raise ConfigError("no sequences to evaluate")
    return out


def make_batches(sequences: Sequence[np.ndarray], batch: int) -> tuple[list[np.ndarray], int]:
    """Consecutive sequences grouped ``batch`` at a time into ``[batch, n]`` arrays of equal length n.

    Returns the batches and how many trailing sequences were left out (a last group smaller than
    ``batch``, or a group whose lengths differ, whose shorter rows cannot share a step with the
    others). ``batch = 1`` keeps every sequence.
    """
    if batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    out, i = [], 0
    while i + batch <= len(sequences):
        group = sequences[i : i + batch]
        n = min(len(s) for s in group)
        if any(len(s) != n for s in group):
            break
        out.append(np.stack(group))
        i += batch
    if not out:
        raise ConfigError(
            f"batch {batch}: the first {batch} sequences do not form a batch of equal-length rows "
            f"({len(sequences)} sequence(s) of lengths {sorted({len(s) for s in sequences[:batch]})})"
        )
    return out, len(sequences) - i


def split_tokens(ids: np.ndarray, max_len: int, max_sequences: int | None = None,
                 context: int | None = None) -> list[np.ndarray]:
    """Sequences from token ids: a 1-d stream is cut into chunks of ``max_len`` (a last chunk shorter
    than 2 tokens is dropped); each row of a 2-d array is one sequence, truncated to ``max_len``.
    ``context`` (the model's positions, :func:`positions`): a longer sequence is refused (its later
    tokens would sit at positions the model was never trained for)."""
    ids = np.asarray(ids)
    if max_len < 2:
        raise ConfigError(f"max-len must be at least 2, got {max_len}")
    if ids.ndim == 1:
        seqs = [ids[i : i + max_len] for i in range(0, ids.size, max_len)]
        seqs = [s for s in seqs if s.size >= 2]
    elif ids.ndim == 2:
        if ids.shape[1] < 2:  # as a 1-d stream's last chunk: a sequence of fewer than 2 tokens is nothing to route
            raise ConfigError(f"token ids: rows of {ids.shape[1]} token(s); a sequence needs at least 2")
        seqs = [row[:max_len] for row in ids]
    else:
        raise ConfigError(f"token ids: expected a 1-d stream or a 2-d [sequences, tokens] array, got shape {ids.shape}")
    if max_sequences is not None:
        seqs = seqs[:max_sequences]
    longest = max((s.size for s in seqs), default=0)
    if context is not None and longest > context:
        raise ConfigError(f"a sequence of {longest} tokens is longer than the model's {context} positions "
                          "(max_position_embeddings); lower --max-len")
    return seqs


def positions(model) -> int | None:
    """The model's trained positions (``max_position_embeddings`` of its text config), if it says."""
    n = getattr(text_config(getattr(model, "config", None)), "max_position_embeddings", None)
    return n if is_int(n, 1) else None


def vocab_size(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.num_embeddings) if emb is not None and hasattr(emb, "num_embeddings") else None

