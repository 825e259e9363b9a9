"""The learned set controller (``controller:PATH:THR[:W]``): a set-holding policy driven by trained heads.

After the option-critic controller of Shen and Henderson as the eviction paper reimplements it
(``../shared/seeds/`` 001, Appendix "The learned controller"). Per offloaded layer, at each token
(one cache step), on the hidden state entering the layer's MoE block:

* warm-up: for the first W tokens of a sequence the set is refreshed every token exactly as
  ``prefix:W`` refreshes it (the W-token demand window's most requested experts; :mod:`.holding`);
* after it, the termination head gives ``beta`` (:mod:`.controller_heads`); when ``beta > THR`` the
  set is refreshed to top-C of the selection head's scores ``mu`` (copies = experts entering the
  set), otherwise it is held. The comparison is made on the logit, ``z > logit(THR)``, so THR = 0
  refreshes at every token and THR >= 1 never does after the warm-up.

Between refreshes the router chooses only among held experts, through the same masked routing
and slot map as ``dwell``/``prefix`` (:mod:`.routing`, :class:`~.holding.SlotMap`). The heads run in
the router's forward hook, inside the timed step. W defaults to the heads file's ``warmup``.

Invariants (tests/test_controller.py): at THR >= 1 the run equals ``prefix:W`` (same sets, copies,
switches and NLL); at THR = 0 with untrained heads (mu = the router's own log-probabilities) and
W = 1 the router's own top-k is always held, so routing is never restricted (lossless). A batch of
b rows steps once per position: ``z`` and ``mu`` are the means over the rows, the cache features
are each row's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError, PolicyError
from .controller_heads import (
    Heads, beta_linear, load_heads, mu_scores, normalise, threshold_logit, top_c,
)
from ..policies.registry import HoldingSpec
from .setholder import SetHolder


@dataclass(frozen=True, eq=False)
class ControllerSpec:
    """A parsed ``controller:PATH:THR[:W]`` with its heads loaded (checked when parsed)."""

    path: str
    threshold: float
    warmup: int
    heads: Heads
    explicit_warmup: bool = False
    name = "controller"
    needs_future = False

    @property
    def spec(self) -> str:
        tail = f":{self.warmup}" if self.explicit_warmup else ""
        return f"controller:{self.path}:{self.threshold:g}{tail}"

    def check_sites(self, sites, capacity: int) -> None:
        """Refuse a run the heads were not trained for: a layer without heads, other E, hidden size or C."""
        cfg, where = self.heads.config, f"policy {self.spec}"
        for site in sites:
            if site.layer not in cfg["layers"]:
                raise ConfigError(f"{where}: the heads file has no heads for layer {site.layer} (its layers: {cfg['layers']})")
            weight = getattr(site.router, "weight", None)
            hidden = int(weight.shape[1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
            if site.num_experts != cfg["num_experts"] or hidden != cfg["hidden_size"]:
                raise ConfigError(f"{where}: heads trained for {cfg['num_experts']} experts of hidden size "
                                  f"{cfg['hidden_size']}, layer {site.layer} has {site.num_experts} and {hidden}")
        if capacity != cfg["capacity"]:
            raise ConfigError(f"{where}: heads trained for capacity {cfg['capacity']}, the run has {capacity}")

    def holder(self, layer: int, num_experts: int, capacity: int) -> "ControllerHolder":
        return ControllerHolder(self, layer, num_experts, capacity)


def parse_controller(spec: str) -> ControllerSpec:
    """``controller:PATH:THR`` or ``controller:PATH:THR:W`` (THR a number >= 0, W a positive integer)."""
    parts = spec.split(":")[1:]
    usage = f"policy controller takes controller:PATH:THR or controller:PATH:THR:W, got {spec!r}"
    if len(parts) < 2:
        raise PolicyError(usage)
    warmup = None
    if len(parts) >= 3 and parts[-1].isdigit() and _number(parts[-2]) is not None:
        warmup = int(parts[-1])
        parts = parts[:-1]
        if warmup < 1:
            raise PolicyError(f"controller: the warm-up W must be a positive integer, got {warmup}")
    thr = _number(parts[-1])
    path = ":".join(parts[:-1])
    if thr is None or not path:
        raise PolicyError(usage)
    if not np.isfinite(thr) or thr < 0:
        raise PolicyError(f"controller: the threshold must be a finite number >= 0, got {parts[-1]!r}")
    heads = load_heads(path, "controller")
    w = warmup if warmup is not None else heads.config["warmup"]
    return ControllerSpec(path, float(thr), int(w), heads, explicit_warmup=warmup is not None)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class ControllerHolder:
    """Which experts one layer holds, token by token: the interface of :class:`~.holding.SetHolder`
    (``reset``, ``step``, ``current``) plus :meth:`observe`, called with each forward's router input."""

    def __init__(self, spec: ControllerSpec, layer: int, num_experts: int, capacity: int):
        self.spec = spec
        self.E = int(num_experts)
        self.C = int(min(capacity, num_experts))
        self.cpu = spec.heads.layer(layer)
        self.weights: dict = {}  # per device
        self.z_thr = threshold_logit(spec.threshold)
        self.decay = float(spec.heads.config["ema_decay"])
        self.warm = SetHolder(HoldingSpec("prefix", None, spec.warmup), num_experts, capacity)
        self.reset()

    def reset(self) -> None:
        self.t = 0
        self.warm.reset()
        self.current = np.zeros(0, dtype=np.int64)
        self.ema: np.ndarray | None = None
        self._obs = None
        self._i = 0

    def _on(self, device) -> dict:
        if device not in self.weights:
            self.weights[device] = {k: v.to(device) for k, v in self.cpu.items()}
        return self.weights[device]

    @torch.no_grad()
    def observe(self, hidden: torch.Tensor, logits: torch.Tensor, own: np.ndarray, b: int, n: int) -> None:
        """Run the heads on a forward's ``b x n`` rows (row ``i * n + t`` is position t of row i)."""
        w = self._on(logits.device)
        x = normalise(hidden.reshape(logits.shape[0], -1))
        logp = torch.log_softmax(logits.float(), dim=-1)
        lin = beta_linear(x, w)
        mu = mu_scores(x, logp, torch.zeros_like(logp), w)  # ema added per step (it is sequential)
        both = torch.cat([lin[:, None], mu, logp.exp()], dim=1).cpu().numpy().astype(np.float64)
        both = both.reshape(b, n, -1).transpose(1, 0, 2)  # [n, b, 1 + 2E]
        E = self.E
        self._obs = (both[:, :, 0], both[:, :, 1 : 1 + E], both[:, :, 1 + E :], own.reshape(b, n, -1).transpose(1, 0, 2))
        self._beta_c = self.cpu["beta_c"].double().numpy()
        self._mu_e = float(self.cpu["mu_e"])
        self._i = 0

    def step(self, demand: np.ndarray) -> np.ndarray | None:
        """Record token t (``demand`` = the unrestricted union); return the new set when refreshed at t."""
        if self._obs is None:
            raise RuntimeError("controller: step without the router's hidden states")
        lin, mu, p, own = (a[self._i] for a in self._obs)
        self._i += 1
        self.ema = (1.0 - self.decay) * p if self.ema is None else self.decay * self.ema + (1.0 - self.decay) * p
        warm = self.warm.step(demand)  # prefix:W's schedule: refreshes every token until t = W - 1
        if self.t < self.spec.warmup:
            new = warm
        else:
            held = np.zeros(self.E, dtype=bool)
            held[self.current] = True
            k = own.shape[1]
            held_mass = (p * held).sum(axis=1)
            missed = (~held[np.maximum(own, 0)] & (own >= 0)).sum(axis=1) / k
            z = lin + self._beta_c[0] * held_mass + self._beta_c[1] * missed
            new = None
            if float(z.mean()) > self.z_thr:
                new = top_c((mu + self._mu_e * self.ema).mean(axis=0), self.C)
        if new is not None:
            self.current = new
        self.t += 1
        return new
