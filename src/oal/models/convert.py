"""`convert`: swap the attention of chosen layers for an attention method (`models.attention`) and give the model
its converted class (`models.auto.converted_class`), so that its own `save_pretrained` writes the converted form.

Use with peft: call `convert` first, then `get_peft_model`; peft freezes non-LoRA weights, so re-enable the kernel
parameters with `for p in kernel_parameters(model): p.requires_grad_(True)` (or list them in `modules_to_save`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from oal.methods.base import AttentionMethod
from oal.models.attention import swap_attention
from oal.models.auto import make_saveable

__all__ = ["convert"]


def convert(model: nn.Module, layers: Sequence[int] | None = None,
            methods: Mapping[int, AttentionMethod] | str = "oal", **method_kwargs) -> nn.Module:
    """Replace attention in `layers` of `model` (in place) and return the model.

    `methods` maps layer index -> AttentionMethod built for this model's (Hq, Hkv, d); a method name instead
    builds a default instance per layer (`method_kwargs` passed on). `layers` defaults to the keys of `methods`,
    or to `default_layers(model)` when `methods` is a name. Converting an already converted layer replaces its method.
    """
    return make_saveable(swap_attention(model, layers, methods, **method_kwargs))
