"""Routing restricted to a resident set, exactly as each model family's router routes.

A set-holding policy (``dwell``, ``prefix``) lets the router choose only among the experts it
holds. The restriction must not change anything else: the router's scores are computed as the
model computes them, the scores of experts outside the set are masked *before the router's own
top-k*, and the chosen experts' weights are the family's (normalised over the top-k only where the
family normalises). A row whose unrestricted choice lies inside the set keeps it as the router
made it (its own top-k call, so even ties among equal scores break the same way); so when the set
holds every expert the router would have chosen, the result is bitwise the router's own
(``dwell:1:1`` is lossless on-demand loading).

Families covered (transformers v5 router classes; softmax over all experts, then top-k):

* ``OlmoeTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``: weights = the top-k
  probabilities, divided by their sum when ``norm_topk_prob``, cast to the logits' dtype;
* ``MixtralTopKRouter``: the top-k probabilities always divided by their sum, kept in float32.

Refused with one line: group-limited sigmoid routers (DeepSeek-V3 ``DeepseekV3TopkRouter``: the
group choice would change with the mask, so "the same routing, restricted" is not defined) and
any router class not listed. :func:`check_router` also runs the re-implementation against the
router itself on a random probe and refuses the model if they differ (another release's router).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import ConfigError

Route = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _softmax_topk(norm: "bool | None", cast: bool) -> Route:
    def route(router, logits, allowed):
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        _, own = torch.topk(probs, router.top_k, dim=-1)  # the router's own choice, its own tie-breaks
        inside = allowed.gather(1, own).all(dim=1, keepdim=True)
        if bool(inside.all()):
            index = own
        else:  # rows whose choice leaves the set: top-k among the allowed experts only
            choice = probs.masked_fill(~allowed, -1.0)  # probabilities are >= 0: a masked expert is never chosen
            index = torch.where(inside, own, torch.topk(choice, router.top_k, dim=-1).indices)
        top = probs.gather(1, index)
        if norm is None and router.norm_topk_prob or norm:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if cast else top), index

    return route


ROUTES: dict[str, Route] = {
    "OlmoeTopKRouter": _softmax_topk(None, cast=True),
    "Qwen2MoeTopKRouter": _softmax_topk(None, cast=True),
    "Qwen3MoeTopKRouter": _softmax_topk(None, cast=True),
    "MixtralTopKRouter": _softmax_topk(True, cast=False),
}


def route_for(router: torch.nn.Module | None, layer: int, what: str) -> Route:
    """The masked routing of ``router`` (checked against the router itself), or a one-line refusal."""
    name = type(router).__name__ if router is not None else None
    route = ROUTES.get(name)
    if route is None:
        why = "its router is not exposed" if router is None else f"its router is {name}"
        if name == "DeepseekV3TopkRouter":
            why += " (group-limited sigmoid routing: restricting it to a resident set is not defined)"
        raise ConfigError(
            f"{what} restricts routing to resident experts, which expertcache implements for the routers of "
            f"olmoe, mixtral, qwen2_moe and qwen3_moe; layer {layer}: {why}"
        )
    check_router(router, route, layer)
    return route


@torch.no_grad()
def check_router(router: torch.nn.Module, route: Route, layer: int) -> None:
    """Refuse the router if the re-implementation, unrestricted, differs from it on a random probe."""
    weight = router.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(8, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    out = router.forward(probe)  # not router(...): a capture's hooks must not see the probe
    logits, weights, index = out[0], out[1], out[2]
    mine_w, mine_i = route(router, logits, torch.ones_like(logits, dtype=torch.bool))
    if not (torch.equal(mine_i, index) and torch.equal(mine_w, weights)):
        raise ConfigError(
            f"layer {layer}: {type(router).__name__} routes differently from expertcache's masked re-implementation "
            "(an unsupported transformers release?)"
        )
