"""`convert`: swap the attention of chosen layers for an attention method (`models.attention`) and give the model
its converted class (`models.auto.converted_class`), so that its own `save_pretrained` writes the converted form.

Use with peft: `oal.add_lora(model)` attaches LoRA and keeps the kernel parameters trainable. By hand: call
`convert` first, then `get_peft_model`; peft freezes non-LoRA weights, so re-enable the kernel parameters with
`for p in oal.models.attention.kernel_parameters(model): p.requires_grad_(True)` (or list them in
`modules_to_save`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from oal.methods.base import AttentionMethod
from oal.models.attention import swap_attention
from oal.models.auto import make_saveable

__all__ = ["convert", "layer_indices"]


def layer_indices(layers) -> list[int]:
    """`layers` as a list of ints (numpy and 0-d tensor indices too); ValueError naming `layers` otherwise."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ValueError(f"layers: expected a list of layer indices, got {layers!r}")
    out = []
    for i in layers:
        try:
            if isinstance(i, bool) or str(getattr(i, "dtype", "")) in ("bool", "torch.bool"):  # not a mask's True
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            raise ValueError(f"layers: expected integer layer indices, got {i!r}") from None
    if not out:
        raise ValueError("layers: expected at least one layer to convert, got none")
    return out


def convert(model: nn.Module, layers: Sequence[int] | None = None,
            methods: Mapping[int, AttentionMethod] | str = "oal", *, method: str | None = None,
            **method_kwargs: Any) -> nn.Module:
    """Replace the attention of `layers` of `model` (in place) and return the model.

    Converting an already converted layer replaces its method; the other layers keep theirs. The result is the
    same model object given its converted class (`OALQwen2ForCausalLM`, ...): `save_pretrained` writes the
    converted form, which `oal.load` and `AutoModelForCausalLM` (after `import oal`) reload.

    Args:
        model: a Hugging Face causal LM (Llama, Qwen2, Mistral, Qwen3 families) or a BERT-family encoder.
        layers: the layer indices to convert. Default: the keys of `methods`, or `default_layers(model)` (the
            paper's range for its backbones, else every layer but the first and last) when `methods` is a name.
            A dict of methods given here (`convert(model, {1: m})`) is taken as `methods`.
        methods: a dict layer index -> `AttentionMethod` built for this model's (Hq, Hkv, d) (calibrated ones:
            `oal.load`), or a method name (`oal.methods.method_names()`), which builds an uncalibrated default
            instance per layer.
        method: the method name under the keyword `oal.linearize` uses (`convert(model, [1, 2], method="swa")`);
            give it or `methods`, not both.
        **method_kwargs: with a method name, its constructor's settings (`window`, `sinks`, `eps`, `seed`, ...).

    Returns:
        `model`, converted in place.

    Raises:
        ValueError: a model of an unsupported architecture, layer indices out of range or not integers, a method
            built for another head shape, an unknown method name.
    """
    if isinstance(layers, Mapping):  # convert(model, {1: m}): the dict's keys were kept and `m` dropped silently
        if method is not None or method_kwargs or not (isinstance(methods, str) and methods == "oal"):
            raise ValueError("layers: got a dict; a dict layer index -> AttentionMethod goes in `methods` "
                             "(convert(model, methods={1: m})), and `layers` takes indices")
        layers, methods = None, layers
    if method is not None:
        if not (isinstance(methods, str) and methods == "oal"):
            raise ValueError(f"method: given both as `methods` ({methods!r}) and as `method` ({method!r}); give one")
        methods = method
    if layers is not None:
        layers = layer_indices(layers)
    elif isinstance(methods, Mapping) and not methods:
        raise ValueError("methods: expected at least one layer's method, got an empty dict")
    if isinstance(methods, str) and method_kwargs:
        _check_settings(methods, method_kwargs)
    return make_saveable(swap_attention(model, layers, methods, **method_kwargs))


def _check_settings(name: str, settings: Mapping[str, Any]) -> None:
    """Refuse a setting that method `name`'s constructor does not name (`convert(model, layers, "dijiang",
    windw=64)` once dropped it silently), naming this function's argument."""
    from oal.methods.base import unknown_settings

    unknown, known = unknown_settings(name, settings)
    if unknown:
        raise ValueError(f"method_kwargs: {name} takes no setting {', '.join(map(repr, unknown))} (its settings: "
                         f"{known})")
