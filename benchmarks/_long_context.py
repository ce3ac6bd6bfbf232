"""Models and caches for the decoding benchmarks (`benchmarks.decode`, `benchmarks.generate`).

A context of L tokens is set up without an L-token prefill, because decoding cost depends only on what the cache
holds: a real prompt of `prompt` tokens is prefilled (so the converted layers' recurrent states, and the windows
and sinks of the sliding-window hybrids, are real), then every softmax layer's K/V cache is replaced by random
K/V of length L, and the converted layers' token count is set to L. Decoding continues at position L.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from oal.models.cache import OALStateLayer, cache_kwargs, state_nbytes

# The published configs of the two shapes (decoding cost does not depend on the weights' values). Their RoPE takes
# any position; max_position_embeddings is raised per run to cover the longest context (`build`).
SHAPES = {
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, rope_theta=1000000.0, tie_word_embeddings=True)),
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
}


def build(shape: str, *, weights: str = "random", max_positions: int, dtype=torch.float32, device="cpu",
          overrides: dict | None = None):
    """(model, source): `shape`'s model with random weights, or SmolLM2-135M's real ones (weights="real", fetched
    offline by `oal fetch smollm2-135m`), max_position_embeddings raised to `max_positions`. `overrides`: config
    fields of the random model changed (e.g. fewer layers)."""
    if weights == "real":
        if shape != "smollm2-135m":
            raise ValueError(f"--weights: real weights are available for smollm2-135m only, not {shape}")
        from oal.models.registry import load_model

        model, _, prov = load_model("smollm2-135m", dtype=dtype, device=device)
        source = f"SmolLM2-135M-Instruct real weights ({prov.get('path')})"
    else:
        config_cls, model_cls, kw = SHAPES[shape]
        kw = kw | (overrides or {})
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs (a 0.5B model's init on the host took seconds)
            model = model_cls(config_cls(**kw, max_position_embeddings=max_positions)).to(dtype)
        source = f"random init of {shape}'s published config"
    model.config.max_position_embeddings = max(max_positions, model.config.max_position_embeddings)
    return model.eval(), source + f"; max_position_embeddings raised to {model.config.max_position_embeddings}"


@torch.no_grad()
def long_cache(model, context: int, batch: int = 1, prompt: int = 256, seed: int = 0) -> DynamicCache:
    """A cache as after `context` tokens (module docstring): real states and windows from a `prompt`-token
    prefill at batch 1, repeated over the batch; random K/V of length `context` in the softmax layers."""
    cfg = model.config
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=gen).to(device)
    cache = DynamicCache(config=cfg)
    model(ids, **cache_kwargs(model, cache), use_cache=True)
    for layer in cache.layers:
        if isinstance(layer, OALStateLayer):
            if batch > 1:
                layer.batch_repeat_interleave(batch)
            layer.seen = context
        else:
            shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
            layer.keys = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(seed),
                                     device=device, dtype=dtype)
            layer.values = torch.randn_like(layer.keys)
    return cache


@torch.no_grad()
def decode(model, cache, context: int, tokens: int, warmup: int = 2, seed: int = 0) -> dict:
    """Greedy decoding of `warmup` + `tokens` steps on `cache`, from position `context`: the timed steps' seconds
    (host clock; on CUDA synchronised before and after), tokens/s over the batch, and the cache's bytes."""
    cfg = model.config
    device = next(model.parameters()).device
    batch = next(layer for layer in cache.layers if layer.is_initialized)
    batch = (batch.state if isinstance(batch, OALStateLayer) else batch.keys).shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + tokens):
        pos = torch.full((batch, 1), context + i, device=device)
        sync()
        t0 = time.perf_counter()
        logits = model(tok, **cache_kwargs(model, cache), use_cache=True, position_ids=pos).logits
        tok = logits[:, -1:].argmax(-1)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": times, "tokens_per_s": batch * len(times) / sum(times),
            "cache_bytes": sum(state_nbytes(cache).values())}
