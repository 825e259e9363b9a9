"""``expertcache router-tune``: fine-tune one layer's router for cache hits (GRPO) or, as the
control, on the same kind of self-generated data without the reward (SFT); write a checkpoint
folder that ``expertcache eval --model`` reads unchanged.

torch and transformers are imported only when the command runs.
"""

from __future__ import annotations

import argparse

import numpy as np

from .._progress import progress
from .._text import first_line
from ..errors import ConfigError
from ..routetune.config import TARGETS, TuneConfig
from ..routetune.reward import REWARDS
from .common import add_json, emit_json, nonnegative_float, positive_int, seed_int, table
from .inputs import check_checkpoint, read_text, read_tokens

HELP = """Fine-tune the router of one MoE layer so that a simulated LRU cache of --cache slots at that
layer hits more often on the model's own generations (GRPO, after Calanzone et al.), or, with
--sft-control, train the same parameters on the same kind of self-generated data with the plain
next-token loss and no reward.

Each step draws --prompts-per-step prompts of --prompt-len tokens from the input (seeded windows),
samples --group continuations of --max-new-tokens tokens from the current model, and rewards each
continuation with the hit rate of the LRU cache over its router passes at --layer (the prompt's
passes warm the pool; only the generated tokens' requests are scored). Advantages are the
group-normalised rewards; the update is the clipped policy gradient on the generated tokens'
log-probs with a KL penalty (--kl) to the starting model. --cache-tag prefixes every prompt with
'<cache=C>' (tokenised with the model's tokenizer). By default only the layer's router weights
train; --lora-rank R trains rank-R LoRA factors on --lora-targets of that layer instead, merged
into the weights before saving.

The output folder (--out, must not exist) is a normal Hugging Face checkpoint (model in its
original dtype, tokenizer, routetune.json with the configuration and the per-step reward curve),
written atomically. Same --seed, same inputs and thread count: bitwise the same weights (CPU).
Details: docs/router_tune.md.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("router-tune", help="fine-tune a router for cache hits (GRPO) or its SFT control",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (save_pretrained layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="FILE", help="UTF-8 text, tokenized with the checkpoint's tokenizer (prompts)")
    src.add_argument("--tokens", metavar="IDS.npy", help="token ids to draw prompts from (any shape, read flat)")
    p.add_argument("--layer", type=int, required=True, help="MoE layer id whose router is tuned and whose cache is simulated")
    p.add_argument("--cache", "-c", "--capacity", dest="cache", type=positive_int, required=True, metavar="C",
                   help="slots of the simulated LRU cache (top-k <= C < the layer's experts)")
    p.add_argument("--reward", choices=REWARDS, default="lru-hit", help="reward of a generation (default lru-hit)")
    p.add_argument("--sft-control", action="store_true", help="train on the same self-generated data without the reward")
    p.add_argument("--steps", type=positive_int, default=50, metavar="N", help="optimizer steps (default 50)")
    p.add_argument("--group", type=positive_int, default=8, metavar="G", help="generations per prompt (default 8, >= 2)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="M", help="tokens per generation (default 32)")
    p.add_argument("--prompt-len", type=positive_int, default=16, metavar="P", help="prompt tokens (default 16)")
    p.add_argument("--prompts-per-step", type=positive_int, default=1, metavar="N", help="prompts per step (default 1)")
    p.add_argument("--inner", type=positive_int, default=1, metavar="N", help="gradient passes per batch of generations (default 1)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of prompts, sampling and LoRA init (default 0)")
    p.add_argument("--lr", type=nonnegative_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--clip", type=nonnegative_float, default=0.2, metavar="EPS", help="ratio clip (default 0.2)")
    p.add_argument("--kl", type=nonnegative_float, default=0.04, metavar="BETA", help="KL penalty weight (default 0.04)")
    p.add_argument("--temperature", type=nonnegative_float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--cache-tag", action="store_true", help="prefix every prompt with '<cache=C>'")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R", help="LoRA rank; 0 trains the router directly (default)")
    p.add_argument("--lora-alpha", type=nonnegative_float, default=16.0, help="LoRA alpha (scale alpha/R; default 16)")
    p.add_argument("--lora-targets", default="router", metavar="LIST",
                   help=f"comma-separated, of {','.join(TARGETS)} (default router; needs --lora-rank)")
    p.add_argument("--balance", type=nonnegative_float, default=0.0, metavar="W",
                   help="add W x the tuned layer's load-balancing loss (the Switch/OLMoE loss the base was trained "
                        "with) to the objective: the load-collapse control (default 0: none)")
    p.add_argument("--out", required=True, metavar="DIR", help="output checkpoint folder (must not exist)")
    add_json(p)
    p.set_defaults(func=run)


def config_of(args) -> TuneConfig:
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    return TuneConfig(
        layer=args.layer, cache=args.cache, reward=args.reward, objective="sft" if args.sft_control else "grpo",
        steps=args.steps, group=args.group, max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len,
        prompts_per_step=args.prompts_per_step, seed=args.seed, lr=args.lr, clip=args.clip, kl=args.kl,
        inner=args.inner, temperature=args.temperature, cache_tag=args.cache_tag, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, lora_targets=targets, balance=args.balance,
    ).check()


def run(args) -> int:
    config = config_of(args)
    check_checkpoint(args.model, "--model")  # before torch and transformers are imported
    try:
        from ..routetune.output import check_out_folder
        from ..routetune.run import router_tune
    except ImportError as exc:
        raise ConfigError(first_line(exc)) from None
    check_out_folder(args.out)
    stream = (read_tokens(args.tokens) if args.tokens else read_text(args.model, args.text)).ravel()
    if stream.size and (stream.min() < 0):
        raise ConfigError(f"--tokens {args.tokens}: negative token id {int(stream.min())}")
    with progress(total=config.steps, desc="router-tune", disable=args.json) as bar:
        def show(log) -> None:
            bar.set_postfix_str(f"reward {log.reward:.4f}, kl {log.kl:.2e}", refresh=False)
            bar.update(1)

        result, record = router_tune(args.model, np.asarray(stream, dtype=np.int64), config, args.out, show)
    summary = {"out": args.out, "model": args.model, **record["summary"], "reward": config.reward,
               "cache_tag": config.cache_tag, "lora_rank": config.lora_rank, "seed": config.seed}
    if args.json:
        emit_json([summary])
        return 0
    print(f"{config.objective} on layer {config.layer}, simulated lru cache of {config.cache} slots, {config.steps} steps "
          f"x {config.prompts_per_step} prompt(s) x {config.group} generations of {config.max_new_tokens} tokens; "
          f"{result.trained_parameters} trained parameters, {result.seconds:.1f} s")
    table([(s["reward_head_mean"], s["reward_tail_mean"], s["reward_first"], s["reward_last"], s["kl_last"])
           for s in [record["summary"]]],
          ["reward first 20%", "reward last 20%", "first step", "last step", "kl last"])
    print(f"checkpoint written to {args.out} (training record in {args.out}/routetune.json)")
    return 0

