"""The learned set controller's heads and their file (``heads.pt``).

Per offloaded layer l, on the hidden state h entering the layer's MoE block (the router's input),
normalised ``x = h / rms(h)``, and the router's log-probabilities ``log p`` (softmax over all E
experts of the frozen router's logits):

* termination head: ``z = beta_w . x + beta_c[0] * held + beta_c[1] * missed + beta_b`` and
  ``beta = sigmoid(z)``, where ``held`` = the router probability mass of the experts the layer
  holds before this token (sum of ``p`` over the held set) and ``missed`` = the share of the
  router's own top-k outside that set (0..1): the two cache features;
* selection head: ``mu = mu_a * log p + mu_e * ema + mu_w x + mu_b`` (scores over the E experts),
  ``ema`` the exponential average of ``p`` over the sequence so far, current token included
  (``ema_t = d ema_{t-1} + (1 - d) p_t``, ``ema_{-1} = 0``, d = ``ema_decay``).

Initial heads (``init_heads``, what zero training steps leave): every weight 0 except
``mu_a = 1``, so ``beta = 0.5`` and the refresh set top-C(mu) is the router's own top-C.

File: a plain dict of float32 tensors and a ``config`` dict of str/int/float/list values, saved
with ``torch.save`` and read with ``torch.load(weights_only=True)`` (no arbitrary objects are
unpickled), at most :data:`MAX_FILE_BYTES`. ``format`` = ``"expertcache-controller"``,
``version`` = 1; tensors stacked over the file's layers (``config["layers"]``, in order):
``beta_w [L, H]``, ``beta_c [L, 2]``, ``beta_b [L]``, ``mu_a [L]``, ``mu_e [L]``, ``mu_w [L, E, H]``,
``mu_b [L, E]``. Anything else (missing, wrong shape, not finite, another version) is one
:class:`ConfigError` line naming the file and the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .._io import atomic_open
from .._text import first_line
from ..errors import ConfigError, is_int

FORMAT = "expertcache-controller"
VERSION = 1
MAX_FILE_BYTES = 64 * 10**6
EMA_DECAY = 0.9
TENSORS = ("beta_w", "beta_c", "beta_b", "mu_a", "mu_e", "mu_w", "mu_b")
CONFIG_KEYS = ("layers", "capacity", "num_experts", "hidden_size", "top_k", "warmup", "ema_decay", "objective", "seed")


def _shapes(L: int, E: int, H: int) -> dict:
    return {"beta_w": (L, H), "beta_c": (L, 2), "beta_b": (L,), "mu_a": (L,), "mu_e": (L,), "mu_w": (L, E, H),
            "mu_b": (L, E)}


def init_heads(config: dict) -> dict:
    """The heads before training (see the module docstring): a dict of float32 tensors."""
    L, E, H = len(config["layers"]), int(config["num_experts"]), int(config["hidden_size"])
    out = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in _shapes(L, E, H).items()}
    out["mu_a"].fill_(1.0)
    return out


def save_heads(path, heads: dict, config: dict) -> int:
    """Write ``heads`` (name -> tensor) and ``config`` atomically; returns the file's size in bytes."""
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ConfigError(f"controller heads: config lacks {missing[0]!r}")
    blob = {"format": FORMAT, "version": VERSION, "config": dict(config),
            **{k: heads[k].detach().to("cpu", torch.float32).contiguous().clone() for k in TENSORS}}
    with atomic_open(path, "wb") as fh:
        torch.save(blob, fh)
    return os.path.getsize(path)


@dataclass(frozen=True, eq=False)
class Heads:
    """A loaded heads file: ``config`` and the tensors (float32, on the CPU)."""

    path: str
    config: dict
    tensors: dict

    @property
    def layers(self) -> list[int]:
        return list(self.config["layers"])

    def layer(self, layer_id: int) -> dict:
        """The tensors of one layer (row ``layers.index(layer_id)`` of each)."""
        i = self.layers.index(layer_id)
        return {k: v[i] for k, v in self.tensors.items()}


def load_heads(path: str, what: str = "controller") -> Heads:
    """Read and check a heads file; every problem is one ConfigError line naming ``path``."""
    where = f"{what}: {path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file (train one with 'expertcache controller train')")
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{where}: {size:,} bytes, more than a heads file's {MAX_FILE_BYTES:,}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors, zip errors, refused globals: all "not a heads file"
        raise ConfigError(f"{where}: not a controller heads file ({first_line(exc)[:200]})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ConfigError(f"{where}: not a controller heads file (no format {FORMAT!r})")
    if blob.get("version") != VERSION:
        raise ConfigError(f"{where}: heads file version {blob.get('version')!r}, this expertcache reads version {VERSION}")
    config = blob.get("config")
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config is missing")
    for key in CONFIG_KEYS:
        if key not in config:
            raise ConfigError(f"{where}: config lacks {key!r}")
    layers = config["layers"]
    if not (isinstance(layers, list) and layers and all(is_int(x, 0) for x in layers)
            and len(set(layers)) == len(layers)):
        raise ConfigError(f"{where}: config layers must be a non-empty list of distinct layer ids")
    for key in ("capacity", "num_experts", "hidden_size", "top_k"):
        v = config[key]
        if not is_int(v, 1, 1 << 20):
            raise ConfigError(f"{where}: config {key} must be a positive integer, got {v!r}")
    if not is_int(config["warmup"], 1, 1 << 20):
        raise ConfigError(f"{where}: config warmup must be a positive integer, got {config['warmup']!r}")
    d = config["ema_decay"]
    if not isinstance(d, float) or not 0.0 <= d < 1.0:
        raise ConfigError(f"{where}: config ema_decay must be a number in [0, 1), got {d!r}")
    shapes = _shapes(len(layers), config["num_experts"], config["hidden_size"])
    tensors = {}
    for name, shape in shapes.items():
        t = blob.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(f"{where}: tensor {name} must be float32 of shape {list(shape)}, got {got}")
        if not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{where}: tensor {name} holds NaN or infinity")
        tensors[name] = t
    return Heads(str(path), dict(config), tensors)


# -- the head functions, shared by the live holder and training ----------------------------------------
def normalise(h: torch.Tensor) -> torch.Tensor:
    """``x = h / rms(h)`` over the hidden dimension (float32)."""
    h = h.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def beta_linear(x: torch.Tensor, w: dict) -> torch.Tensor:
    """The part of the termination logit z that does not depend on the held set: ``beta_w . x + beta_b``."""
    return x @ w["beta_w"] + w["beta_b"]


def beta_cache(held: torch.Tensor, missed: torch.Tensor, w: dict) -> torch.Tensor:
    """The part of z from the cache features."""
    return w["beta_c"][0] * held + w["beta_c"][1] * missed


def mu_scores(x: torch.Tensor, logp: torch.Tensor, ema: torch.Tensor, w: dict) -> torch.Tensor:
    """Selection scores over the experts (``[..., E]``)."""
    return w["mu_a"] * logp + w["mu_e"] * ema + x @ w["mu_w"].T + w["mu_b"]


def ema_of(p: torch.Tensor, decay: float, start: torch.Tensor | None = None) -> torch.Tensor:
    """``ema_t = d ema_{t-1} + (1 - d) p_t`` along dimension -2 (positions), from ``start`` (default 0)."""
    out = torch.empty_like(p)
    prev = torch.zeros_like(p[..., 0, :]) if start is None else start
    for t in range(p.shape[-2]):
        prev = decay * prev + (1.0 - decay) * p[..., t, :]
        out[..., t, :] = prev
    return out


def top_c(scores: np.ndarray, C: int) -> np.ndarray:
    """The C experts of highest score, ties to the smaller id, sorted by id."""
    E = scores.shape[-1]
    order = np.lexsort((np.arange(E), -scores))
    return np.sort(order[:C])


def threshold_logit(thr: float) -> float:
    """``logit(thr)``: refresh when z > this (``-inf`` at 0: always; ``+inf`` at >= 1: never)."""
    if thr <= 0.0:
        return -np.inf
    if thr >= 1.0:
        return np.inf
    return float(np.log(thr) - np.log1p(-thr))
