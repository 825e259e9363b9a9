"""The fine-tune's configuration and its checks (no torch): what ``router-tune`` records in the
output folder's ``routetune.json``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError
from .reward import REWARDS

TARGETS = ("router", "experts", "attention")
CONFIG_FILE = "routetune.json"


def cache_tag(capacity: int) -> str:
    """The optional prompt prefix naming the cache size (tokenised with the model's tokenizer)."""
    return f"<cache={capacity}>"


MIN_TEMPERATURE = 0.01
"""Lowest sampling temperature (the logits are divided by it before the softmax)."""
MAX_GROUP, MAX_NEW_TOKENS = 256, 4096
"""Most generations per prompt and tokens per generation: one step holds every generation's
activations and KV cache (``--group 100000`` passed 4 GB on a 4-layer toy model)."""


@dataclass(frozen=True)
class TuneConfig:
    """One fine-tune. Invariants (checked by :meth:`check`, against the model by
    :meth:`check_model`): ``top_k <= cache < num_experts`` at a MoE ``layer``; ``lr > 0``; ``group >= 2``
    (advantages compare generations of one prompt); every count positive; ``lora_rank = 0``
    trains the router weights of ``layer`` directly, ``> 0`` trains rank-``r`` LoRA factors on
    ``lora_targets`` of that layer, merged into the weights before saving.

    ``objective``: ``"grpo"`` (reward-weighted, clipped policy gradient with a KL penalty to the
    frozen starting model) or ``"sft"`` (the control: plain next-token loss on the same kind of
    self-generated data, same steps, same parameters trained, no reward in the loss).
    ``balance``: weight of the tuned layer's load-balancing loss added to either objective
    (:func:`.rollout.balance_loss`, the loss the base model was trained with; 0: none): the control
    that keeps the expert load from concentrating.
    """

    layer: int
    cache: int
    reward: str = "lru-hit"
    objective: str = "grpo"
    steps: int = 50
    group: int = 8
    max_new_tokens: int = 32
    prompt_len: int = 16
    prompts_per_step: int = 1
    seed: int = 0
    lr: float = 1e-3
    clip: float = 0.2
    kl: float = 0.04
    inner: int = 1
    temperature: float = 1.0
    cache_tag: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = field(default=("router",))
    balance: float = 0.0

    def check(self) -> "TuneConfig":
        if self.reward not in REWARDS:
            raise ConfigError(f"--reward {self.reward!r} is not one of {', '.join(REWARDS)}")
        if self.objective not in ("grpo", "sft"):
            raise ConfigError(f"objective {self.objective!r} is not grpo or sft")
        for name in ("steps", "max_new_tokens", "prompt_len", "prompts_per_step", "inner", "cache"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.group < 2:
            raise ConfigError(f"--group must be at least 2 (GRPO compares generations of one prompt), got {self.group}")
        if self.layer < 0:
            raise ConfigError(f"--layer must be a layer id >= 0, got {self.layer}")
        for name in ("lr", "clip", "kl", "temperature", "lora_alpha", "balance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if self.lr == 0:  # nothing would move: the output would be the input under another name
            raise ConfigError("--lr must be above 0 (at 0 the optimizer changes no weight)")
        if not self.temperature >= MIN_TEMPERATURE:  # logits / 1e-300 overflow: a softmax of inf and nan
            raise ConfigError(f"--temperature must be at least {MIN_TEMPERATURE:g} (lower is greedy in all but name), "
                              f"got {self.temperature:g}")
        if self.group > MAX_GROUP or self.max_new_tokens > MAX_NEW_TOKENS:
            raise ConfigError(f"--group {self.group} / --max-new-tokens {self.max_new_tokens}: at most {MAX_GROUP} "
                              f"generations of {MAX_NEW_TOKENS:,} tokens per prompt (a step holds them all at once)")
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be >= 0, got {self.lora_rank}")
        bad = [t for t in self.lora_targets if t not in TARGETS]
        if bad or not self.lora_targets:
            raise ConfigError(f"--lora-targets: {','.join(bad) or '(empty)'} not among {','.join(TARGETS)}")
        if self.lora_rank == 0 and tuple(self.lora_targets) != ("router",):
            raise ConfigError("--lora-targets needs --lora-rank R > 0 (rank 0 trains the router weights directly)")
        return self

    def check_model(self, moe_layers: list[int], num_experts: int, top_k: int) -> None:
        """One-line errors for a layer the model does not route at or a cache it cannot have."""
        if self.layer not in moe_layers:
            raise ConfigError(f"--layer {self.layer} is not an MoE layer of this model (MoE layers: "
                              f"{', '.join(map(str, moe_layers))})")
        if self.cache >= num_experts:  # no eviction: the reward would count first reads alone
            raise ConfigError(f"--cache {self.cache} holds all {num_experts} experts of layer {self.layer}: nothing is "
                              f"ever evicted; give C below {num_experts}")
        if self.cache < top_k:
            raise ConfigError(f"--cache {self.cache} is below top-k {top_k}: one token's experts must fit")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        d["cache_tag_text"] = cache_tag(self.cache) if self.cache_tag else None
        return d
