"""The eviction-policy interface every cache in expertcache drives.

A policy is a small stateful object that ranks eviction candidates. It knows nothing about
slots, copies or the simulator: the cache that drives it (:class:`expertcache.cache.ExpertCache`
in the live harness and the tier, the compiled kernels in :mod:`expertcache.sim`) calls

``bind(capacity)``
    once, by the cache that drives it: the slots of its pool;
``reset(n_items, future=None, steps_per_token=1)``
    at the start of every stream (a pool starting empty);
``keys(candidates, t) -> float array``
    when it must evict at step ``t``: one key per candidate (resident items the current group
    does not request). The cache evicts in ascending ``(key, last use, item id)`` order, so every
    rule breaks ties the same way (docs/design.md section 2: least recently used, then smallest id);
``on_access(items, t)``
    once the group requested at step ``t`` is resident.

and tells it what happened, libCacheSim's plugin hooks (no-ops unless a rule needs them):
``on_hit(items, t)``, ``on_miss(items, t)`` (requested, resident / not), ``on_evict(victims, t)``,
``on_admit(items, t)`` (inserted), each once per step, before ``on_access``.

A rule that is a state machine rather than a key (ARC, S3-FIFO, SIEVE) subclasses
:class:`~expertcache.policies.hooked.HookedPolicy` instead: it is written once, as compiled
hooks that the cache and the compiled replay both call (:mod:`expertcache.policies.driver`).

Steps count access groups: a token at one layer in a per-layer pool, or one layer of one token in a
global pool, where ``steps_per_token`` = number of layers so rules defined per token (decay rate,
foresight horizon) keep their meaning.

Clairvoyant rules (``needs_future = True``) receive a :class:`StreamFuture` in ``reset``.

For the simulator's hot loop a policy also describes itself as a compiled plan
(:meth:`Policy.plan`); the plan and the reference methods above implement the same rule twice,
independently, and the tests check them hit for hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from .._text import short
from ..errors import PolicyError, is_int, is_real
from ..kernels import NEVER

if TYPE_CHECKING:  # pragma: no cover
    from ..sim.layout import StreamLayout



class StreamFuture:
    """The recorded future of one stream: when each item is requested next.

    Built from the stream's access groups ``[G, k]`` (item ids, -1 pads); step ``g`` is row ``g``.
    """

    def __init__(self, groups: np.ndarray):
        groups = np.asarray(groups)
        self.num_steps = int(groups.shape[0])
        g, _ = np.nonzero(groups >= 0)
        items = groups[groups >= 0].astype(np.int64)
        self._span = self.num_steps + 1
        self._codes = np.sort(items * self._span + g)

    def next_use(self, items: np.ndarray, t: int) -> np.ndarray:
        """First step after ``t`` that requests each item (``NEVER`` if none)."""
        items = np.asarray(items, dtype=np.int64)
        q = items * self._span + t
        idx = np.searchsorted(self._codes, q, side="right")
        found = np.zeros(items.shape, dtype=bool)
        inside = idx < self._codes.size
        found[inside] = self._codes[idx[inside]] // self._span == items[inside]
        out = np.full(items.shape, NEVER, dtype=np.int64)
        out[found] = self._codes[idx[found]] % self._span
        return out


class Policy:
    """Base class of eviction rules; see the module docstring for the calling protocol."""

    name: ClassVar[str] = "?"
    needs_future: ClassVar[bool] = False
    admits: ClassVar[bool] = True
    """Whether every miss is inserted (the lossless rules). ``False`` for a pin set with bypass
    (``static``): misses are streamed, the pool never changes, any capacity >= 1 is valid."""

    stream_local: ClassVar[bool] = True
    """Whether the rule reads nothing but each stream's own requests (so streams may be replayed
    apart, in parallel: :mod:`expertcache.sim.parallel`). ``False`` for rules that read a
    trace-wide table or a scorer file."""

    stack_curve: ClassVar[bool] = False
    """Whether the rule is a stack algorithm (inclusion property) whose whole miss-ratio curve one
    pass computes (:func:`expertcache.sim.curves.mrc.lru_curve`): LRU only. A subclass that changes
    the rule must set it back to ``False``."""

    wants_context: ClassVar[bool] = False
    """Whether the policy reads the current step's side information (gate weights, router
    probabilities): the driver then calls :meth:`set_context` with the stream's
    :class:`~expertcache.trace.context.StreamContext` (or None) before each ``reset``."""

    takes_parameter: ClassVar[bool] = False
    """Whether ``name:VALUE`` gives the rule its one parameter: :meth:`from_arg` passes the text to
    ``__init__``, which checks it (:func:`parse_int`, :func:`parse_float`) as it checks a Python
    caller's number."""

    def __init__(self) -> None:
        self.n_items = 0
        self.capacity: int | None = None
        self.steps_per_token = 1
        self.future: StreamFuture | None = None
        self.context = None

    def set_context(self, context) -> None:
        """Side information of the next stream (read by policies with ``wants_context``)."""
        self.context = context

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_arg(cls, arg: str | None) -> "Policy":
        """Build from the text after ``name:`` in a policy spec (``None`` when absent): the rule's one
        parameter where it :attr:`takes_parameter`, refused where it does not."""
        if arg is None:
            return cls()
        if not cls.takes_parameter:
            raise PolicyError(f"policy {cls.name!r} takes no parameter (got {cls.name}:{arg})")
        return cls(arg)

    @property
    def spec(self) -> str:
        """Canonical name, parseable by :func:`expertcache.policies.make_policy`."""
        return self.name

    def __repr__(self) -> str:
        return f"<policy {self.spec}>"

    # -- protocol -----------------------------------------------------------------------------
    hooked: ClassVar[bool] = False
    """Whether the rule is a state machine driven by engine hooks (:mod:`.hooked`), not by keys."""

    def bind(self, capacity: int) -> None:
        """The capacity (slots) of the pool this policy serves; called once by its cache."""
        self.capacity = int(capacity)

    def reset(self, n_items: int, future: StreamFuture | None = None, steps_per_token: int = 1) -> None:
        if self.needs_future and future is None:
            raise PolicyError(f"policy {self.spec!r} is clairvoyant: it needs the recorded future of the stream")
        self.n_items = int(n_items)
        self.future = future
        self.steps_per_token = int(steps_per_token)

    def on_hit(self, items: np.ndarray, t: int) -> None:
        """Requested items of step ``t`` that were resident."""

    def on_miss(self, items: np.ndarray, t: int) -> None:
        """Requested items of step ``t`` that were not resident (before their evictions)."""

    def on_evict(self, victims: np.ndarray, t: int) -> None:
        """Items that left the pool at step ``t``, in eviction order."""

    def on_admit(self, items: np.ndarray, t: int) -> None:
        """Items inserted at step ``t`` (the misses)."""

    def on_access(self, items: np.ndarray, t: int) -> None:
        """The items of step ``t`` are resident (called once per step, after any evictions)."""

    def keys(self, candidates: np.ndarray, t: int) -> np.ndarray:
        """Eviction keys of the candidates at step ``t``; lowest is evicted first."""
        raise NotImplementedError

    # -- simulator fast path ------------------------------------------------------------------
    def plan(self, layout: "StreamLayout"):
        """A compiled plan (:mod:`expertcache.kernels`) running this rule over ``layout``,
        or ``None`` to make the simulator drive :meth:`keys`/:meth:`on_access` from Python."""
        return None


def _value(arg, what: str, noun: str, convert, accepts) -> tuple:
    """``arg`` as a number and as messages show it: text converted by ``convert`` (``float`` or
    ``int``), or a number that ``accepts`` (:func:`is_real`, :func:`is_int`) converted the same way;
    a PolicyError otherwise."""
    shown = arg[:40] if isinstance(arg, str) else short(arg, 40)
    if isinstance(arg, str):
        try:
            return convert(arg), shown
        except ValueError:
            raise PolicyError(f"{what}: expected {noun}, got {arg[:40]!r}") from None
    if accepts(arg):
        return convert(arg), shown
    raise PolicyError(f"{what}: expected {noun}, got {shown}")


def parse_float(arg, what: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> float:
    """A real parameter in the interval: the text after ``name:`` in a policy string, or the number
    a Python caller passes to the rule's constructor (not a bool, NaN or an infinity: each rule's
    ``__init__`` checks its parameters here, so ``Decayed(2.5)`` is refused as ``decayed:2.5`` is)."""
    x, shown = _value(arg, what, "a number", float, is_real)
    if not np.isfinite(x) or x < lo or x > hi or (lo_open and x == lo) or (hi_open and x == hi):
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise PolicyError(f"{what}: {shown} is outside {lb}{lo}, {hi}{rb}")
    return x


def parse_int(arg, what: str, lo: int, hi: int = 2**63 - 1) -> int:
    """An integer parameter in ``[lo, hi]`` (default: up to the largest int64, what loops can hold):
    text, as :func:`parse_float` takes it, or a Python or numpy integer (not a bool, nor a float
    such as 2.5, which ``int()`` had truncated to 2)."""
    x, shown = _value(arg, what, "an integer", int, is_int)
    if x < lo:
        raise PolicyError(f"{what}: {short(x, 40)} is below {lo}")
    if x > hi:
        raise PolicyError(f"{what}: {shown} is above {hi}")
    return x
