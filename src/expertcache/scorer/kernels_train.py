"""Compiled products of the MLP scorer's training step (:func:`expertcache.scorer.models.fit`).

The two products that dominate a step (``Z[rows] @ W1`` forward, ``Z[rows].T @ dh`` backward) over
a minibatch's rows, gathered on the fly from the standardised matrix.

Invariant: every sum runs in index order from 0.0, one product added at a time (no BLAS, no
threads, no reassociation: numba compiles without ``fastmath``, so LLVM fuses no multiply-add), so
the bits are the same on every machine and at any thread count. It is the order ``numpy.einsum``
takes for these two subscripts (``"nf,fh->nh"`` and ``"nf,nh->fh"``, hidden width 2 or more, numpy
2.x), so scorers trained before these loops existed come out the same bits.

Without numba (:data:`expertcache._jit.AVAILABLE` false) the numpy twins below compute the same
sums in the same order; ``tests/test_learn.py`` checks both against each other.
"""

from __future__ import annotations

import numpy as np

from .._jit import AVAILABLE, njit

__all__ = ["pre_activation", "rows_outer"]


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
def _rows_outer(Z, rows, dh):
    out = np.zeros((Z.shape[1], dh.shape[1]))
    for r in range(rows.size):
        z, d = Z[rows[r]], dh[r]
        for f in range(z.size):
            _axpy(out[f], z[f], d)
    return out


def pre_activation_numpy(Z, rows, W1, b1):
    """:func:`pre_activation` in numpy: one column of products added at a time (the same order)."""
    Zr = Z[rows]
    out = np.zeros((rows.size, W1.shape[1]))
    for f in range(W1.shape[0]):
        out += Zr[:, f, None] * W1[f]
    return out + b1


def rows_outer_numpy(Z, rows, dh):
    """:func:`rows_outer` in numpy: one row's outer product added at a time (the same order)."""
    out = np.zeros((Z.shape[1], dh.shape[1]))
    for r in range(rows.size):
        out += Z[rows[r], :, None] * dh[r]
    return out


def pre_activation(Z: np.ndarray, rows: np.ndarray, W1: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """float64 ``[len(rows), H]``: ``Z[rows] @ W1 + b1``, each sum over features in index order.
    ``Z`` float64 ``[N, F]`` C-contiguous, ``rows`` int64, ``W1 [F, H]``, ``b1 [H]``."""
    return (_pre_activation if AVAILABLE else pre_activation_numpy)(Z, rows, W1, b1)


def rows_outer(Z: np.ndarray, rows: np.ndarray, dh: np.ndarray) -> np.ndarray:
    """float64 ``[F, H]``: ``Z[rows].T @ dh``, each sum over rows in order. ``dh [len(rows), H]``."""
    return (_rows_outer if AVAILABLE else rows_outer_numpy)(Z, rows, dh)
