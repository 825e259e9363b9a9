"""The policy registry: rules by name (``make_policy("decayed:0.9")``; new rules opt in with
``@register``), and policy strings by kind, one parse where a string enters
(``parse_policy(text) -> PolicySpec``).

A policy string names a rule of one of three kinds, each with its own registry and its own place:

* ``eviction`` -- which resident leaves when a miss needs a slot, in a lossless cache: every rule
  registered with ``@register`` that admits every miss (``lru``, ``belady``, ``arc``,
  ``learned:PATH``, ...). They run everywhere: replay, sweep, grid, ``ExpertCache`` (eval, the
  offloaded runtime, the tier), ``llama run --mode managed``;
* ``admission`` -- whether a miss enters at all: ``static``, the pin set with bypass (the top C
  experts of a profile, never changed; misses streamed, nothing evicted; replay, sweep, grid and the
  tier's arena), and ``--admission second`` (an expert's first request streamed, the second
  admitted), which composes with any eviction rule of a replay;
* ``set-holding`` (resident-set) -- rules that hold a set and restrict routing to it (lossy):
  ``dwell:k[:w]``, ``prefix:P`` (the experts of a sequence's first P tokens: the eviction paper's
  "Static"), and ``controller:HEADS.pt:THR[:W]``; they run where routing runs: eval and the
  offloaded runtime.

Every name means one thing: ``static`` is the admission rule only. ``prefix:P`` was called
``static:P`` before; that spelling is still accepted, as ``prefix:P``, with a one-line notice on
standard error (once per string and process). :func:`parse_policy` decides the kind from the
string alone, once, and a string of a kind the caller does not run is one line saying which kind
it is and where it runs (the same text from every entry point).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from .._text import short
from ..errors import PolicyError
from .base import Policy, parse_int

KINDS = ("eviction", "admission", "set-holding")
RUNS_IN = {
    "eviction": "replay, sweep, grid, eval, the offloaded runtime, the tier and llama run --mode managed",
    "admission": "replay, sweep and grid (and the tier's arena); plain 'static' is the pin set with bypass",
    "set-holding": "eval and the offloaded runtime (it restricts routing to a held set of experts)",
}
SET_HOLDING = ("dwell:k[:w]", "prefix:P", "controller:HEADS.pt:THR[:W]")
HOLDING_MAKERS: dict = {}
"""Set-holding rules defined above this module, by name -> ``maker(text)``: the offloaded runtime
registers the learned controller (``expertcache.hf.holding``), so the policy layer never
imports the runtime."""
RENAMED = {"static": "prefix"}
"""Old set-holding names (with a parameter) still accepted: old -> new."""
_NOTICED: set[str] = set()


_REGISTRY: dict[str, type[Policy]] = {}


SET_HOLDING_NAMES = ("dwell", "prefix", "controller")
"""The live harness's set-holding rules (``offload``), not policies of this registry."""
_NAME = re.compile(r"[a-z][a-z0-9_.-]*")


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available under ``cls.name``: lower-case letters, digits, ``_``,
    ``-`` or ``.``, beginning with a letter (``make_policy`` looks a name up lower-cased, and ``:``
    begins a policy's arguments), not a set-holding rule's name. A name it could never find
    (``"MyMRU"``, ``"a:b"``, a subclass's missing one) is refused here."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register: expected a Policy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"policy name {name!r} of {cls.__qualname__}: lower-case letters, digits, '_', '-' or "
                         "'.', beginning with a letter (make_policy looks names up lower-cased; ':' begins arguments)")
    if name in SET_HOLDING_NAMES:
        raise ValueError(f"policy name {name!r} of {cls.__qualname__} is a set-holding rule's")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    """Registered policy names."""
    return sorted(_REGISTRY)


def make_policy(spec: "str | Policy") -> Policy:
    """A fresh policy from a spec such as ``"lru"``, ``"decayed:0.9"`` or ``"foresight:16"``.

    A :class:`Policy` instance is returned as is.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"policy: expected a name such as 'lru' or 'decayed:0.9', got {spec!r}")

    name, _, arg = spec.strip().partition(":")
    cls = _REGISTRY.get(name.lower())
    if kind_of(spec) == "set-holding":
        raise wrong_kind(spec, "set-holding", "policy", ("eviction", "admission"))
    if cls is None:
        raise PolicyError(f"unknown policy {name!r} (known: {', '.join(available_policies())}; set-holding, "
                          f"in eval and the offloaded runtime: {', '.join(SET_HOLDING)})")
    return cls.from_arg(arg if _ else None)


def _renamed(text: str) -> str:
    """``static:P`` -> ``prefix:P``, with the notice (once per string); any other text unchanged."""
    name, colon, arg = text.strip().partition(":")
    new = RENAMED.get(name.lower())
    if new is None or not colon:
        return text
    if text not in _NOTICED:
        _NOTICED.add(text)
        print(f"expertcache: notice: {text.strip()[:60]!r} is now '{new}:{arg[:40]}' (the set-holding rule: the experts "
              f"of a sequence's first P tokens); '{name}' alone is the pin set with bypass", file=sys.stderr)
    return f"{new}:{arg}"


@dataclass(frozen=True)
class HoldingSpec:
    """A parsed ``dwell:k[:w]`` / ``prefix:P``; ``hold`` is None for prefix (never refreshed after the window)."""

    name: str
    hold: int | None
    window: int
    needs_future = False

    @property
    def spec(self) -> str:
        return f"prefix:{self.window}" if self.name == "prefix" else f"dwell:{self.hold}:{self.window}"


def parse_holding_spec(text: str) -> HoldingSpec:
    """``dwell:k[:w]`` (w defaults to 8k) or ``prefix:P`` (also spelt ``static:P``, with a notice), checked."""
    name, _, arg = _renamed(text).partition(":")
    parts = arg.split(":") if arg else []
    if name in RENAMED:  # the old name without its parameter: the admission rule's own name
        raise PolicyError(f"policy {text!r}: the set-holding rule is prefix:P (the experts of a sequence's first P "
                          f"tokens, routing restricted to them); the pin set with bypass, plain '{name}', runs in "
                          "replay and sweep")
    if name == "prefix":
        if len(parts) != 1:
            raise PolicyError(f"policy prefix takes one parameter, the prefix length P (prefix:P), got {text!r}: "
                              "the set-holding rule that holds the experts of a sequence's first P tokens, routing "
                              "restricted to them")
        return HoldingSpec("prefix", None, parse_int(parts[0], "prefix: P", 1, 2**40))
    if len(parts) not in (1, 2):
        raise PolicyError(f"policy dwell takes dwell:k or dwell:k:w (k tokens held, window w), got {text!r}")
    hold = parse_int(parts[0], "dwell: k", 1, 2**40)
    window = parse_int(parts[1], "dwell: w", 1, 2**40) if len(parts) == 2 else 8 * hold
    return HoldingSpec("dwell", hold, window)


def kind_of(text: str) -> str | None:
    """The kind a policy string names, from its name (and, for the old spelling ``static:P``, whether
    it has a parameter); None for an unknown name. Parameters are not checked."""
    name, colon, _ = text.strip().partition(":")
    name = name.lower()
    if name in SET_HOLDING_NAMES or (name in RENAMED and colon):
        return "set-holding"
    cls = _REGISTRY.get(name)
    if cls is None:
        return None
    return "eviction" if cls.admits else "admission"


@dataclass(frozen=True)
class PolicySpec:
    """One parsed policy string: its ``kind`` (:data:`KINDS`), ``name``, ``params`` (the text after
    the name, split at ``:``) and canonical ``text``. :meth:`clone` makes a fresh rule object."""

    kind: str
    name: str
    params: tuple[str, ...]
    text: str

    def to_spec(self) -> str:
        """The canonical string; ``parse_policy(s.to_spec()) == s``."""
        return self.text

    def clone(self):
        """A fresh rule: a :class:`~expertcache.policies.Policy` (eviction, admission), a
        :class:`HoldingSpec` (dwell, prefix:P) or a controller spec (needs the hf extra)."""
        if self.kind != "set-holding":
            return make_policy(self.text)
        if self.name in HOLDING_MAKERS:
            return HOLDING_MAKERS[self.name](self.text)
        if self.name == "controller":
            raise PolicyError(f"policy {self.text[:60]!r}: the learned controller's heads load in the offloaded runtime "
                              "(import expertcache.hf; needs the hf extra: pip install 'expertcache[hf]')")
        return parse_holding_spec(self.text)


def wrong_kind(text: str, kind: str, where: str, runs: tuple[str, ...]) -> PolicyError:
    """The one line for a string of ``kind`` given where only ``runs`` kinds run."""
    label = {"eviction": "an eviction rule", "admission": "an admission rule",
             "set-holding": "a set-holding rule"}[kind]
    if text.strip().partition(":")[0].lower() == "static" and kind == "set-holding":
        return PolicyError(f"{where} {text.strip()[:60]!r}: in replay and sweep, 'static' is the pin set with bypass "
                           "(the top C experts of a profile window, C = the capacity; no parameter); 'static:P' is the "
                           f"old name of 'prefix:P', {label}, it runs in {RUNS_IN[kind]}")
    return PolicyError(f"{where} {text.strip()[:60]!r} is {label}: it runs in {RUNS_IN[kind]}; "
                       f"here: {' or '.join(runs)} rules")


def _parse(text, kinds: tuple[str, ...], where: str):
    """``(PolicySpec, rule)``: the parse of :func:`parse_policy` and the rule object it made to check
    the parameters (None for a controller, whose heads file :meth:`PolicySpec.clone` loads)."""
    if not isinstance(text, str) or not text.strip():
        raise PolicyError(f"{where}: expected a name such as 'lru' or 'decayed:0.9', got {text!r}")
    kind = kind_of(text)
    if kind is None:
        name = text.strip().partition(":")[0]
        raise PolicyError(f"unknown policy {name!r} (known: {', '.join(available_policies())}; set-holding, "
                          f"in eval and the offloaded runtime: {', '.join(SET_HOLDING)})")
    if kind not in kinds:
        raise wrong_kind(text, kind, where, kinds)
    name, _, arg = text.strip().partition(":")
    name = name.lower()
    if kind == "set-holding":
        rule = None if name == "controller" else parse_holding_spec(f"{name}:{arg}")
        name = RENAMED.get(name, name)
    else:
        rule = make_policy(text.strip())
    canonical = text.strip() if rule is None else rule.spec
    params = tuple(canonical.partition(":")[2].split(":")) if ":" in canonical else ()
    return PolicySpec(kind, name, params, canonical), rule


def parse_policy(text, kinds: tuple[str, ...] = KINDS, where: str = "policy") -> PolicySpec:
    """Parse ``text`` once: its kind, checked parameters and canonical form (see the module docstring).
    A kind outside ``kinds``, an unknown name or a bad parameter is one :class:`PolicyError` line;
    ``kinds`` is a tuple of :data:`KINDS` (a string such as ``"eviction"`` had been read letter by letter)."""
    if isinstance(kinds, str) or not isinstance(kinds, (tuple, list)) or not kinds or any(
            k not in KINDS for k in kinds):
        raise PolicyError(f"parse_policy: kinds must be a non-empty tuple of {', '.join(map(repr, KINDS))}, "
                          f"got {short(kinds, 40)}")
    return _parse(text, kinds, where)[0]


def check_kind(policy, kinds: tuple[str, ...], where: str = "policy"):
    """``policy`` (a string, or a rule object already made) as a rule object, after checking that it
    is of one of ``kinds``: the rule the parse of the string made (a scorer or heads file read once),
    or the object itself."""
    if isinstance(policy, str):
        spec, rule = _parse(policy, kinds, where)
        return spec.clone() if rule is None else rule
    if not isinstance(policy, Policy) and not isinstance(getattr(policy, "spec", None), str):
        raise PolicyError(f"{where}: expected a policy string such as 'lru' or a rule object, got {short(policy, 40)}")
    kind = ("eviction" if policy.admits else "admission") if isinstance(policy, Policy) else "set-holding"
    if kind not in kinds:
        raise wrong_kind(policy.spec, kind, where, kinds)
    return policy
