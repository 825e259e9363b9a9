"""A router fine-tuned for cache hits: GRPO on a simulated LRU hit rate, and its SFT control
(docs/router_tune.md; the eviction paper's "A router fine-tuned for cache hits").

==============  ===============================================================================
module          concept
==============  ===============================================================================
``reward``      the LRU hit-rate reward (``expertcache.cache.ExpertCache`` + ``lru``), advantages
``config``      :class:`TuneConfig` and its checks
``rollout``     prompts, the model's own generations, token log-probs, routing at one layer
``lora``        what is trained: the router, or merged LoRA on router / experts / attention
``grpo``        the GRPO loop and the SFT control
``output``      the atomic checkpoint folder
``run``         :func:`router_tune`: load, check, tune, save
==============  ===============================================================================

``reward`` and ``config`` need only numpy; the rest needs torch and transformers (the ``hf``
extra) and is imported on use, so ``import expertcache.routetune`` works without them.
"""

from __future__ import annotations

from .config import CONFIG_FILE, TARGETS, TuneConfig, cache_tag
from .reward import REWARDS, group_advantages, lru_hit_rate, reward_of

__all__ = ["CONFIG_FILE", "REWARDS", "TARGETS", "TuneConfig", "cache_tag", "group_advantages", "lru_hit_rate",
           "reward_of"]
