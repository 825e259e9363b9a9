"""Training the learned set controller's heads on a frozen model (``expertcache controller train``).

The model never changes: every parameter is frozen and only the heads of :mod:`.controller_heads`
learn. Each step takes ``batch`` windows of ``seq_len`` tokens from the training text (random
starts drawn from ``seed``), runs the model with each offloaded layer's router hooked, and updates
the heads with Adam. Positions ``t < warmup`` of each window follow ``prefix:W``'s warm-up, exactly
as at inference; the heads decide from ``t = warmup`` on. Rates below are per token position
``t >= warmup`` and per layer, summed over the offloaded layers (as ``rho`` is).

``differentiable`` (the paper's first objective): the held set is a soft membership ``m_t`` in
[0, 1]^E, ``m_t = (1 - beta_t) m_{t-1} + beta_t r_t`` with ``r_t = sigmoid((mu_t - cut_t) / T)``
(cut_t midway between the C-th and (C+1)-th score: a soft top-C); the router's weights become
``p * m_t`` at the top-k of ``p * m_t`` (normalised where the family normalises), so the next-token
NLL flows back through the mixture (1 - beta) keep + beta refresh into both heads. Loss =
NLL + w_refresh * E[beta] + w_changed * E[sum_e beta relu(r_t - m_{t-1})] (expected copies)
+ w_miss * E[sum over the router's own top-k of (1 - m_t)] (expected misses)
+ w_undecided * E[4 beta (1 - beta)] + w_kl * E[KL(p || normalised p * m_t)].

``reinforce`` (the second): each window is run ``samples`` times with hard decisions sampled from
the heads (refresh ~ Bernoulli(beta); the refresh set ~ Plackett-Luce over mu, i.e. Gumbel top-C),
the router masked exactly as at inference (:mod:`.routing`). Reward of a run = -(NLL
+ w_refresh * refreshes + w_changed * copies + w_miss * misses), the cache cost being the router's
own top-k requests the held set refused (misses); advantage = reward minus the mean of the same
window's samples; loss = -advantage * log-probability of the decisions (per decision) -
w_entropy * (entropy of beta + entropy of softmax(mu)).

Adam, learning rate ``lr`` for the scalar and per-expert weights and ``lr / 10`` for the weights on
the hidden state (``beta_w``, ``mu_w``: H of them per output, so the same per-weight step moves
their output about sqrt(H) times as far).

Priced variant: with ``price_tau_ms`` the copy penalty is ``w_changed = exchange * tau`` (nats per
copy; ``exchange`` in nats per ms of copy time), the paper's "traffic penalty e * tau".

Deterministic under ``seed`` on one machine and thread count: the windows, the samples and the
(zero) initial heads depend on nothing else.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..errors import ConfigError
from .controller_heads import EMA_DECAY, beta_cache, beta_linear, ema_of, init_heads, mu_scores, normalise
from ..policies.registry import HoldingSpec
from .setholder import SetHolder
from .model import find_sites, model_label, select_sites
from .routing import route_for

OBJECTIVES = ("differentiable", "reinforce")


@dataclass
class TrainOptions:
    """What ``controller train`` takes; the weights are the hand-set defaults unless priced."""

    capacity: int
    objective: str = "differentiable"
    layers: list | None = None
    steps: int = 60
    seed: int = 0
    batch: int = 4
    seq_len: int = 128
    lr: float = 0.02
    warmup: int = 8
    samples: int = 4
    w_refresh: float = 0.01
    w_changed: float = 0.05
    w_miss: float = 0.02
    w_undecided: float = 0.01
    w_kl: float = 0.05
    w_entropy: float = 0.001
    temperature: float = 0.25
    price_tau_ms: float | None = None
    exchange: float = 0.02

    @property
    def copy_weight(self) -> float:
        return self.exchange * self.price_tau_ms if self.price_tau_ms is not None else self.w_changed


def train_controller(model, ids: np.ndarray, opts: TrainOptions, log=None) -> tuple[dict, dict, dict]:
    """Train heads on ``ids`` (a 1-d token stream): returns (tensors, config, summary)."""
    if opts.objective not in OBJECTIVES:
        raise ConfigError(f"--objective: {opts.objective!r} is not one of {', '.join(OBJECTIVES)}")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if opts.warmup >= opts.seq_len:
        raise ConfigError(f"--warmup {opts.warmup} must be below --seq-len {opts.seq_len}")
    if ids.size < opts.seq_len + 1:
        raise ConfigError(f"training tokens: {ids.size}, fewer than one window of --seq-len {opts.seq_len} + 1")
    if opts.batch > ids.size - opts.seq_len:  # a step holds the batch's activations: never more than the windows
        raise ConfigError(f"--batch {opts.batch}: more than the {ids.size - opts.seq_len:,} windows of --seq-len "
                          f"{opts.seq_len} the {ids.size:,} training tokens hold")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if ids.size and (ids.min() < 0 or (isinstance(vocab, int) and ids.max() >= vocab)):
        raise ConfigError(f"training tokens: ids must lie in [0, {vocab}) for this model, got {ids.min()}..{ids.max()}")
    sites = select_sites(find_sites(model), opts.layers, model_label(model))
    routes = [route_for(s.router, s.layer, "controller training") for s in sites]
    E, H = sites[0].num_experts, int(sites[0].router.weight.shape[1])
    k = int(sites[0].router.top_k)
    C = min(int(opts.capacity), E)
    if opts.capacity < k:
        raise ConfigError(f"--capacity {opts.capacity} is below the {k} experts one token requests at a layer")
    config = {"layers": [s.layer for s in sites], "capacity": int(opts.capacity), "num_experts": E, "hidden_size": H,
              "top_k": k, "warmup": int(opts.warmup), "ema_decay": EMA_DECAY, "objective": opts.objective,
              "seed": int(opts.seed), "steps": int(opts.steps), "options": {k_: v for k_, v in asdict(opts).items()
                                                                             if k_ not in ("layers", "capacity")}}
    torch.manual_seed(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    rng = np.random.default_rng(opts.seed)
    params = {n: torch.nn.Parameter(t) for n, t in init_heads(config).items()}
    wide = ("beta_w", "mu_w")  # the weights on the hidden state (H per expert): a tenth of the rate
    optim = torch.optim.Adam([{"params": [params[n] for n in wide], "lr": opts.lr * 0.1},
                              {"params": [p for n, p in params.items() if n not in wide], "lr": opts.lr}])
    model.eval()
    model.requires_grad_(False)
    ctx = _Context(opts, C, k, gen)
    hooks = [s.router.register_forward_hook(_hook(ctx, i, s.router, route, params))
             for i, (s, route) in enumerate(zip(sites, routes))]
    history, start = [], time.perf_counter()
    try:
        for step in range(opts.steps):
            starts = rng.integers(0, ids.size - opts.seq_len, size=opts.batch)
            x = torch.from_numpy(np.stack([ids[s : s + opts.seq_len] for s in starts]))
            loss, stats = (_reinforce_step if opts.objective == "reinforce" else _differentiable_step)(model, x, ctx)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            history.append(stats)
            if log and (step + 1) % 10 == 0:
                log(f"step {step + 1}: " + ", ".join(f"{k_} {v:.4f}" for k_, v in stats.items()))
    finally:
        for h in hooks:
            h.remove()
    bad = next((n for n, p in params.items() if not torch.isfinite(p).all()), None)
    if bad is not None:  # nothing is written: eval would refuse the file anyway
        raise ConfigError(f"training diverged: head {bad} holds NaN or infinity after {opts.steps} steps (last loss "
                          f"{history[-1]['loss']:g}); lower --lr or the copy price (--exchange, --price-tau)")
    last = history[-10:]
    summary = {"steps": opts.steps, "seconds": time.perf_counter() - start, "objective": opts.objective,
               "copy_weight": opts.copy_weight, "layers": config["layers"], "capacity": opts.capacity,
               **{f"final_{k_}": float(np.mean([h[k_] for h in last])) for k_ in (last[0] if last else {})}}
    return {n: p.detach().clone() for n, p in params.items()}, config, summary


class _Context:
    """What the hooks share during one step: the mode, the window shape and what each layer reports."""

    def __init__(self, opts: TrainOptions, C: int, k: int, gen: torch.Generator):
        self.opts, self.C, self.k, self.gen = opts, C, k, gen
        self.mode = "differentiable"
        self.shape = (0, 0)
        self.out: list[dict] = []


def _differentiable_step(model, x, ctx: _Context):
    ctx.mode, ctx.shape, ctx.out = "differentiable", tuple(x.shape), []
    logits = model(input_ids=x, use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
    o = ctx.opts
    parts = {n: sum(d[n] for d in ctx.out) for n in ("refresh", "changed", "miss", "undecided", "kl")}
    values = {n: v.item() for n, v in parts.items()}
    loss = (nll + o.w_refresh * parts["refresh"] + o.copy_weight * parts["changed"] + o.w_miss * parts["miss"]
            + o.w_undecided * parts["undecided"] + o.w_kl * parts["kl"])
    return loss, {"loss": loss.item(), "nll": nll.item(), **values}


def _reinforce_step(model, x, ctx: _Context):
    S = ctx.opts.samples
    xs = x.repeat_interleave(S, dim=0)
    ctx.mode, ctx.shape, ctx.out = "reinforce", tuple(xs.shape), []
    with torch.no_grad():
        logits = model(input_ids=xs, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), xs[:, 1:], reduction="none").mean(1)
    o = ctx.opts
    rates = {n: sum(d[n] for d in ctx.out) for n in ("refresh", "changed", "miss")}
    cost = nll + o.w_refresh * rates["refresh"] + o.copy_weight * rates["changed"] + o.w_miss * rates["miss"]
    reward = -cost.reshape(-1, S)
    advantage = (reward - reward.mean(1, keepdim=True)).reshape(-1)
    logpi = sum(d["logpi"] for d in ctx.out)
    entropy = sum(d["entropy"] for d in ctx.out)
    loss = -(advantage * logpi).mean() - o.w_entropy * entropy
    return loss, {"loss": cost.mean().item(), "nll": nll.mean().item(),
                  **{n: v.mean().item() for n, v in rates.items()}, "entropy": entropy.detach().item()}


def _warm_masks(own: np.ndarray, W: int, E: int, C: int) -> torch.Tensor:
    """``[rows, W, E]`` held sets of ``prefix:W`` over the first W positions of each row (its own demand)."""
    out = np.zeros((own.shape[0], W, E), dtype=bool)
    for r in range(own.shape[0]):
        holder = SetHolder(HoldingSpec("prefix", None, W), E, C)
        for t in range(W):
            holder.step(own[r, t])
            out[r, t, holder.current] = True
    return torch.from_numpy(out)


def _hook(ctx: _Context, i: int, router, route, params: dict):
    norm = type(router).__name__ == "MixtralTopKRouter" or bool(getattr(router, "norm_topk_prob", False))

    def hook(module, args, output):
        logits, index = output[0], output[2]
        rows_b, T = ctx.shape
        E, k, C, W = logits.shape[-1], ctx.k, ctx.C, ctx.opts.warmup
        own = index.reshape(rows_b, T, k)
        warm = _warm_masks(own.detach().numpy(), W, E, C)
        with torch.enable_grad():  # reinforce runs the model under no_grad; the heads still learn
            w = {n: p[i] for n, p in params.items()}
            hidden = args[0] if ctx.mode == "differentiable" else args[0].detach()
            lg = logits if ctx.mode == "differentiable" else logits.detach()
            x = normalise(hidden.reshape(rows_b, T, -1))
            logp = torch.log_softmax(lg.float(), -1).reshape(rows_b, T, E)
            p = logp.exp()
            mu = mu_scores(x, logp, ema_of(p.detach(), EMA_DECAY), w)
            lin = beta_linear(x, w)
            if ctx.mode == "differentiable":
                return _soft(ctx, w, output, p, logp, own, mu, lin, warm, norm)
            return _sampled(ctx, w, module, route, output, p, own, mu, lin, warm)

    return hook


def _soft(ctx, w, output, p, logp, own, mu, lin, warm, norm):
    logits = output[0]
    B, T, E = p.shape
    k, C, W, n = ctx.k, ctx.C, ctx.opts.warmup, p.shape[0] * (p.shape[1] - ctx.opts.warmup)
    if C < E:
        top = mu.detach().topk(C + 1, dim=-1).values
        r = torch.sigmoid((mu - 0.5 * (top[..., C - 1] + top[..., C])[..., None]) / ctx.opts.temperature)
    else:
        r = torch.ones_like(mu)
    m_prev = warm[:, W - 1].float()
    ms = [warm.float()]
    acc = dict(refresh=0.0, changed=0.0, miss=0.0, undecided=0.0)
    for t in range(W, T):
        held = (p[:, t] * m_prev).sum(-1)
        missed = (1.0 - m_prev).gather(1, own[:, t]).sum(-1) / k
        beta = torch.sigmoid(lin[:, t] + beta_cache(held, missed, w))
        m = (1.0 - beta)[:, None] * m_prev + beta[:, None] * r[:, t]
        acc["refresh"] = acc["refresh"] + beta.sum()
        acc["changed"] = acc["changed"] + (beta * torch.relu(r[:, t] - m_prev).sum(-1)).sum()
        acc["miss"] = acc["miss"] + (1.0 - m).gather(1, own[:, t]).sum()
        acc["undecided"] = acc["undecided"] + 4.0 * (beta * (1.0 - beta)).sum()
        ms.append(m[:, None])
        m_prev = m
    M = torch.cat(ms, dim=1)
    q = p * M
    index = q.topk(k, dim=-1).indices
    weights = q.gather(-1, index)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    qn = q[:, W:] / q[:, W:].sum(-1, keepdim=True).clamp_min(1e-12)
    kl = (p[:, W:] * (logp[:, W:] - torch.log(qn + 1e-12))).sum(-1).mean()
    ctx.out.append({**{n_: v / n for n_, v in acc.items()}, "kl": kl})
    return (logits, weights.reshape(-1, k).to(logits.dtype), index.reshape(-1, k), *tuple(output[3:]))


def _sampled(ctx, w, module, route, output, p, own, mu, lin, warm):
    logits = output[0]
    B, T, E = p.shape
    k, C, W = ctx.k, ctx.C, ctx.opts.warmup
    mu_d = mu.detach()
    u = torch.rand(mu_d.shape, generator=ctx.gen).clamp(1e-12, 1 - 1e-7)
    order = (mu_d - torch.log(-torch.log(u))).topk(C, dim=-1).indices  # Gumbel top-C: a Plackett-Luce sample
    logpl = torch.zeros(B, T)
    if C < E:
        taken = torch.zeros_like(mu_d, dtype=torch.bool)
        for j in range(C):
            logpl = logpl + mu.gather(-1, order[..., j : j + 1])[..., 0] - torch.logsumexp(mu.masked_fill(taken, -1e30), -1)
            taken = taken.scatter(-1, order[..., j : j + 1], True)
    cand = torch.zeros_like(mu_d, dtype=torch.bool).scatter(-1, order, True)
    S = warm[:, W - 1].clone()
    masks = [warm]
    logpi = torch.zeros(B)
    ent = torch.zeros(())
    rate = {"refresh": torch.zeros(B), "changed": torch.zeros(B), "miss": torch.zeros(B)}
    for t in range(W, T):
        held = (p[:, t] * S).sum(-1)
        missed = (~S).gather(1, own[:, t]).sum(-1).float() / k
        z = lin[:, t] + beta_cache(held, missed, w)
        beta = torch.sigmoid(z)
        b = torch.bernoulli(beta.detach(), generator=ctx.gen).bool()
        logpi = logpi + torch.where(b, torch.nn.functional.logsigmoid(z) + logpl[:, t], torch.nn.functional.logsigmoid(-z))
        ent = ent - (beta * torch.log(beta + 1e-12) + (1 - beta) * torch.log(1 - beta + 1e-12)).mean()
        rate["changed"] += ((cand[:, t] & ~S).sum(-1) * b).float()
        S = torch.where(b[:, None], cand[:, t], S)
        rate["refresh"] += b.float()
        rate["miss"] += (~S).gather(1, own[:, t]).sum(-1).float()
        masks.append(S[:, None])
    n = T - W
    sel_ent = -(torch.softmax(mu, -1) * torch.log_softmax(mu, -1)).sum(-1).mean()
    ctx.out.append({"logpi": logpi / n, "entropy": ent / n + sel_ent,
                    **{n_: v / n for n_, v in rate.items()}})
    allowed = torch.cat(masks, dim=1).reshape(B * T, E)
    weights, chosen = route(module, logits, allowed)
    return (logits, weights, chosen, *tuple(output[3:]))
