"""Swap the attention computation of chosen layers of an HF model for an `AttentionMethod` (paper App. F).

`models.convert.convert` is the public entry point: it swaps, then gives the model its converted class.

How: the HF attention module stays in place, with its q/k/v/o projections, biases, RoPE, q/k norms (Qwen3) and
GQA layout. We attach the method as a submodule `self_attn.oal_method` (its kernel parameters are trainable
`nn.Parameter`s, groups are buffers) and switch the model to an attention implementation registered through
`transformers.AttentionInterface` as "oal_<base>" (base = the model's own, usually "sdpa"). That function receives
exactly what the softmax function would (post-RoPE unscaled q [B, Hq, N, d], unrepeated k/v [B, Hkv, N, d]) and
dispatches to `module.oal_method` for converted layers and to the base implementation for every other layer,
so unconverted layers are bit-identical to the original model.

Caching (see `models.cache`): a forward pre-hook on each converted attention module finds the cache passed to it
and, on first use, replaces that layer's empty slot with an `OALStateLayer`, so `generate(use_cache=True)` keeps an
O(1) recurrent state for converted layers (prefill through the method's forward, i.e. the chunked operator for OAL,
then one token at a time) and the usual K/V cache for softmax layers.

Padding: left padding (what batched `generate` uses) and right padding (what log-likelihood scorers use) are
supported; padding between real tokens raises ValueError (the methods' linear-time paths take no per-token key
mask, and a padded key inside the sequence would enter every later prefix sum). Right padding without a cache runs
the batch at once: under causal attention a right-padded key comes after every real token of its row, so no real
query ever sees it. Otherwise (left padding, or any padding while a cache is kept) each row's real tokens are cut
out and run alone (a per-row loop, only when a batch has padding), so padded tokens never enter the row's state or
normaliser: a cached state covers real tokens only (a chunk of a chunked prefill, `generate(prefill_chunk_size=...)`,
may hold only a row's left padding: that row's state starts in a later chunk, `OALStateLayer.fresh`). Padded query
positions get a zero output either way. Padding is read off the 4-D mask transformers passes to attention functions
(a key no query may see is padding), so only 'sdpa' and 'eager' (whose masks are such tensors) can be the base:
flex's BlockMask and flash's 2-D mask are refused.
A mask that shows a real query other keys than the real ones before it (packed sequences' block-causal masks, custom
4-D masks) raises ValueError: the methods' state cannot follow it.

Decoding: a few new tokens on top of a state go through the operator's token loop (`oal_attention`'s `auto`
picks it), whose per-token cost is a handful of small ops.

Encoders (BERT family, `models.encoder`): the same functions convert `encoder.layer[i].attention.self`; their
converted layers run the method non-causally (`module.is_causal` is False), padded keys kept out of the state and
the normaliser (`models.encoder.noncausal_attention`).

Sliding-window models (Mistral): a converted layer attends the full causal prefix (the state cannot slide).

"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from oal.methods.base import AttentionMethod, build_method, causal_mask, repeat_kv
from oal.models import encoder
from oal.models.cache import OALStateLayer
from oal.models.capture import attention_function
from oal.models.registry import default_layers
from oal.ops.checks import cache_owned
from oal.ops.kernel import version

__all__ = ["converted_methods", "is_converted", "kernel_parameters", "swap_attention"]

_PREFIX = "oal_"
_HOOKS_ATTR = "_oal_hook_handles"


# ----------------------------------------------------------------------------------------------- helpers


def _decoder_layers(model: nn.Module):
    if encoder.is_encoder(model):
        return encoder.encoder_layers(model)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "config"):
        raise ValueError(f"model: expected an HF causal LM with `model.model.layers`, got {type(model).__name__}")
    return layers


def _attention(model: nn.Module, layer: int) -> nn.Module:
    if encoder.is_encoder(model):
        return encoder.attention_module(model, layer)
    layers = _decoder_layers(model)
    if not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise ValueError(f"layers: expected ints in [0, {len(layers)}), got {layer!r}")
    attn = getattr(layers[layer], "self_attn", None)
    if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise ValueError(f"model: layer {layer} has no self_attn with q/k/v/o projections")
    return attn


def _head_shape(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return n_heads, n_kv, head_dim


# ----------------------------------------------------------------------------------------------- attention function


def _key_validity(mask, n_new: int, window: int | None = None, causal: bool = False) -> torch.Tensor | None:
    """[B, n_new] True for real (non-padded) new tokens: a key that no query row may see is padding.

    (Taking any row rather than the last keeps sliding-window masks from looking like padding.) `causal`: also
    ValueError where the mask shows a real query other keys than the real ones before it (within `window`, a
    sliding-window layer's size), which a converted layer's causal state cannot follow (`_hidden_keys`).
    """
    if mask is None or not torch.is_tensor(mask) or mask.dim() != 4:
        return None
    key = (version(mask), n_new, window, causal)
    hit = _VALIDITY.get(mask)
    if hit is None or hit[0] != key:
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, n, M]
        valid = allowed[:, :, -n_new:].any(dim=1)
        checks = torch.stack([valid.all(), _hidden_keys(allowed, window) if causal else valid.new_zeros(())])
        # None when nothing is padded: read once per mask (every layer of a forward gets the same one), not once
        # per layer, since on a GPU the read waits for the device
        every, hidden = checks.tolist()
        if hidden:
            raise ValueError("attention_mask: converted layers attend exactly the earlier real tokens of each row "
                             "(causal, left or right padding only); this mask hides some of them from a real token or "
                             "shows it later ones (packed sequences, i.e. position_ids that restart without an "
                             "attention_mask, or a custom 4-D mask): give each sequence its own row")
        hit = _VALIDITY[mask] = (key, None if every else valid)
    return hit[1]


def _hidden_keys(allowed: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether some real query of `allowed` [B, n, M] (n new queries after M - n earlier keys) sees another number of
    keys than causal attention over the real keys (within `window`) gives it: fewer under packed sequences'
    block-causal masks, more under a bidirectional one.
    Counted per query row, so that no [B, n, M] temporary is made beyond the mask's own."""
    n, m = allowed.shape[-2:]
    seen = allowed.any(dim=1)  # [B, M] real keys: those some query sees
    before = torch.nn.functional.pad(seen.cumsum(-1), (1, 0))  # [B, M + 1] real keys before each index
    hi = torch.arange(m - n + 1, m + 1, device=allowed.device)  # each query's causal stop
    lo = (hi - window).clamp_min(0) if window else torch.zeros_like(hi)
    want = before[:, hi] - before[:, lo]  # [B, n] keys a causal (windowed) row of real keys gives each query
    return ((allowed.sum(-1) != want) & seen[:, m - n:]).any()


_VALIDITY = WeakIdKeyDictionary()  # 4-D mask -> (its version, address, n_new; the key validity or None)


def _dense_with_mask(method: AttentionMethod, q, k, v, mask) -> torch.Tensor:
    """Stateless fallback: dense kernel of the new queries against every cached key, masked like softmax."""
    n, m = q.shape[2], k.shape[2]
    if mask is not None and torch.is_tensor(mask) and mask.dim() == 4:
        allowed = mask[..., -n:, -m:]
        allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    else:
        allowed = causal_mask(n, m, q.device)
    w = method.masked_kernel(q, k, allowed).to(v.dtype)  # [B, Hq, n, M], masked before any shift over keys
    return (w @ repeat_kv(v, method.n_rep)) / w.sum(-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)


def _run(method, q, k, v, state, want_state, owned: bool = False):
    if want_state:
        # the cache's own state is handed back as such: not checked again, updated in place (`models.cache`)
        with cache_owned(state if owned else None):
            return method(q, k, v, causal=True, initial_state=state, output_final_state=True)
    return method(q, k, v, causal=True), None


def _real_spans(valid: torch.Tensor, empty_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the [start, stop) of its real tokens; ValueError for padding between real tokens, or for an empty row
    unless `empty_rows` (a cached chunk of a chunked prefill can hold only a row's left padding)."""
    n_real = valid.sum(1)
    if bool((n_real == 0).all() if empty_rows else (n_real == 0).any()):
        raise ValueError("attention_mask: a row of the batch is entirely padding")
    start = valid.int().argmax(1)  # first real token
    pos = torch.arange(valid.shape[1], device=valid.device)
    if not bool(((pos >= start[:, None]) & (pos < (start + n_real)[:, None]) == valid).all()):
        raise ValueError("attention_mask: converted layers support left or right padding only (padding tokens "
                         "must come before or after every real token of the row, not between them; generate "
                         "without an attention_mask reads every pad_token_id in a prompt as padding: pass one)")
    return start, start + n_real


def _stateful(method, q, k, v, valid, layer: OALStateLayer | None):
    want = layer is not None
    state = layer.state if want else None
    fresh = layer.fresh if want else None
    n = q.shape[2]
    if valid is None and fresh is None:  # nothing padded (`_key_validity`)
        out, state = _run(method, q, k, v, state, want, owned=want and layer.owned)
    else:
        if valid is None:
            valid = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device)
        start, stop = _real_spans(valid, empty_rows=want)
        if not want and not bool(start.any()):
            # right padding only and no state to keep: causal attention never lets a real query see a key that
            # comes after every real token of its row, so the whole batch runs at once
            out, _ = _run(method, q, k, v, None, False)
            out = out.masked_fill(~valid[:, None, :, None], 0.0)  # padded queries: zero output
        else:
            outs, states = [], []
            for b in range(q.shape[0]):
                s0, s1 = int(start[b]), int(stop[b])
                # a row's state starts at its first real token, which a chunked prefill can bring in a later chunk
                new = state is None or (fresh is not None and bool(fresh[b]))
                if s0 and not new and layer.seen > n:
                    raise ValueError("attention_mask: padding after earlier tokens is not supported in converted "
                                     "layers")
                st = None if new else state[b : b + 1]
                if s0 == s1:  # no real token in this chunk: zero output, the state as it was
                    outs.append(q.new_zeros(1, q.shape[1], n, v.shape[-1]))
                    states.append(st)
                    continue
                o, st = _run(method, q[b : b + 1, :, s0:s1], k[b : b + 1, :, s0:s1], v[b : b + 1, :, s0:s1], st,
                             want)
                outs.append(torch.nn.functional.pad(o, (0, 0, s0, n - s1)))  # padded queries: zero output
                states.append(st)
            out = torch.cat(outs)
            if want:
                # rows still without a real token hold a placeholder, never read (`new` above)
                some = next(s for s in states if s is not None)  # `_real_spans`: some row has a real token
                still = (start == stop) & (fresh if fresh is not None else state is None)
                state = torch.cat([some.new_zeros(some.shape) if s is None else s for s in states])
                fresh = still if bool(still.any()) else None
    if want:
        layer.keep(state)
        layer.fresh = fresh
    return out


def _converted_forward(module, query, key, value, attention_mask, window: int | None = None):
    method: AttentionMethod = module.oal_method
    layer = _slots().get(module)
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # autocast (Trainer(bf16=True), accelerate) ran the operator's GEMMs in bf16 after it had cast them to fp32
        # (fp32 states; fp32 features while the factor trains: `oal.ops.oal_attention`). The method gets its inputs
        # in autocast's dtype, as from a model of that dtype (RoPE left q, k in fp32), and keeps its own precision
        low = torch.get_autocast_dtype(device)
        query, key, value = (t.to(low) if t.dtype == torch.float32 else t for t in (query, key, value))
    with torch.autocast(device, enabled=False):
        if not getattr(module, "is_causal", True):  # encoders: all real keys visible, no cache
            out = encoder.noncausal_attention(method, query, key, value,
                                              _key_validity(attention_mask, key.shape[-2]))
        elif layer is not None and not layer.stateful:
            out = _dense_with_mask(method, query, key, value, attention_mask)
        else:
            out = _stateful(method, query, key, value,
                            _key_validity(attention_mask, key.shape[-2], window=window, causal=True), layer)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _untraceable(query) -> str | None:
    """What traces this call in a way the converted layers cannot follow, or None. Their operator reads values on
    the host (input checks, overflow rescaling, padding), so torch.export's fake tensors and torch.func's
    transforms fail deep inside it; torch.compile graph-breaks there and runs (not refused)."""
    if torch.compiler.is_dynamo_compiling():  # torch.compile: it graph-breaks inside (`_compile_break`)
        return None
    # torch.compiler.is_exporting() is no test: torch 2.11 answered True inside torch.compile
    if torch._subclasses.fake_tensor.is_fake(query):
        return "torch.export"
    if torch._C._functorch.is_functorch_wrapped_tensor(query):
        return "torch.func (grad, vmap, jacrev, ...)"
    return None


def dispatch_name(base: str) -> str:
    """Register (once) the dispatching attention function "oal_<base>" with `base`'s mask function; its name."""
    name = f"{_PREFIX}{base}"
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    known = base == "eager" or base in ALL_ATTENTION_FUNCTIONS
    if not known or ALL_MASK_ATTENTION_FUNCTIONS.get(base) not in (ALL_MASK_ATTENTION_FUNCTIONS["sdpa"],
                                                                   ALL_MASK_ATTENTION_FUNCTIONS["eager"]):
        # unknown, or flex's BlockMask, flash's 2-D mask or none: converted layers would see no padding, nor packed
        # sequences
        raise ValueError(f"model: attention implementation {base!r} gives converted layers no 4-D mask to read "
                         "padding from; use 'sdpa' or 'eager'")

    def oal_dispatch(module, query, key, value, attention_mask, *args, **kwargs):
        if getattr(module, "oal_method", None) is None:
            return attention_function(module, base)(module, query, key, value, attention_mask, *args, **kwargs)
        tracer = _untraceable(query)
        if tracer is not None:
            raise ValueError(f"model: converted layers cannot run under {tracer}: their operator reads tensor values "
                             "on the host; use torch.compile (it graph-breaks there) or plain autograd")
        scaling = kwargs.get("scaling")
        if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5, rel_tol=1e-6):
            # the methods score q.k / sqrt(d) (Eq. 2, 7): a family with its own scale would be silently wrong
            raise ValueError(f"model: this family scales attention scores by {scaling:g}, not 1/sqrt(head_dim) = "
                             f"{query.shape[-1] ** -0.5:g}; converted layers support 1/sqrt(head_dim) only")
        return _converted_forward(module, query, key, value, attention_mask, kwargs.get("sliding_window"))

    oal_dispatch.__name__ = name
    AttentionInterface.register(name, oal_dispatch)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


# ----------------------------------------------------------------------------------------------- cache hooks


def _cache_slot(cache, idx: int, method: AttentionMethod) -> OALStateLayer:
    """The converted layer's slot of `cache`, swapped to an OALStateLayer on first use."""
    if not isinstance(cache, Cache):
        raise ValueError(f"past_key_values: expected a transformers Cache, got {type(cache).__name__}")
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(cache.layers) <= idx:
            cache.layers.append(cache.layer_class_to_replicate())
    if idx >= len(cache.layers):
        raise ValueError(f"past_key_values: the cache has no slot for layer {idx}")
    slot = cache.layers[idx]
    if isinstance(slot, OALStateLayer):
        return slot
    if not isinstance(slot, DynamicLayer):
        raise ValueError(f"past_key_values: converted layer {idx} needs a DynamicCache slot, got "
                         f"{type(slot).__name__} (static/sliding/quantized caches are not supported)")
    if slot.get_seq_length() > 0:
        raise ValueError(f"past_key_values: layer {idx} already holds softmax K/V; start from an empty cache")
    cache.layers[idx] = OALStateLayer(stateful=method.supports_state)
    return cache.layers[idx]


# The cache slot of the forward in flight, per thread and attention module: the pre-hook finds it in the call's
# cache, the attention function reads it. Kept on the module, two threads generating with one model (a server's
# streams) wrote into each other's caches.
_IN_FLIGHT = threading.local()


def _slots() -> WeakIdKeyDictionary:
    slots = getattr(_IN_FLIGHT, "slots", None)
    if slots is None:
        slots = _IN_FLIGHT.slots = WeakIdKeyDictionary()
    return slots


def _compile_break() -> None:
    """Under torch.compile, end the graph at a converted layer, naming why: its operator reads values on the host
    (input checks, overflow rescaling, padding), so `fullgraph=True` cannot hold (it failed on an internal
    dictionary with no word of the cause); without fullgraph dynamo resumes after it, as at any graph break."""
    if torch.compiler.is_dynamo_compiling():
        torch._dynamo.graph_break(msg=_COMPILE_BREAK)


_COMPILE_BREAK = ("converted OAL layers read tensor values on the host (input checks, padding): torch.compile runs "
                  "them between graphs, so fullgraph=True is not possible")


def _pre_hook(module, args, kwargs):
    _compile_break()
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    _slots()[module] = None if cache is None else _cache_slot(cache, module.layer_idx, module.oal_method)


def _post_hook(module, args, kwargs, output):
    _slots().pop(module, None)


def _no_attention_weights(model, args, kwargs):
    """A converted layer computes no attention matrix (that is its linear time); transformers would silently drop
    its entry from `attentions`, shifting every later layer's to a wrong index."""
    if kwargs.get("output_attentions") and converted_methods(model):
        raise ValueError("output_attentions: converted layers compute no attention weights (linear-time kernels); "
                         f"layers {sorted(converted_methods(model))} of this model are converted")


# ----------------------------------------------------------------------------------------------- public API


def swap_attention(model: nn.Module, layers: Sequence[int] | None = None,
                   methods: Mapping[int, AttentionMethod] | str = "oal", **method_kwargs) -> nn.Module:
    """Replace attention in `layers` of `model` (in place) and return the model.

    `methods` maps layer index -> AttentionMethod built for this model's (Hq, Hkv, d); a method name instead
    builds a default instance per layer (`method_kwargs` passed on). `layers` defaults to the keys of `methods`,
    or to `default_layers(model)` when `methods` is a name. Converting an already converted layer replaces its method.
    """
    _decoder_layers(model)
    n_heads, n_kv, head_dim = _head_shape(model)
    if isinstance(methods, str):
        layers = default_layers(model) if layers is None else list(layers)
        methods = {i: build_method(methods, n_heads, n_kv, head_dim, layer_idx=i, **method_kwargs) for i in layers}
    elif not isinstance(methods, Mapping):
        raise ValueError(f"methods: expected a dict layer -> AttentionMethod or a method name, got {type(methods)}")
    layers = sorted(methods) if layers is None else sorted(layers)
    if set(layers) != set(methods):
        raise ValueError(f"methods: expected one method per layer {layers}, got layers {sorted(methods)}")
    attns = {i: _attention(model, i) for i in layers}
    # the layers that keep their method: one object in two layers would train, save and reload as one (it
    # shared its parameters silently, and a reload split them)
    owner = {id(m): i for i, m in converted_methods(model).items() if i not in methods}
    for i, m in sorted(methods.items()):
        if not isinstance(m, AttentionMethod):
            raise ValueError(f"methods[{i}]: expected an AttentionMethod, got {type(m).__name__}")
        if id(m) in owner:
            raise ValueError(f"methods[{i}]: the same method object as layer {owner[id(m)]}'s; give each layer its "
                             "own (build_method per layer, or copy.deepcopy)")
        owner[id(m)] = i
        if (m.n_heads, m.n_kv_heads, m.head_dim) != (n_heads, n_kv, head_dim):
            raise ValueError(f"methods[{i}]: built for (Hq, Hkv, d) = {(m.n_heads, m.n_kv_heads, m.head_dim)}, "
                             f"the model has {(n_heads, n_kv, head_dim)}")
        if m.positional and encoder.is_encoder(model):  # refused here, not at the first forward
            raise ValueError(f"methods[{i}]: {m.name!r} is causal only (a sliding window); this model is an encoder")
    base = model.config._attn_implementation or "sdpa"
    if not base.startswith(_PREFIX):
        model.set_attn_implementation(dispatch_name(base))
    device = next(model.parameters()).device
    if not getattr(model, _HOOKS_ATTR, None):
        setattr(model, _HOOKS_ATTR, model.register_forward_pre_hook(_no_attention_weights, with_kwargs=True))
    for i in layers:
        attn = attns[i]
        attn.oal_method = methods[i].to(device)
        if not getattr(attn, _HOOKS_ATTR, None):
            setattr(attn, _HOOKS_ATTR, (attn.register_forward_pre_hook(_pre_hook, with_kwargs=True),
                                        attn.register_forward_hook(_post_hook, with_kwargs=True)))
    return model


def converted_methods(model: nn.Module) -> dict[int, AttentionMethod]:
    """layer index -> method for every converted layer of `model` (empty when none); a peft model's
    (`oal.add_lora`'s) are those of the model it wraps."""
    model = _unwrapped(model)
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        attn = encoder.attention_module(model, i) if encoder.is_encoder(model) else getattr(layer, "self_attn", None)
        m = getattr(attn, "oal_method", None)
        if m is not None:
            out[i] = m
    return out


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft model (imported only where peft already is); `model` otherwise."""
    if "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel):
        return model.get_base_model()
    return model


def is_converted(model: nn.Module) -> bool:
    return bool(converted_methods(model))


def kernel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable kernel parameters of every converted layer (e.g. OAL factors), for optimisers and peft."""
    return [p for m in converted_methods(model).values() for p in m.parameters()]
