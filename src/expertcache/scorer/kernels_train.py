"""Compiled products of the MLP scorer's training step (:func:`expertcache.scorer.models.fit`).

The products that dominate a step (``Z[rows] @ W1 + b1`` forward; backward ``Z[rows].T @ dh``, with
the bias's and the output layer's gradients in the same pass) over a minibatch's rows, gathered on
the fly from the standardised matrix.

Invariant: every sum runs in index order from 0.0, one product added at a time (no BLAS, no
threads, no reassociation: numba compiles without ``fastmath``, so LLVM fuses no multiply-add), so
the bits are the same on every machine and at any thread count. It is the order ``numpy.einsum``
takes for these subscripts (``"nf,fh->nh"``, ``"nf,nh->fh"`` and ``"nh,n->h"``, hidden width 2 or
more, numpy 2.x) and numpy's sum over rows (from the first row), so scorers trained before these
loops existed come out the same bits.

Without numba (:data:`expertcache._jit.AVAILABLE` false) the numpy twins below compute the same
sums in the same order; ``tests/test_learn.py`` checks both against each other.
"""

from __future__ import annotations

import numpy as np

from .._jit import AVAILABLE, njit

__all__ = ["mlp_backward", "pre_activation"]


@njit(cache=True, inline="always")
def _axpy(out, a, x):
    """``out += a * x``, element by element."""
    for h in range(x.size):
        out[h] += a * x[h]


@njit(cache=True)
def _pre_activation(Z, rows, W1, b1):
    out = np.zeros((rows.size, W1.shape[1]))
    for r in range(rows.size):
        z, o = Z[rows[r]], out[r]
        for f in range(W1.shape[0]):
            _axpy(o, z[f], W1[f])
        for h in range(o.size):
            o[h] = o[h] + b1[h]
    return out


@njit(cache=True)
def _mlp_backward(Z, rows, h, a, ds, w2):
    n, H = h.shape
    dW1, db1, dw2, d = np.zeros((Z.shape[1], H)), np.zeros(H), np.zeros(H), np.empty(H)
    for r in range(n):
        z, hr, ar, s = Z[rows[r]], h[r], a[r], ds[r]
        for j in range(H):
            d[j] = s * w2[j] * (1.0 if hr[j] > 0 else 0.0)
            dw2[j] += ar[j] * s
            db1[j] = d[j] if r == 0 else db1[j] + d[j]  # from the first row, as numpy's sum starts
        for f in range(z.size):
            _axpy(dW1[f], z[f], d)
    return dW1, db1, dw2


def pre_activation_numpy(Z, rows, W1, b1):
    """:func:`pre_activation` in numpy: one column of products added at a time (the same order)."""
    Zr = Z[rows]
    out = np.zeros((rows.size, W1.shape[1]))
    for f in range(W1.shape[0]):
        out += Zr[:, f, None] * W1[f]
    return out + b1


def mlp_backward_numpy(Z, rows, h, a, ds, w2):
    """:func:`mlp_backward` in numpy: one row's terms added at a time (the same order)."""
    dh = ds[:, None] * w2[None, :] * (h > 0)
    dW1, db1, dw2 = np.zeros((Z.shape[1], h.shape[1])), np.zeros(h.shape[1]), np.zeros(h.shape[1])
    for r in range(rows.size):
        dW1 += Z[rows[r], :, None] * dh[r]
        db1 = dh[r].copy() if r == 0 else db1 + dh[r]
        dw2 += a[r] * ds[r]
    return dW1, db1, dw2


def pre_activation(Z: np.ndarray, rows: np.ndarray, W1: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """float64 ``[len(rows), H]``: ``Z[rows] @ W1 + b1``, each sum over features in index order.
    ``Z`` float64 ``[N, F]`` C-contiguous, ``rows`` int64, ``W1 [F, H]``, ``b1 [H]``."""
    return (_pre_activation if AVAILABLE else pre_activation_numpy)(Z, rows, W1, b1)


def mlp_backward(Z: np.ndarray, rows: np.ndarray, h: np.ndarray, a: np.ndarray, ds: np.ndarray,
                 w2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The MLP's gradients ``(dW1 [F, H], db1 [H], dw2 [H])`` from its pre-activations ``h`` and
    activations ``a`` (``[len(rows), H]``) and the scores' gradient ``ds``: with ``dh = ds w2 (h >
    0)`` (elementwise), ``Z[rows].T @ dh``, ``dh`` summed over rows and ``a.T @ ds``, each sum over
    rows in order (``db1`` from the first row, as numpy's sum)."""
    return (_mlp_backward if AVAILABLE else mlp_backward_numpy)(Z, rows, h, a, ds, w2)
