"""``router_tune``: load a checkpoint, fine-tune one layer's router on its own generations, save.

Order: the options are checked against the model (layer, cache, tag needs a tokenizer) before
any training; the prompts are drawn from ``stream`` under ``config.seed``; training runs in float32
on the CPU; the merged weights are cast back to the checkpoint's dtype and written atomically with
the tokenizer and ``routetune.json`` (the configuration, the per-step reward curve, the summary).
Same seed, same inputs, same thread count, same library versions: bitwise the same weights.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch
import transformers

from ..errors import ConfigError
from ..hf.loading import check_checkpoint, load_model, tokenizer_or_reason
from ..hf.model import find_sites, top_k_of
from .config import TuneConfig, cache_tag
from .grpo import TuneResult, tune
from .output import check_out_folder, save_folder
from .rollout import make_prompts


def load_tokenizer(model_dir: str | Path, required: str | None = None):
    """The checkpoint's tokenizer, or None (a ConfigError naming ``required`` when one is needed)."""
    tokenizer, why = tokenizer_or_reason(model_dir)
    if tokenizer is None and required:
        raise ConfigError(f"{required} needs a tokenizer saved in {model_dir} ({why})")
    return tokenizer


def tag_ids(tokenizer, capacity: int) -> list[int]:
    return list(tokenizer(cache_tag(capacity), add_special_tokens=False)["input_ids"])


def checked_model(model_dir: str | Path, config: TuneConfig):
    """(model on the CPU, its dtype) after :meth:`TuneConfig.check_model`."""
    check_checkpoint(model_dir, "--model")
    model = load_model(str(model_dir), device="cpu")
    dtype = next(model.parameters()).dtype
    sites = find_sites(model)
    by_layer = {s.layer: s for s in sites}
    top_k = top_k_of(model)
    num_experts = by_layer[config.layer].num_experts if config.layer in by_layer else sites[0].num_experts
    config.check_model(sorted(by_layer), num_experts, top_k)
    return model, dtype


def router_tune(model_dir: str | Path, stream: np.ndarray, config: TuneConfig, out: str | Path,
                progress=None) -> tuple[TuneResult, dict]:
    """Run the fine-tune of :mod:`.grpo` and write ``out``; returns (result, the saved record)."""
    config.check()
    check_out_folder(out)
    tokenizer = load_tokenizer(model_dir, "--cache-tag" if config.cache_tag else None)
    model, dtype = checked_model(model_dir, config)
    prefix = tag_ids(tokenizer, config.cache) if config.cache_tag else None
    prompts = make_prompts(stream, config.steps, config.prompts_per_step, config.prompt_len, config.seed, prefix)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if prompts.size and int(prompts.max()) >= vocab:
        raise ConfigError(f"token id {int(prompts.max())} is outside the model's vocabulary of {vocab}")
    result = tune(model, prompts, config, progress)
    model.to(dtype)
    record = {
        "source_model": str(model_dir),
        "config": config.to_dict(),
        "summary": result.summary(),
        "curve": [s.to_dict() for s in result.log],
        "prompt_tokens": int(prompts.shape[2]),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "threads": torch.get_num_threads(),
    }
    save_folder(model, tokenizer, out, record)
    return result, record
