"""Prompts, the model's own generations, their token log-probs and their routing at one layer.

* :func:`make_prompts`: ``[steps, per_step, prompt_len]`` windows of a token stream at seeded
  random offsets, the optional cache-size tag's ids in front of each; fixed before training, so
  the GRPO run and its SFT control see the same prompts under the same seed;
* :func:`sample`: ``group`` continuations of exactly ``max_new_tokens`` tokens each (no stop at
  an end-of-text token), sampled from the model's softmax at ``temperature`` with a KV cache and
  an explicit ``torch.Generator`` (bitwise reproducible on the CPU for a fixed thread count);
* :func:`score`: one teacher-forced forward over prompt + generation: the log-prob of every
  generated token, and (optionally) the ``[rows, positions, k]`` experts the layer routed each
  position to, read at the experts module's input (``top_k_index``) -- what was actually served.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from ..errors import ConfigError
from ..hf.model import ExpertsSite, cache_argument


def make_prompts(stream: np.ndarray, steps: int, per_step: int, length: int, seed: int,
                 prefix: list[int] | None = None) -> np.ndarray:
    """Seeded prompt windows (see the module docstring); ``stream`` is a 1-d array of token ids."""
    stream = np.asarray(stream, dtype=np.int64).ravel()
    if stream.size < length:
        raise ConfigError(f"the text has {stream.size} tokens, fewer than --prompt-len {length}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, stream.size - length + 1, size=(steps, per_step))
    windows = stream[starts[..., None] + np.arange(length)]
    if prefix:
        tag = np.broadcast_to(np.asarray(prefix, dtype=np.int64), (steps, per_step, len(prefix)))
        windows = np.concatenate([tag, windows], axis=2)
    return windows


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: torch.Tensor, group: int, max_new_tokens: int, temperature: float,
           generator: torch.Generator) -> torch.Tensor:
    """``[group, len(prompt) + max_new_tokens]`` ids: the prompt, then sampled tokens."""
    ids = prompt.reshape(1, -1).repeat(group, 1)
    key = cache_argument(model)
    out = model(input_ids=ids, use_cache=True)
    new = []
    for i in range(max_new_tokens):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        new.append(nxt)
        if i + 1 < max_new_tokens:
            out = model(input_ids=nxt, use_cache=True, **{key: out.past_key_values})
    return torch.cat([ids, *new], dim=1)


@contextmanager
def router_logits_of(site: ExpertsSite):
    """Record the router logits of ``site`` (with their gradient; list of ``[tokens, E]`` tensors)."""
    seen: list[torch.Tensor] = []
    if site.router is None:
        raise ConfigError(f"layer {site.layer}: its router module was not found (the load-balance term needs it)")

    def hook(module, args, output):
        logits = output[site.router_output_index] if isinstance(output, (tuple, list)) else output
        seen.append(logits.reshape(-1, logits.shape[-1]))

    handle = site.router.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def balance_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch / OLMoE load-balancing loss of one layer's router over ``logits [tokens, E]``:
    ``E * sum_e f_e * P_e``, ``f_e`` the share of the tokens' top-``k`` selections that go to ``e``
    (times k; no gradient), ``P_e`` the mean router probability of ``e``. It is ``k`` when the load
    is uniform and grows as it concentrates."""
    probs = torch.softmax(logits.float(), dim=-1)
    E = probs.shape[-1]
    chosen = torch.topk(probs, top_k, dim=-1).indices
    f = torch.zeros(E, dtype=probs.dtype).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel())) / probs.shape[0]
    return E * (f.detach() * probs.mean(dim=0)).sum()


@contextmanager
def routing_of(site: ExpertsSite):
    """Record the ``top_k_index`` the experts module of ``site`` receives (list of tensors)."""
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        seen.append(index.detach().clone())

    handle = site.experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def score(model: torch.nn.Module, ids: torch.Tensor, prompt_len: int, site: ExpertsSite | None = None):
    """(log-probs ``[rows, generated]`` of the generated tokens, routing ``[rows, positions, k]`` or None)."""
    if site is None:
        logits = model(input_ids=ids, use_cache=False).logits
        routing = None
    else:
        with routing_of(site) as seen:
            logits = model(input_ids=ids, use_cache=False).logits
        if len(seen) != 1:
            raise ConfigError(f"layer {site.layer}: expected one routing call per forward, saw {len(seen)}")
        routing = seen[0].reshape(ids.shape[0], ids.shape[1], -1).numpy()
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
    return logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1), routing
