"""``random[:seed]``: evict a uniformly random candidate, reproducibly; a rule of the engine.

Each candidate's key at step t is a hash of (seed, t, item) (splitmix64, :func:`mix64`): at an
eviction the victim is the resident outside the current group with the smallest key, ties (never
seen: 2**-53) to the older last request, then the smaller id. Since a key depends only on
(seed, t, item), the victims of a group are the same whatever order its misses are served in, so
the engine's order (ids ascending) gives the counts of any other order. Written once, as engine
hooks (:mod:`expertcache.policies.driver`): ``victim`` scans the residents, O(C) per eviction.
:func:`hash_keys` is an independent numpy twin of :func:`mix64`, the tests' oracle.
"""

from __future__ import annotations

import numpy as np

from . import driver
from .._jit import AVAILABLE, njit
from .base import parse_int
from .hooked import HookedPolicy
from .registry import register

MIX_M1 = np.uint64(0x9E3779B97F4A7C15)
MIX_M2 = np.uint64(0xBF58476D1CE4E5B9)
MIX_M3 = np.uint64(0x94D049BB133111EB)
LAST = 0  # st row: the step of the item's last request
SEED = 0  # sc: the seed

if AVAILABLE:
    @njit(cache=True, inline="always")
    def mix64(seed, t, e):
        """splitmix64 of ``seed * M1 + t * M2 + e * M3`` as a float in [0, 1)."""
        x = np.uint64(seed) * MIX_M1 + np.uint64(t) * MIX_M2 + np.uint64(e) * MIX_M3
        x = (x ^ (x >> np.uint64(30))) * MIX_M2
        x = (x ^ (x >> np.uint64(27))) * MIX_M3
        x = x ^ (x >> np.uint64(31))
        return float(x >> np.uint64(11)) * (1.0 / 9007199254740992.0)

else:
    # Plain Python (see expertcache._jit): the same uint64 arithmetic modulo 2**64 on Python ints;
    # numpy's uint64 scalars would wrap too, but warn at every overflowing multiplication.
    _M64 = (1 << 64) - 1
    _P1, _P2, _P3 = int(MIX_M1), int(MIX_M2), int(MIX_M3)

    def mix64(seed, t, e):
        """splitmix64 of ``seed * M1 + t * M2 + e * M3`` as a float in [0, 1)."""
        x = (int(seed) * _P1 + int(t) * _P2 + int(e) * _P3) & _M64
        x = ((x ^ (x >> 30)) * _P2) & _M64
        x = ((x ^ (x >> 27)) * _P3) & _M64
        x = x ^ (x >> 31)
        return float(x >> 11) * (1.0 / 9007199254740992.0)


def hash_keys(seed: int, t: int, items: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from splitmix64(seed * M1 + t * M2 + item * M3): the reference
    twin of :func:`mix64`, written independently with numpy."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * MIX_M1 + np.uint64(t) * MIX_M2 + np.asarray(items, dtype=np.uint64) * MIX_M3
        x = (x ^ (x >> np.uint64(30))) * MIX_M2
        x = (x ^ (x >> np.uint64(27))) * MIX_M3
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


@njit(cache=True, inline="always")
def init(st, sc, fs, n_items, capacity):
    pass


@njit(cache=True, inline="always")
def hit(st, sc, fs, e, t):
    st[LAST, e] = t


@njit(cache=True, inline="always")
def miss(st, sc, fs, e, t):
    pass


@njit(cache=True, inline="always")
def victim(st, sc, fs, e, t, stamp, g, res, size):
    best = -1
    bk = 0.0
    seed = sc[SEED]
    for i in range(size):
        c = res[i]
        if stamp[c] == g:
            continue
        kc = mix64(seed, t, c)
        if best < 0 or kc < bk or (kc == bk and (st[LAST, c] < st[LAST, best]
                                                 or (st[LAST, c] == st[LAST, best] and c < best))):
            best = c
            bk = kc
    return best


evict = miss  # nothing to forget: the key is a hash, the state only the last request
admit = hit


@njit(cache=True)
def loop(groups, starts, n_items, capacity, rows, sc0, fs0):
    return driver.run(groups, starts, n_items, capacity, rows, sc0, fs0, init, hit, miss, victim, evict, admit)


@register
class Random(HookedPolicy):
    name = "random"
    takes_parameter = True
    rows = 1
    n_int = 1
    hooks = (init, hit, miss, victim, evict, admit)
    loop = staticmethod(loop)

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = parse_int(seed, "random:seed", 0)

    @property
    def spec(self):
        return f"random:{self.seed}"

    def params(self):
        return np.array([self.seed], dtype=np.int64), np.zeros(1, dtype=np.float64)
