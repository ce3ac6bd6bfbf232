"""Tiny random models shared by the tests (hidden 48 or 32-64, 3 layers): built in memory or saved in HF format."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Per family: config class, model class, extra config (head_dim where hidden / heads would not be a usable size).
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 8}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}


def tiny_model(family: str, vocab_size: int, attn: str | None = None):
    """A seeded 3-layer GQA model (6 query heads, 2 KV heads) of `family` in eval mode; `attn` picks HF's backend."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, **extra)
    if attn is not None:
        cfg._attn_implementation = attn
    return model_cls(cfg).eval()


def save_tiny_model(path, model_cls, config, tokenizer, seed: int = 0):
    """Save a seeded random `model_cls(config)` and `tokenizer` to `path` (an HF folder `load_model` can read)."""
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_llama(path, *, intermediate_size: int = 64, max_position_embeddings: int = 512):
    """A tiny byte-level Llama (ByT5 tokenizer, vocab 259) in HF format.

    Llama rather than Qwen2: transformers' AutoTokenizer replaces the declared ByT5Tokenizer of a qwen2 config by
    Qwen2Tokenizer (qwen2 is in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS list).
    """
    from transformers import ByT5Tokenizer

    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings)
    return save_tiny_model(path, LlamaForCausalLM, cfg, ByT5Tokenizer(extra_ids=0))
