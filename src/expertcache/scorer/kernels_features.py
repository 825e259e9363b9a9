"""The float arithmetic both replay paths of ``learned:`` scorers share (:mod:`expertcache.scorer.kernels_learned`).

The Python engine (:class:`expertcache.scorer.features.FeatureState` and the policy) and the compiled
loop call these same functions, so they compute the same bits: ``exp`` and ``log1p`` always the
scalar ``math`` functions (numpy's vectorised versions may round differently), every sum in index
order from 0.0, float64. This assumes numba without Intel SVML (``numba -s``), which would vectorise
``math.exp`` loops differently.
"""

from __future__ import annotations

import math

import numpy as np

from .._jit import njit


@njit(cache=True)
def log1p_each(x):
    """``log1p`` of each element of a float64 vector (scalar ``math.log1p``)."""
    out = np.empty(x.size, dtype=np.float64)
    for i in range(x.size):
        out[i] = math.log1p(x[i])
    return out


@njit(cache=True)
def decayed(d, lograte, elapsed):
    """``[R, n]``: ``d[r, i] * exp(-lograte[r] * elapsed[i])`` (scalar ``math.exp``)."""
    R, n = d.shape
    out = np.empty((R, n), dtype=np.float64)
    for r in range(R):
        for i in range(n):
            out[r, i] = d[r, i] * math.exp(-lograte[r] * elapsed[i])
    return out


@njit(cache=True, inline="always")
def score_row(x, mean, scale, z, hid, mlp, w, W1, b1, w2):
    """Score of one feature row ``x``: ``z = (x - mean) / scale``; linear ``sum_f z_f w_f``; mlp
    ``sum_j relu(sum_f z_f W1[f, j] + b1_j) w2_j``. Every sum runs in index order from 0.0, float64
    (the hidden sums side by side, each still over f in order); ``z [F]``, ``hid [H]`` are scratch."""
    F = x.size
    for f in range(F):
        z[f] = (x[f] - mean[f]) / scale[f]
    s = 0.0
    if not mlp:
        for f in range(F):
            s += z[f] * w[f]
        return s
    H = b1.size
    for j in range(H):
        hid[j] = 0.0
    for f in range(F):
        zf = z[f]
        for j in range(H):
            hid[j] += zf * W1[f, j]
    for j in range(H):
        h = hid[j] + b1[j]
        if h > 0.0:
            s += h * w2[j]
    return s


@njit(cache=True)
def score_rows(X, mean, scale, mlp, w, W1, b1, w2):
    """float64 ``[N]``: :func:`score_row` of each row of ``X [N, F]`` (the Python engine's scoring)."""
    N, F = X.shape
    out = np.empty(N, dtype=np.float64)
    z = np.empty(F, dtype=np.float64)
    hid = np.empty(b1.size, dtype=np.float64)
    x = np.empty(F, dtype=np.float64)
    for i in range(N):
        for f in range(F):
            x[f] = X[i, f]
        out[i] = score_row(x, mean, scale, z, hid, mlp, w, W1, b1, w2)
    return out


@njit(cache=True, inline="always")
def trans_at(trans, succp, h, li, e, lat, latn):
    """Mean of ``trans[h, li, a, e]`` over the experts ``a = lat[li, :latn[li]]`` of the latest group
    served at layer ``li`` (summed in that order from 0.0); ``succp[h, li, e]`` before any group."""
    n = latn[li]
    if n == 0:
        return succp[h, li, e]
    s = 0.0
    for j in range(n):
        s += trans[h, li, lat[li, j], e]
    return s / n


@njit(cache=True)
def trans_column(c_li, c_e, trans, succp, h, lat, latn):
    """float64 ``[C]``: :func:`trans_at` of each candidate (the Python engine's ``trans_hH`` columns)."""
    out = np.empty(c_li.size, dtype=np.float64)
    for i in range(c_li.size):
        out[i] = trans_at(trans, succp, h, c_li[i], c_e[i], lat, latn)
    return out


@njit(cache=True, inline="always")
def online_observe(M, N, use, steps, lat, latn, li, es, n):
    """Step of layer ``li`` (local index) requesting experts ``es[:n]``: count the pairs (each expert of
    the layer's previous group, each of these), the step and its experts, then make it the layer's
    latest group. ``M [L, E, E]``, ``N``/``use [L, E]``, ``steps [L]`` float64 counts."""
    for j in range(latn[li]):
        a = lat[li, j]
        N[li, a] += 1.0
        for i in range(n):
            M[li, a, es[i]] += 1.0
    steps[li] += 1.0
    for i in range(n):
        use[li, es[i]] += 1.0
        lat[li, i] = es[i]
    latn[li] = n


@njit(cache=True, inline="always")
def online_at(M, N, use, steps, li, e, lat, latn):
    """``online_h1`` of expert ``e`` at layer ``li``: the mean over the experts ``a`` of the layer's latest
    group of ``(M[li, a, e] + q) / (N[li, a] + 1)``, ``q = use[li, e] / steps[li]`` (summed in the
    group's order); ``q`` before any group."""
    q = use[li, e] / steps[li] if steps[li] > 0.0 else 0.0
    n = latn[li]
    if n == 0:
        return q
    s = 0.0
    for j in range(n):
        a = lat[li, j]
        s += (M[li, a, e] + q) / (N[li, a] + 1.0)
    return s / n


@njit(cache=True)
def online_step(M, N, use, steps, lat, latn, li, es):
    """:func:`online_observe` for the Python engine (``es``: int64 experts of one step)."""
    online_observe(M, N, use, steps, lat, latn, li, es, es.size)


@njit(cache=True)
def online_column(c_li, c_e, M, N, use, steps, lat, latn):
    """float64 ``[C]``: :func:`online_at` of each candidate (the Python engine's ``online_h1`` column)."""
    out = np.empty(c_li.size, dtype=np.float64)
    for i in range(c_li.size):
        out[i] = online_at(M, N, use, steps, c_li[i], c_e[i], lat, latn)
    return out
