"""DiJiang (Chen et al. 2024) as adapted in App. F.1: a normalised causal kernel over DCT softmax features.

With x = d^-1/4 q: z(x) = (C x) / g, C the orthonormal DCT-II matrix [d, d] and g ~ N(0, 1)^d fixed
(a diagonal of inverse standard-normal samples, one draw per layer); phi(x) = softmax(z(x)) over the d
feature coordinates. Positive feature weights D = exp(theta) (theta in R^d per query head, init 0,
trainable) multiply both query and key features, so kappa(q, k) = sum_l exp(2 theta_l) phi(q)_l phi(k)_l;
we put exp(2 theta) on the query side, which lets query heads share their KV head's key features.
No positional decay, GroupNorm or output gate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from oal.methods._common import compute_dtype, generator_for
from oal.methods.base import register
from oal.methods.features import FeatureMapMethod

__all__ = ["DiJiangMethod", "dct_matrix"]


def dct_matrix(d: int) -> torch.Tensor:
    """Orthonormal DCT-II [d, d]: C[k, n] = sqrt(2/d) cos(pi (2n + 1) k / (2d)), row 0 scaled by 1/sqrt(2)."""
    n = torch.arange(d, dtype=torch.float64)
    c = math.sqrt(2.0 / d) * torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * d))
    c[0] /= math.sqrt(2.0)
    return c


@register
class DiJiangMethod(FeatureMapMethod):
    name = "dijiang"
    stochastic = True  # the fixed inverse-normal diagonal is a random draw

    def __init__(self, n_heads, n_kv_heads, head_dim, *, dtype=torch.float32, chunk_size: int = 64,
                 layer_idx: int = 0, seed: int = 0, **_ignored):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        self.dtype, self.chunk_size = dtype, chunk_size
        g = torch.randn(head_dim, generator=generator_for("dijiang", seed, layer_idx), dtype=torch.float64)
        self.register_buffer("projection", dct_matrix(head_dim) / g[:, None])  # diag(1/g) C
        self.theta = nn.Parameter(torch.zeros(n_heads, head_dim))

    def _features(self, q, k):
        dt = compute_dtype(q, self.dtype)
        s = self.head_dim ** -0.25
        w = self.projection.to(dt)
        fq = torch.softmax((q.to(dt) * s) @ w.T, dim=-1) * torch.exp(2 * self.theta.to(dt))[None, :, None, :]
        fk = torch.softmax((k.to(dt) * s) @ w.T, dim=-1)  # [B, Hkv, N, d]: shared by the group's query heads
        return fq, fk
