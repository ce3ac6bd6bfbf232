"""Capture post-RoPE q/k/v and the per-head attention output of chosen layers of an HF causal LM or encoder.

How it works: transformers 5 routes every attention call through `AttentionInterface`, passing the module, the
post-RoPE query `[B, Hq, N, d]`, the (not repeated) key/value `[B, Hkv, N, d]`, the mask built for the model's
attention implementation and `scaling`. We register a wrapper implementation (one per original implementation,
with the original's mask function), switch the model to it for the duration of a `with` block, call the original
function unchanged and hand what it saw to a callback. The model's output is bit-identical to a plain forward.

Encoders (BERT family, `models.encoder`): the same wrapper sees their post-projection q/k/v (no RoPE) and the
per-head output before `attention.output.dense`; `Captured.causal` is False for them.

Streaming: the callback runs inside the forward pass, one layer at a time; nothing is kept after it returns, so
the caller decides what to reduce (scores, sampled rows) and memory never holds all layers' tensors at once.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from oal.models import encoder
from oal.models.families import SUPPORTED_ARCHITECTURES

_PREFIX = "oal_capture_"


@dataclass
class Captured:
    """What one attention layer saw in one forward pass (all tensors detached).

    q: [B, Hq, N, d] post-RoPE queries (unscaled); k: [B, Hkv, N, d] post-RoPE keys; v: [B, Hkv, N, dv];
    out: [B, Hq, N, dv] softmax attention output per head, before o_proj;
    attention_mask: the caller's 2-D padding mask [B, N] (1 = real token) or None;
    scaling: the softmax scale the model used (1/sqrt(d) for the supported families);
    causal: False for encoders (every query sees every real key).
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    causal: bool = True


@dataclass
class _Session:
    modules: dict[int, int]  # id(attention module) -> layer index
    on_layer: Callable[[Captured], None]
    attention_mask: torch.Tensor | None
    last_layer: int
    stop_after_last: bool


class _StopForward(Exception):
    """Raised after the last requested layer when the caller does not need the rest of the forward pass."""


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("oal_capture_session", default=None)


def check_supported(model: nn.Module) -> None:
    """Raise ValueError unless `model` is one of the supported causal-LM families or encoders."""
    if encoder.is_encoder(model):
        encoder.encoder_layers(model)
        return
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES or not hasattr(getattr(model, "model", None), "layers"):
        supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise ValueError(
            f"model: unsupported architecture {type(model).__name__} (model_type={model_type!r}); "
            f"supported: {supported}; encoders: {', '.join(encoder.ENCODER_ARCHITECTURES)}"
        )


def attention_module(model: nn.Module, layer: int) -> nn.Module:
    """The HF attention module (`self_attn`, with q_proj/k_proj/v_proj/o_proj) of decoder layer `layer`
    (of an encoder: `attention.self`)."""
    check_supported(model)
    if encoder.is_encoder(model):
        return encoder.attention_module(model, layer)
    layers = model.model.layers
    if not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise ValueError(f"layer: expected an int in [0, {len(layers)}), got {layer!r}")
    return layers[layer].self_attn


def output_projection(model: nn.Module, layer: int) -> nn.Linear:
    """The output projection W_o of layer `layer` (`o_proj`; for encoders `attention.output.dense`)."""
    if encoder.is_encoder(model):
        return encoder.output_projection(model, layer)
    return attention_module(model, layer).o_proj


def attention_function(module: nn.Module, impl: str) -> Callable:
    """transformers' attention function `impl` for `module` (also `oal.models.attention`'s dispatch)."""
    if impl == "eager":  # each modeling file has its own eager function; use the module's
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def _make_wrapper(impl: str) -> Callable:
    def capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
        out = attention_function(module, impl)(module, query, key, value, attention_mask, *args, **kwargs)
        session = _SESSION.get()
        layer = None if session is None else session.modules.get(id(module))
        if layer is not None:
            attn_output = out[0]  # [B, N, Hq, dv]
            scaling = kwargs.get("scaling", getattr(module, "scaling", query.shape[-1] ** -0.5))
            session.on_layer(
                Captured(
                    layer=layer,
                    q=query.detach(),
                    k=key.detach(),
                    v=value.detach(),
                    out=attn_output.detach().transpose(1, 2),
                    attention_mask=session.attention_mask,
                    scaling=float(scaling),
                    causal=bool(getattr(module, "is_causal", True)),
                )
            )
            if session.stop_after_last and layer == session.last_layer:
                raise _StopForward
        return out

    capture_attention.__name__ = f"{_PREFIX}{impl}"
    return capture_attention


def _register(impl: str) -> str:
    """Register (once) the capture wrapper around implementation `impl`, with `impl`'s mask function."""
    name = f"{_PREFIX}{impl}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"model: attention implementation {impl!r} cannot be wrapped for capture")
        if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
            raise ValueError(f"model: attention implementation {impl!r} has no mask function; use 'sdpa' or 'eager'")
        AttentionInterface.register(name, _make_wrapper(impl))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


@contextmanager
def capturing(model: nn.Module) -> Iterator[None]:
    """Switch `model` to the capture wrapper of its own attention implementation; restore it on exit."""
    check_supported(model)
    original = model.config._attn_implementation
    if original.startswith(_PREFIX):  # nested use: already wrapped
        yield
        return
    model.set_attn_implementation(_register(original))
    try:
        yield
    finally:
        model.set_attn_implementation(original)


def _check_layers(model: nn.Module, layers: Sequence[int]) -> list[int]:
    n_layers = len(encoder.encoder_layers(model) if encoder.is_encoder(model) else model.model.layers)
    layers = list(layers)
    if not layers or any(not isinstance(i, int) or not 0 <= i < n_layers for i in layers):
        raise ValueError(f"layers: expected a non-empty list of ints in [0, {n_layers}), got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers: duplicates in {layers!r}")
    return sorted(layers)


def capture(
    model: nn.Module,
    input_ids: torch.Tensor,
    layers: Sequence[int],
    on_layer: Callable[[Captured], None],
    attention_mask: torch.Tensor | None = None,
    *,
    stop_after_last: bool = False,
):
    """Run `model` on `input_ids` [B, N] and call `on_layer(Captured)` for each layer in `layers`, in depth order.

    Returns the model output (logits identical to a plain forward), or None when `stop_after_last=True`
    (the forward pass is cut after the deepest requested layer to save time).
    """
    check_supported(model)
    layers = _check_layers(model, layers)
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a LongTensor [B, N], got {getattr(input_ids, 'shape', input_ids)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask: expected shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    modules = {id(attention_module(model, i)): i for i in layers}
    session = _Session(modules, on_layer, attention_mask, layers[-1], stop_after_last)
    token = _SESSION.set(session)
    try:
        with capturing(model):
            try:
                return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                return None
    finally:
        _SESSION.reset(token)


def capture_batches(model, input_ids: torch.Tensor, layers: Sequence[int], on_layer, batch_size: int = 4) -> None:
    """`on_layer(captured)` for each of `layers` and each batch of the blocks `input_ids` [S, N] (one forward per
    batch for every layer, cut after the deepest), on the model's device (the blocks go there first)."""
    from oal.device import module_device

    input_ids = input_ids.to(module_device(model))
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            capture(model, input_ids[start : start + batch_size], list(layers), on_layer, stop_after_last=True)


def capture_layer(
    model: nn.Module, input_ids: torch.Tensor, layer: int, attention_mask: torch.Tensor | None = None
) -> Captured:
    """Capture a single layer and return it (stops the forward pass after that layer)."""
    got: list[Captured] = []
    capture(model, input_ids, [layer], got.append, attention_mask, stop_after_last=True)
    return got[0]
