"""Scorers of eviction candidates: linear and a small MLP in numpy, trained listwise.

At each eviction a scorer gives every candidate a score; the highest is evicted (the policy's key
is minus the score). Training minimises, over the eviction events, the listwise cross-entropy
``-log sum_{v in victims} softmax(scores)_v``: the probability the softmax over one event's
candidates puts on its victim set (every candidate tied at the farthest next use is right).

Invariants: training is a pure function of (events, kind, seed, options): initial weights and
minibatch order come from ``numpy.random.default_rng(seed)``, arithmetic is float64. Features are
standardised with the training rows' mean and standard deviation, stored in the scorer. Products
are single-threaded and take no BLAS (``numpy.einsum``, and the MLP's forward and backward compiled
in :mod:`.kernels_train`, every sum in index order): the same bits whatever the machine's thread
count, and no thread contention on a busy machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kernels_train import mlp_backward, pre_activation

KINDS = ("linear", "mlp")


@dataclass
class Scorer:
    """A trained scorer: ``score(X) = f((X - mean) / scale)``.

    ``weights``: linear ``[w (F,)]``; mlp ``[W1 (F, H), b1 (H,), w2 (H,)]`` with
    ``f(z) = relu(z W1 + b1) . w2``.
    """

    kind: str
    features: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    weights: list[np.ndarray]
    meta: dict = field(default_factory=dict)

    def score(self, X: np.ndarray) -> np.ndarray:
        Z = (np.asarray(X, dtype=np.float64) - self.mean) / self.scale
        if self.kind == "linear":
            return np.einsum("nf,f->n", Z, self.weights[0])
        W1, b1, w2 = self.weights
        return np.einsum("nh,h->n", np.maximum(np.einsum("nf,fh->nh", Z, W1) + b1, 0.0), w2)


# ------------------------------------------------------------------------------------ training
@dataclass
class TrainOptions:
    hidden: int = 32
    epochs: int = 8
    batch_events: int = 256
    lr: float = 0.01
    l2: float = 1e-4
    max_steps: int = 3000


def segment_ids(offsets: np.ndarray) -> np.ndarray:
    """int64 ``[N]``: the event of each row, from event offsets ``[n_events + 1]``."""
    return np.repeat(np.arange(offsets.size - 1), np.diff(offsets))


def shuffle_labels(victim: np.ndarray, offsets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The victim flags permuted at random within each event (same number of victims per event):
    the shuffled-label control keeps the label distribution and breaks its link to the features."""
    seg = segment_ids(offsets)
    perm = np.lexsort((rng.random(seg.size), seg))
    out = np.empty_like(victim)
    out[perm] = victim
    return out


def listwise(s: np.ndarray, y: np.ndarray, offsets: np.ndarray) -> tuple[float, np.ndarray]:
    """``(mean loss, d loss / d s)`` of the listwise cross-entropy over events ``offsets``."""
    seg = segment_ids(offsets)
    starts = offsets[:-1]
    m = np.maximum.reduceat(s, starts)
    z = np.exp(s - m[seg])
    p = z / np.add.reduceat(z, starts)[seg]
    pv = np.add.reduceat(p * y, starts)
    n = starts.size
    loss = float(-np.log(np.maximum(pv, 1e-300)).sum() / n)
    grad = (p - y * p / np.maximum(pv, 1e-300)[seg]) / n
    return loss, grad


def informative(victim: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """bool ``[n_events]``: events where the victim set is not every candidate (others carry no gradient)."""
    nv = np.add.reduceat(victim.astype(np.int64), offsets[:-1]) if offsets.size > 1 else np.zeros(0, int)
    return nv < np.diff(offsets)


def fit(X: np.ndarray, victim: np.ndarray, offsets: np.ndarray, features, *, kind: str = "linear",
        seed: int = 0, shuffled: bool = False, options: TrainOptions | None = None) -> Scorer:
    """Train a scorer on events (rows ``X [N, F]``, victim flags ``[N]``, event offsets)."""
    opt = options or TrainOptions()
    rng = np.random.default_rng(seed)
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(victim, dtype=bool)
    offsets = np.asarray(offsets, dtype=np.int64)
    if shuffled:
        y = shuffle_labels(y, offsets, np.random.default_rng([seed, 1]))
    mean = X.mean(axis=0) if X.shape[0] else np.zeros(X.shape[1])
    std = X.std(axis=0) if X.shape[0] else np.ones(X.shape[1])
    scale = np.where(std > 1e-9, std, 1.0)
    Z = (X - mean) / scale
    F = X.shape[1]
    if kind == "linear":
        weights = [np.zeros(F)]
    else:
        H = opt.hidden
        weights = [rng.normal(0.0, np.sqrt(2.0 / max(F, 1)), (F, H)), np.zeros(H), rng.normal(0.0, np.sqrt(1.0 / H), H)]
    events = np.flatnonzero(informative(y, offsets))
    m1 = [np.zeros_like(w) for w in weights]
    m2 = [np.zeros_like(w) for w in weights]
    step, b1, b2 = 0, 0.9, 0.999
    yf = y.astype(np.float64)
    for _ in range(opt.epochs):
        if step >= opt.max_steps or events.size == 0:
            break
        order = rng.permutation(events)
        for i in range(0, order.size, opt.batch_events):
            ev = np.sort(order[i : i + opt.batch_events])
            rows, sub = _gather(offsets, ev)
            grads = _grads(kind, weights, Z, rows, yf[rows], sub)
            step += 1
            for j, (w, g) in enumerate(zip(weights, grads)):
                g = g + opt.l2 * w
                m1[j] = b1 * m1[j] + (1 - b1) * g
                m2[j] = b2 * m2[j] + (1 - b2) * g * g
                w -= opt.lr * (m1[j] / (1 - b1**step)) / (np.sqrt(m2[j] / (1 - b2**step)) + 1e-8)
            if step >= opt.max_steps:
                break
    meta = {"seed": int(seed), "shuffled_labels": bool(shuffled), "steps": step, "events": int(offsets.size - 1),
            "informative_events": int(events.size), "rows": int(X.shape[0]),
            "options": {k: getattr(opt, k) for k in ("hidden", "epochs", "batch_events", "lr", "l2", "max_steps")}}
    return Scorer(kind=kind, features=tuple(features), mean=mean, scale=scale, weights=weights, meta=meta)


def mean_loss(scorer: Scorer, X: np.ndarray, victim: np.ndarray, offsets: np.ndarray) -> float:
    """The listwise loss of ``scorer`` on events (informative ones only)."""
    keep = informative(np.asarray(victim, dtype=bool), offsets)
    rows, sub = _gather(offsets, np.flatnonzero(keep))
    if sub.size < 2:
        return float("nan")
    return listwise(scorer.score(X[rows]), np.asarray(victim, dtype=np.float64)[rows], sub)[0]


def _gather(offsets: np.ndarray, ev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of events ``ev`` and their local offsets."""
    lens = offsets[ev + 1] - offsets[ev]
    sub = np.r_[0, np.cumsum(lens)]
    rows = np.repeat(offsets[ev] - sub[:-1], lens) + np.arange(sub[-1])
    return rows, sub


def _grads(kind, weights, Z, rows, y, sub):
    """Gradients of the listwise loss of the minibatch ``Z[rows]`` (labels ``y``, local offsets ``sub``)."""
    if kind == "linear":
        (w,) = weights
        Zr = Z[rows]
        _, ds = listwise(np.einsum("nf,f->n", Zr, w), y, sub)
        return [np.einsum("nf,n->f", Zr, ds)]
    W1, b1, w2 = weights
    h = pre_activation(Z, rows, W1, b1)  # Z[rows] W1 + b1
    a = np.maximum(h, 0.0)
    _, ds = listwise(np.einsum("nh,h->n", a, w2), y, sub)
    return list(mlp_backward(Z, rows, h, a, ds, w2))
