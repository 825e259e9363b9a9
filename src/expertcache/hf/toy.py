"""Small random-weight checkpoints of real MoE families, for tests, benchmarks and demos.

Each model is built from its family's own config class (``OlmoeConfig``, ``MixtralConfig``, ...)
and saved with ``save_pretrained``, so loading it back goes through exactly the path a user's
checkpoint takes (``AutoModelForCausalLM.from_pretrained(folder)``). Nothing is downloaded. A
word-level tokenizer (words ``w0 .. w{V-2}`` and ``[UNK]``) can be saved beside it for ``--text``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM

#: Families the tests exercise end to end (all use the packed v5 experts layout).
FAMILIES = ("olmoe", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")


def toy_config(
    family: str,
    *,
    hidden: int = 32,
    intermediate: int = 16,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 3,
    heads: int = 4,
    vocab: int = 96,
    positions: int = 512,
):
    """A config of ``family`` (a transformers ``model_type``) with the given sizes."""
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, max_position_embeddings=positions, num_experts_per_tok=top_k,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    specific = {
        "olmoe": dict(intermediate_size=intermediate, num_experts=experts),
        "mixtral": dict(intermediate_size=intermediate, num_local_experts=experts),
        "qwen3_moe": dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate, num_experts=experts,
                          head_dim=hidden // heads),
        "qwen2_moe": dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate, num_experts=experts,
                          shared_expert_intermediate_size=intermediate),
        "deepseek_v3": dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate, n_routed_experts=experts,
                            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_scaling=None),
        "gpt_oss": dict(intermediate_size=intermediate, num_local_experts=experts, head_dim=hidden // heads),
        "glm4_moe": dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate,
                         n_routed_experts=experts, n_group=2, topk_group=1, first_k_dense_replace=1,
                         head_dim=hidden // heads, attention_bias=True),
    }
    if family not in specific:
        raise ValueError(f"no toy config for {family!r} (known: {', '.join(specific)})")
    return AutoConfig.for_model(family, **common, **specific[family])


def toy_model(family: str, *, seed: int = 0, **sizes) -> torch.nn.Module:
    """A random-weight causal LM of ``family`` in eval mode."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(toy_config(family, **sizes)).eval()


def save_toy_checkpoint(family: str, folder: str | Path, *, seed: int = 0, tokenizer: bool = False, **sizes) -> Path:
    """Save a random-weight ``family`` checkpoint (and optionally a word-level tokenizer) to ``folder``."""
    folder = Path(folder)
    model = toy_model(family, seed=seed, **sizes)
    model.save_pretrained(folder)
    if tokenizer:
        save_word_tokenizer(folder, model.config.vocab_size)
    return folder


def save_word_tokenizer(folder: str | Path, vocab: int) -> None:
    """A whitespace word-level tokenizer over ``w0 .. w{vocab-2}`` plus ``[UNK]`` (id ``vocab - 1``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one CPU thread inside the block: toy-sized matmuls run fastest (and steadiest on
    a shared machine) that way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
