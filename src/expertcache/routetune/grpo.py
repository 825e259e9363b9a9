"""GRPO on the cache-hit reward, and the SFT control (after Shao et al.; Calanzone et al.).

One step, for each of ``prompts_per_step`` prompts (fixed in advance, :func:`.rollout.make_prompts`):

1. sample ``G`` generations of ``M`` tokens from the current model (its own generations);
2. score them with the current weights (no gradient): old log-probs ``lp_old`` and the routing at
   ``layer``; reward ``r_g`` = the simulated LRU hit rate of ``cache`` slots over the generated
   tokens' router passes, the prompt's passes warming the pool (:mod:`.reward`);
   advantages ``A_g`` = group-normalised ``r_g``; reference log-probs ``lp_ref`` from the frozen
   starting model;
3. ``inner`` gradient passes: per generated token, ``ratio = exp(lp - lp_old)``,
   ``surrogate = min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``, KL estimate
   ``k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1`` (>= 0, zero at the reference); loss =
   ``-mean_g mean_t (surrogate - beta * k3)``, averaged over the step's prompts; AdamW (no weight
   decay), gradient norm clipped to 1. With ``balance`` > 0 the tuned layer's load-balancing loss
   over the scored positions (:func:`.rollout.balance_loss`) is added with that weight (for
   either objective): the control for the load-collapse explanation of GRPO's lower copies.

The SFT control (``objective="sft"``) runs the same steps on the same prompts, samples the same
way and trains the same parameters on ``mean_g mean_t (-lp)``: learning from its own generations
without the reward. Both log the mean reward and KL of each step's generations.

The reward only reaches the weights through the generated tokens' log-probs: the router learns to
make generations whose routing hits more likely, not to route a fixed text differently (which is
what the teacher-forced harness then measures).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import TuneConfig
from .lora import merge, trainable
from .reward import group_advantages, reward_of
from .rollout import balance_loss, router_logits_of, sample, score
from ..hf.model import ExpertsSite, find_sites, top_k_of


@dataclass
class StepLog:
    step: int
    reward: float       # mean reward of the step's generations (before the update)
    reward_std: float   # mean over prompts of the group's reward std
    kl: float           # mean k3 estimate to the reference over the step's generated tokens
    loss: float

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("step", "reward", "reward_std", "kl", "loss")}


@dataclass
class TuneResult:
    config: TuneConfig
    log: list[StepLog] = field(default_factory=list)
    seconds: float = 0.0
    trained_parameters: int = 0
    merged_weights: int = 0

    def summary(self) -> dict:
        rewards = [s.reward for s in self.log]
        tail = max(1, len(rewards) // 5)
        return {
            "objective": self.config.objective, "layer": self.config.layer, "cache": self.config.cache,
            "steps": len(self.log), "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "reward_head_mean": float(np.mean(rewards[:tail])) if rewards else None,
            "reward_tail_mean": float(np.mean(rewards[-tail:])) if rewards else None,
            "kl_last": self.log[-1].kl if self.log else None, "seconds": self.seconds,
            "trained_parameters": self.trained_parameters, "merged_weights": self.merged_weights,
        }


def site_at(model: torch.nn.Module, layer: int) -> ExpertsSite:
    return {s.layer: s for s in find_sites(model)}[layer]


def group_rewards(config: TuneConfig, routing: np.ndarray, prompt_len: int, num_experts: int) -> np.ndarray:
    """The reward of each generation (row of ``routing``: ``[positions, k]``)."""
    return np.array([reward_of(config.reward, r, config.cache, num_experts, warm=prompt_len) for r in routing])


def tune(model: torch.nn.Module, prompts: np.ndarray, config: TuneConfig, progress=None) -> TuneResult:
    """Fine-tune ``model`` in place (float32, CPU) over ``prompts`` ``[steps, per_step, P]``; the
    trained weights are merged back into the stock layout before returning."""
    config.check()
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    model.float().eval()
    reference = copy.deepcopy(model).requires_grad_(False)
    site = site_at(model, config.layer)
    top_k = top_k_of(model)
    params = trainable(model, site, config.lora_rank, config.lora_alpha, config.lora_targets, generator)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    result = TuneResult(config, trained_parameters=sum(p.numel() for p in params))
    prompt_len = prompts.shape[2]
    start = time.perf_counter()
    for step in range(config.steps):
        batch = []
        for prompt in prompts[step]:
            ids = sample(model, torch.from_numpy(prompt), config.group, config.max_new_tokens,
                         config.temperature, generator)
            with torch.no_grad():
                lp_old, routing = score(model, ids, prompt_len, site)
                lp_ref, _ = score(reference, ids, prompt_len)
            rewards = group_rewards(config, routing, prompt_len, site.num_experts)
            adv = torch.from_numpy(group_advantages(rewards)).float()[:, None]
            batch.append((ids, lp_old, lp_ref, rewards, adv))
        for _ in range(config.inner):
            optimizer.zero_grad(set_to_none=True)
            total, kls = 0.0, []
            for ids, lp_old, lp_ref, _, adv in batch:
                with router_logits_of(site) as logits:
                    lp, _ = score(model, ids, prompt_len)
                delta = lp_ref - lp
                k3 = torch.exp(delta) - delta - 1.0
                if config.objective == "grpo":
                    ratio = torch.exp(lp - lp_old)
                    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - config.clip, 1 + config.clip) * adv)
                    loss = -(surrogate - config.kl * k3).mean(dim=1).mean()
                else:
                    loss = -lp.mean(dim=1).mean()
                if config.balance > 0:
                    loss = loss + config.balance * balance_loss(torch.cat(logits), top_k)
                (loss / len(batch)).backward()
                total += float(loss.detach()) / len(batch)
                kls.append(float(k3.detach().mean()))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        rewards_all = np.concatenate([b[3] for b in batch])
        result.log.append(StepLog(step, float(np.mean(rewards_all)), float(np.mean([b[3].std() for b in batch])),
                                  float(np.mean(kls)), total))
        if progress is not None:
            progress(result.log[-1])
    result.merged_weights = merge(model)
    result.seconds = time.perf_counter() - start
    return result


@torch.no_grad()
def simulated_hit_rate(model: torch.nn.Module, prompts: np.ndarray, config: TuneConfig, seed: int) -> float:
    """Mean reward of ``config.group`` generations per prompt (``prompts`` ``[n, P]``) sampled with
    ``seed``: the training logs' instrument, applied to any model (base or tuned)."""
    generator = torch.Generator().manual_seed(seed)
    site = site_at(model, config.layer)
    values = []
    for prompt in prompts:
        ids = sample(model, torch.from_numpy(prompt), config.group, config.max_new_tokens, config.temperature, generator)
        _, routing = score(model, ids, prompts.shape[1], site)
        values.append(group_rewards(config, routing, prompts.shape[1], site.num_experts))
    return float(np.mean(np.concatenate(values)))
