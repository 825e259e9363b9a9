"""Set-holding (lossy) policies: hold a resident set, let the router choose only inside it.

``dwell:k[:w]`` holds the resident set for k tokens, then refills it with the C experts requested
most in the last w tokens (default w = 8k, the current token included), refreshing every token
until the window first fills (the eviction paper's warm start). ``prefix:P`` (the paper's
"Static"; ``static:P`` is its old spelling) refreshes every token
for the first P tokens of a sequence, then keeps the set it has: ``dwell`` with k = infinity and
w = P. Between refreshes nothing is copied and the router may choose only among resident experts
(:mod:`.routing` masks the scores of the others before the router's own top-k).

"Requests" in the window counts are the *unrestricted* demand: the experts the router would have
chosen without the restriction (its own top-k), per token position (the union over a batch's
rows). A refresh picks the experts with the most requests in the window, ties broken by the most
recent request, then the smaller id; when fewer than C experts were requested in the window, the
set keeps its current members (most recently requested first) to fill C. A refresh copies only
experts not already resident (:math:`|R_{new} \\setminus R_{old}|`), each into the slot of an
expert leaving the set, or a free slot while the pool is filling. Every pool starts empty at each
stream, like the lossless rules'.

``dwell:1:1`` refreshes every token to the current token's own demand, so routing is never
restricted: it is lossless on-demand loading (the paper's exactness check).
"""

from __future__ import annotations

from ..policies.registry import HOLDING_MAKERS, RENAMED, HoldingSpec, parse_holding_spec
from .controller import parse_controller
from .setholder import SetHolder, SlotMap

__all__ = ["HOLDING", "HoldingSpec", "SetHolder", "SlotMap", "parse_holding"]

HOLDING = ("dwell", "prefix")


def parse_holding(spec) -> HoldingSpec | None:
    """The set-holding spec ``spec`` names, ``None`` when it names another kind of policy
    (``controller:PATH:THR[:W]`` gives a :class:`~.controller.ControllerSpec`); the parse itself is
    :mod:`expertcache.policies.registry`' (one definition for every entry point)."""
    if not isinstance(spec, str):
        return None
    name = spec.partition(":")[0]
    if name in HOLDING_MAKERS:  # the learned controller (heads from a file): see .controller
        return HOLDING_MAKERS[name](spec)
    if name not in HOLDING and name not in RENAMED:
        return None
    return parse_holding_spec(spec)


HOLDING_MAKERS["controller"] = parse_controller  # PolicySpec.clone() and parse_holding of a controller string
