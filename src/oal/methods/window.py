"""Sliding-window methods: `swa` (softmax baseline), `oal-swa` (window + OAL kernel) and `global-swa` (its G = 1
control). The operator and its state are in `oal.ops.window`.

- swa: softmax over the last `window` keys and the first `sinks` keys (StreamingLLM). No kernel parameters;
  LoRA adapts it like the softmax arm.
- oal-swa: exact e^{s_ij} on the last `window` keys and the first `sinks` keys, OAL's calibrated kappa_ij (Eq. 7,
  same groups and factor as `oal`) on every other older key, one normaliser (LoLCATs' sliding-window linear
  attention with OAL's kernel, plus StreamingLLM's sinks: the quadratic kernel cannot give the first tokens the
  peaked weight heads put there). The factor is trainable as in `oal`, so it calibrates and adapts jointly with
  LoRA; note that here the kernel's scale does not cancel: it weighs the older keys against the exact ones.
- global-swa: the same with the learned global quadratic a + b s + c s^2 (one group).

The hybrids' construction version 2 added the sinks: a version-1 record (kernels file, exported model) is the
hybrid with sinks=0 and loads as that (`legacy`), while a run's stage keys change with the version
(`newer_versions`), so a run recalibrates them.

Query positions: `dense_kernel(q, k)` puts query i at key position i + M - N (the base class's alignment);
pass `positions` [N] for queries elsewhere (sampled calibration positions).
"""

from __future__ import annotations

import math

import torch

from oal.errors import check_int
from oal.methods._common import check_qkv, shifted_exp
from oal.methods.base import AttentionMethod, register
from oal.methods.oal import GlobalMethod, OALMethod
from oal.ops.window import window_attention, window_log_weights

__all__ = ["GlobalSWAMethod", "OALSWAMethod", "SWAMethod"]


def _positions(n: int, m: int, positions, device) -> torch.Tensor:
    if positions is None:
        return torch.arange(m - n, m, device=device)
    positions = torch.as_tensor(positions, device=device)
    if positions.shape != (n,) or (n and (int(positions.min()) < 0 or int(positions.max()) >= m)):
        raise ValueError(f"positions: expected [{n}] key positions in [0, {m}), got {tuple(positions.shape)}")
    return positions


class _Windowed:
    """The dense weights of the window methods from their `_log_weights(q, k, positions)`."""

    def dense_kernel(self, q, k, positions=None):
        return shifted_exp(self._log_weights(q, k, positions))

    def masked_kernel(self, q, k, allowed, positions=None):
        return shifted_exp(self._log_weights(q, k, positions), allowed)


@register
class SWAMethod(_Windowed, AttentionMethod):
    name = "swa"
    supports_state = True
    settings = ("window", "sinks")
    positional = True

    def __init__(self, n_heads, n_kv_heads, head_dim, *, window: int = 64, sinks: int = 4, layer_idx: int = 0,
                 seed: int = 0):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        self.window, self.sinks = check_int("window", window, 1), check_int("sinks", sinks, 0)

    def _log_weights(self, q, k, positions=None):
        check_qkv(self, q, k)
        pos = _positions(q.shape[2], k.shape[2], positions, q.device)
        return window_log_weights(q, k, pos, window=self.window, sinks=self.sinks, scale=1.0 / math.sqrt(q.shape[-1]))

    def reference(self, q, k, v, *, causal: bool = True):
        check_qkv(self, q, k, v)
        return window_attention(q, k, v, window=self.window, sinks=self.sinks, causal=causal, backend="reference")

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        check_qkv(self, q, k, v)
        return window_attention(q, k, v, window=self.window, sinks=self.sinks, causal=causal,
                                initial_state=initial_state, output_final_state=output_final_state)


class _WindowKernel(_Windowed):
    """The window part of oal-swa and global-swa, mixed into OALMethod (groups buffer, trainable factor)."""

    window: int
    sinks: int
    settings = ("window", "sinks")
    positional = True
    version = 2  # sinks; version 1 had none, i.e. it is this construction with sinks=0
    legacy = {1: {"sinks": 0}}

    def _log_weights(self, q, k, positions=None):
        check_qkv(self, q, k)
        pos = _positions(q.shape[2], k.shape[2], positions, q.device)
        kernel = (self.groups, self.factor.to(q.dtype), self.eps)
        return window_log_weights(q, k, pos, window=self.window, sinks=self.sinks, kernel=kernel,
                                  scale=1.0 / math.sqrt(q.shape[-1]))

    def reference(self, q, k, v, *, causal: bool = True):
        check_qkv(self, q, k, v)
        return window_attention(q, k, v, window=self.window, sinks=self.sinks, groups=self.groups,
                                factor=self.factor, eps=self.eps, causal=causal, backend="reference")

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        check_qkv(self, q, k, v)
        return window_attention(q, k, v, window=self.window, sinks=self.sinks, groups=self.groups,
                                factor=self.factor, eps=self.eps, causal=causal, initial_state=initial_state,
                                output_final_state=output_final_state)


@register
class OALSWAMethod(_WindowKernel, OALMethod):
    """`oal`'s groups [Hq, d] and trainable factor [Hq, G+1, G+1] on the older keys, softmax on the window."""

    name = "oal-swa"

    def __init__(self, n_heads, n_kv_heads, head_dim, *, window: int = 64, sinks: int = 4, groups=None,
                 factor=None, n_groups: int = 2, eps: float = 1e-6, layer_idx: int = 0, seed: int = 0):
        super().__init__(n_heads, n_kv_heads, head_dim, groups=groups, factor=factor, n_groups=n_groups, eps=eps,
                         layer_idx=layer_idx, seed=seed)
        self.window, self.sinks = check_int("window", window, 1), check_int("sinks", sinks, 0)


@register
class GlobalSWAMethod(_WindowKernel, GlobalMethod):
    """The learned global quadratic (G = 1) on the older keys: the control for oal-swa's grouping."""

    name = "global-swa"

    def __init__(self, n_heads, n_kv_heads, head_dim, *, window: int = 64, sinks: int = 4, factor=None,
                 eps: float = 1e-6, groups=None, n_groups: int = 1, layer_idx: int = 0, seed: int = 0):
        # groups / n_groups are accepted and ignored, as by `global`: one group whatever the caller's grouping
        super().__init__(n_heads, n_kv_heads, head_dim, factor=factor, eps=eps, layer_idx=layer_idx, seed=seed)
        self.window, self.sinks = check_int("window", window, 1), check_int("sinks", sinks, 0)
