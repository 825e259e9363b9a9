"""Teacher-forced evaluation of offloaded policies: NLL, tokens/s, copies, and the exactness check.

Protocol (the seeds' harness): batch 1, every sequence teacher-forced, each policy's pools empty at
the start of every sequence.

1. *Reference pass*, every expert resident (the stock model): next-token NLL and tokens/s, and a
   capture of every position's router decisions (the trace ``--capture`` saves, and the recorded
   future the clairvoyant policies read).
2. *One pass per policy* under :func:`~expertcache.offload.offload`: NLL, tokens/s, copies (fill
   and steady, per layer), copy time, and a capture of what the live run requested.

Checks, per policy: ``exact`` = ``|nll - nll_reference| <= tolerance`` (5e-3): every policy here is
lossless, so a miss is a bug and :meth:`Evaluation.check` raises; ``replay_agrees`` = the live copy
counts equal :func:`expertcache.replay` of the live capture with the same policy, capacity and layers,
layer by layer.

Modes: ``decode`` feeds one token per forward with a KV cache (the seeds' token-by-token decoding;
tokens/s is decode throughput); ``forward`` runs one forward per sequence, in which each offloaded
layer still steps its cache one token at a time (see :mod:`.experts`), so both modes make the same
copies. Timing: CUDA events on a GPU, ``perf_counter`` on the CPU, around each forward; one
untimed warm-up forward runs before each pass. NLL is the mean over all predicted positions
(a sequence of n tokens predicts n - 1); ``tokens`` counts every position served (n per sequence),
the T of ``copies_per_token``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from ..errors import ConfigError, ExpertcacheError
from ..policies import make_policy
from ..sim import replay
from ..trace import Trace
from .recorder import Capture
from .model import cache_argument
from .run import OffloadRun, OffloadStats
from .timing import Stopwatch

MODES = ("decode", "forward")
TOLERANCE = 5e-3
WARMUP_TOKENS = 4


class ExactnessError(ExpertcacheError):
    """A lossless policy's NLL left the tolerance around the all-resident reference, or its copies
    disagree with a replay of its own trace."""


@dataclass
class PassResult:
    """NLL and time of one pass over the sequences."""

    nll_sum: float
    predictions: int
    tokens: int
    seconds: float

    @property
    def nll(self) -> float:
        return self.nll_sum / self.predictions if self.predictions else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class PolicyResult:
    """One policy's evaluation; :meth:`to_dict` is the ``expertcache eval --json`` record."""

    policy: str
    capacity: int
    mode: str
    tolerance: float
    reference: PassResult
    run: PassResult
    stats: OffloadStats
    replay_copies_total: int
    replay_copies_steady: int
    replay_agrees: bool
    routing_changed: float

    @property
    def nll_delta(self) -> float:
        return self.run.nll - self.reference.nll

    @property
    def exact(self) -> bool:
        return abs(self.nll_delta) <= self.tolerance

    def to_dict(self) -> dict:
        s = self.stats
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "tokens": self.run.tokens,
            "nll": self.run.nll,
            "nll_reference": self.reference.nll,
            "nll_delta": self.nll_delta,
            "exact": self.exact,
            "tolerance": self.tolerance,
            "copies_total": s.copies_total,
            "copies_fill": s.copies_fill,
            "copies_steady": s.copies_steady,
            "copies_per_token": s.copies_per_token,
            "hit_rate": s.hit_rate,
            "tokens_per_s": self.run.tokens_per_s,
            "tokens_per_s_reference": self.reference.tokens_per_s,
            "speed_vs_reference": self.run.tokens_per_s / self.reference.tokens_per_s,
            "copy_seconds": s.copy_seconds,
            "copy_bytes_per_s": s.copy_bandwidth,
            "expert_bytes": s.expert_bytes,
            "replay_copies_total": self.replay_copies_total,
            "replay_copies_steady": self.replay_copies_steady,
            "replay_agrees": self.replay_agrees,
            "routing_changed": self.routing_changed,
            "future_mismatches": s.future_mismatches,
            "predictions": self.run.predictions,
            "sequences": s.sequences,
            "layers": s.layers,
            "mode": self.mode,
            "device": s.device,
            "per_layer": [c.to_dict() for c in s.per_layer],
        }


@dataclass
class Evaluation:
    """The reference pass, its trace, and one :class:`PolicyResult` per policy."""

    reference: PassResult
    trace: Trace
    results: list[PolicyResult] = field(default_factory=list)

    def failures(self) -> list[str]:
        """One line per broken guarantee (empty when every policy is exact and agrees with replay)."""
        out = []
        for r in self.results:
            if not r.exact:
                out.append(
                    f"policy {r.policy} at C={r.capacity}: NLL {r.run.nll:.6f} differs from the all-resident "
                    f"reference {r.reference.nll:.6f} by {abs(r.nll_delta):.2e} > {r.tolerance:g} (a lossless policy must match)"
                )
            if not r.replay_agrees:
                out.append(
                    f"policy {r.policy} at C={r.capacity}: live copies (total {r.stats.copies_total}, steady "
                    f"{r.stats.copies_steady}) differ from the replay of its trace (total {r.replay_copies_total}, "
                    f"steady {r.replay_copies_steady})"
                )
        return out

    def check(self) -> None:
        """Raise :class:`ExactnessError` with the first failure, if any."""
        failures = self.failures()
        if failures:
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise ExactnessError(failures[0] + more)


def evaluate(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    capacity: int,
    policies: Iterable[str] = ("lru",),
    layers: Iterable[int] | None = None,
    *,
    mode: str = "decode",
    tolerance: float = TOLERANCE,
    router_probs: bool = False,
    progress: bool = False,
) -> Evaluation:
    """Run the protocol of the module docstring; ``sequences`` are token-id lists of length >= 2."""
    if mode not in MODES:
        raise ConfigError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    if not tolerance >= 0:
        raise ConfigError(f"tolerance must be a non-negative number of nats, got {tolerance}")
    seqs = check_sequences(sequences, _vocab_size(model))
    specs = [make_policy(p).spec for p in policies]
    if not specs:
        raise ConfigError("policies: give at least one policy")
    layers = None if layers is None else list(layers)
    model.eval()
    # validate capacity, layers and model support for every policy before the long reference pass
    probes = [OffloadRun(model, capacity, spec, layers) for spec in specs]

    run_pass(model, [seqs[0][:WARMUP_TOKENS]], mode)
    with Capture(model, phase="all", router_probs=router_probs, label="teacher-forced") as cap:
        reference = run_pass(model, seqs, mode, progress=_bar(progress, "reference (all resident)", len(seqs)))
    trace = cap.trace
    evaluation = Evaluation(reference, trace)
    for spec, probe in zip(specs, probes):
        run = OffloadRun(model, capacity, spec, probe.layer_ids, future=trace)
        with run:
            run_pass(model, [seqs[0][:WARMUP_TOKENS]], mode)
            run.restart()
            with Capture(model, phase="all", layers=run.layer_ids, label="teacher-forced") as live:
                result = run_pass(model, seqs, mode, progress=_bar(progress, f"{spec} at C={capacity}", len(seqs)))
        stats = run.stats()
        evaluation.results.append(_policy_result(spec, capacity, mode, tolerance, reference, result, stats, live.trace, trace))
    return evaluation


def _policy_result(spec, capacity, mode, tolerance, reference, result, stats, live: Trace, ref_trace: Trace) -> PolicyResult:
    replayed = replay(live, capacity, spec, layers=stats.layers)
    agrees = (
        replayed.copies_total == stats.copies_total
        and replayed.copies_steady == stats.copies_steady
        and [(c.copies_total, c.copies_steady) for c in replayed.per_layer]
        == [(c.copies_total, c.copies_steady) for c in stats.per_layer]
    )
    ref = np.sort(ref_trace.select_layers(stats.layers).experts, axis=2)
    changed = float(np.mean(np.any(np.sort(live.experts, axis=2) != ref, axis=2))) if ref.shape == live.experts.shape else 1.0
    return PolicyResult(
        policy=spec, capacity=capacity, mode=mode, tolerance=tolerance, reference=reference, run=result,
        stats=stats, replay_copies_total=replayed.copies_total, replay_copies_steady=replayed.copies_steady,
        replay_agrees=agrees, routing_changed=changed,
    )


# ---------------------------------------------------------------------- passes
def run_pass(model: torch.nn.Module, sequences: Sequence[np.ndarray], mode: str, progress=None) -> PassResult:
    """Teacher-force every sequence (``decode``: one token per forward with a KV cache;
    ``forward``: one forward per sequence) and return summed NLL and timed seconds."""
    device = _device(model)
    watch = Stopwatch(device)
    nll_sum, predictions, tokens = 0.0, 0, 0
    with torch.inference_mode():
        for ids in sequences:
            x = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=device)[None]
            if mode == "forward":
                with watch.time():
                    logits = model(input_ids=x, use_cache=False).logits[0]
            else:
                logits = _decode(model, x, watch)
            if x.shape[1] > 1:
                logp = torch.log_softmax(logits[:-1].float(), dim=-1)
                nll_sum += float(-logp.gather(1, x[0, 1:, None]).sum())
            predictions += x.shape[1] - 1
            tokens += x.shape[1]
            if progress is not None:
                progress.update(1)
    if progress is not None:
        progress.close()
    return PassResult(nll_sum, predictions, tokens, watch.seconds)


def _decode(model: torch.nn.Module, x: torch.Tensor, watch: Stopwatch) -> torch.Tensor:
    key = cache_argument(model)
    cache, rows = None, []
    for i in range(x.shape[1]):
        with watch.time():
            out = model(input_ids=x[:, i : i + 1], use_cache=True, **{key: cache})
        cache = out["cache"] if "cache" in out else out.get("past_key_values")
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


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


def split_tokens(ids: np.ndarray, max_len: int, max_sequences: int | None = None) -> list[np.ndarray]:
    """Sequences from token ids: a 1-d stream is cut into chunks of ``max_len`` (a last chunk shorter
    than 2 tokens is dropped); each row of a 2-d array is one sequence, truncated to ``max_len``."""
    ids = np.asarray(ids)
    if max_len < 2:
        raise ConfigError(f"max-len must be at least 2, got {max_len}")
    if ids.ndim == 1:
        seqs = [ids[i : i + max_len] for i in range(0, ids.size, max_len)]
        seqs = [s for s in seqs if s.size >= 2]
    elif ids.ndim == 2:
        seqs = [row[:max_len] for row in ids]
    else:
        raise ConfigError(f"token ids: expected a 1-d stream or a 2-d [sequences, tokens] array, got shape {ids.shape}")
    if max_sequences is not None:
        seqs = seqs[:max_sequences]
    return seqs


def _vocab_size(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.num_embeddings) if emb is not None and hasattr(emb, "num_embeddings") else None


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _bar(enabled: bool, desc: str, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc=desc, total=total, unit="seq", leave=False)
