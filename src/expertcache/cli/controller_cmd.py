"""``expertcache controller train``: the learned set controller's heads on a frozen model (docs/controller.md).

torch and transformers are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..errors import ConfigError
from .common import (add_json, add_layers, add_out, add_subcommands, check_out, emit_json, nonnegative_float, positive_int,
                     seed_int, threads_int)
from .sizing_opts import duration

HELP = """The learned set controller (the eviction paper's reimplementation of an option-critic
controller): a termination head beta and a selection head mu per offloaded layer, trained on top
of the frozen model; evaluate them with 'expertcache eval -p controller:heads.pt:THR'.

  train   fit the heads on training text (never the evaluation text) with the paper's
          differentiable objective (NLL through the soft mixture (1 - beta) keep + beta refresh,
          penalties for refreshes, changed experts, expected misses, undecided beta, KL to the
          router) or REINFORCE (sampled decisions; reward from NLL, refreshes, copies and misses,
          entropy bonus). --price-tau prices each copy at exchange x tau nats (the priced variant).
          Writes a small heads file (plain tensors, read without unpickling); deterministic
          under --seed on one machine and thread count.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("controller", help="learned set controller: train termination/selection heads", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = add_subcommands(p, "controller_command")
    t = csub.add_parser("train", help="train the heads on a frozen model (CPU)",
                        description="Train the controller's heads on --model (frozen) over windows of the training "
                                    "text; see docs/controller.md for the objectives and the heads file.")
    t.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (save_pretrained layout)")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", action="append", metavar="FILE",
                     help="UTF-8 training text, tokenized with the checkpoint's tokenizer (repeatable)")
    src.add_argument("--tokens", metavar="IDS.npy", help="training token ids (integer array, flattened)")
    add_layers(t, "MoE layer ids the heads are trained for (the layers eval will offload)")
    t.add_argument("--capacity", "-c", type=positive_int, required=True, help="device slots per offloaded layer")
    t.add_argument("--objective", choices=("differentiable", "reinforce"), default="differentiable",
                   help="training objective (default differentiable)")
    t.add_argument("--price-tau", type=duration, default=None, metavar="DURATION",
                   help="measured copy time (e.g. 0.51ms): each copy costs --exchange x tau nats (the priced variant)")
    t.add_argument("--exchange", type=nonnegative_float, default=None, metavar="NATS_PER_MS",
                   help="nats per ms of copy time with --price-tau (default 0.02)")
    t.add_argument("--steps", type=_steps, default=60, metavar="N", help="optimizer steps (default 60; 0 = untrained heads)")
    t.add_argument("--seed", type=seed_int, default=0, help="seed of the windows and samples (default 0)")
    t.add_argument("--batch", type=positive_int, default=4, metavar="B", help="windows per step (default 4)")
    t.add_argument("--seq-len", type=positive_int, default=128, metavar="N", help="tokens per window (default 128)")
    t.add_argument("--warmup", type=positive_int, default=8, metavar="W",
                   help="tokens of prefix:W warm-up at the start of each sequence (default 8; eval may override)")
    t.add_argument("--samples", type=positive_int, default=4, metavar="S", help="reinforce: samples per window (default 4)")
    t.add_argument("--lr", type=_lr, default=0.02, help="Adam learning rate (default 0.02)")
    t.add_argument("--threads", type=threads_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's)")
    add_out(t, "heads file to write (e.g. heads.pt)")
    add_json(t)
    t.set_defaults(func=run_train)


def _steps(text: str) -> int:
    if text.strip() == "0":
        return 0
    return positive_int(text)


def _lr(text: str) -> float:
    x = nonnegative_float(text)
    if not 0 < x <= 10:
        raise argparse.ArgumentTypeError(f"expected a learning rate in (0, 10], got {text!r}")
    return x


def run_train(args) -> int:
    check_out(args.out)
    if args.exchange is not None and args.price_tau is None:
        raise ConfigError("--exchange prices copies only with --price-tau (the measured copy time)")
    from .inputs import check_checkpoint, import_hf, read_text, read_tokens

    check_checkpoint(args.model, "--model")  # before torch and transformers are imported
    hf = import_hf()
    if args.tokens:
        ids = read_tokens(args.tokens).reshape(-1)
    else:
        ids = np.concatenate([read_text(args.model, path) for path in args.text])
    import torch

    from ..hf.controller_heads import save_heads
    from ..hf.controller_train import TrainOptions, train_controller

    if args.threads:
        torch.set_num_threads(args.threads)
    model = hf.load_model(args.model, device="cpu", dtype="float32")
    opts = TrainOptions(
        capacity=args.capacity, objective=args.objective, layers=args.layers, steps=args.steps, seed=args.seed,
        batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, samples=args.samples,
        price_tau_ms=args.price_tau, exchange=0.02 if args.exchange is None else args.exchange,
    )
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    heads, config, summary = train_controller(model, ids, opts, log=log)
    size = save_heads(args.out, heads, config)
    record = {"out": args.out, "model": args.model, "tokens": int(ids.size), "bytes": size, "seed": args.seed, **summary}
    if args.json:
        emit_json([record])
    else:
        print(f"controller heads for layers {config['layers']} at capacity {args.capacity}: {args.objective}, "
              f"{args.steps} steps in {summary['seconds']:.1f}s on {ids.size:,} training tokens, copy penalty "
              f"{summary['copy_weight']:g} nats/copy; wrote {args.out} ({size:,} bytes)")
        finals = {k: v for k, v in summary.items() if k.startswith("final_")}
        if finals:
            print("last 10 steps: " + ", ".join(f"{k.removeprefix('final_')} {v:.4f}" for k, v in finals.items()))
    return 0
