"""DiJiang (Chen et al. 2024) as adapted in App. F.1: a normalised causal kernel over DCT softmax features.

Projection (App. F.1: "an orthonormal DCT with diagonal inverse standard-normal samples"), as the official
code builds it (YuchuanTian/DiJiang, `_build_projection`): P = C diag(g) [d, d], C the orthonormal DCT-II matrix
(C[k, n] = DCT coefficient k of the unit vector e_n, scipy's `dct(eye(d), axis=0, norm="ortho")`) and
g_l = Phi^-1(U_l) with U_l ~ Uniform(0, 1): standard-normal samples drawn through the inverse normal CDF (an
exact 0 draw, whose inverse CDF is -inf, becomes 0 as upstream does). One draw per layer, shared by its heads.
Upstream draws U with `torch.rand` (pseudo-random, not a quasi-Monte-Carlo sequence or a grid), so do we, from a
generator keyed by (seed, layer). Rows act on the right: z(x) = x P, i.e. z = diag(g) C^T x.

Features: with x = d^-1/4 q, phi(x) = softmax(z(x)) over the d feature coordinates. Positive feature weights
D = exp(theta) (theta in R^d per query head, init 0, trainable) multiply both query and key features, so
kappa(q, k) = sum_l exp(2 theta_l) phi(q)_l phi(k)_l; we put exp(2 theta) on the query side, which lets query
heads share their KV head's key features. No positional decay, GroupNorm or output gate.

Version 2: version 1 built diag(1/g) C from `randn` draws and applied it as C x / g, which made |1/g| large
and the features nearly one-hot; kernels files of version 1 are refused on load (`base.check_version`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from oal.methods._common import compute_dtype, generator_for
from oal.methods.base import register
from oal.methods.features import FeatureMapMethod

__all__ = ["DiJiangMethod", "dct_matrix", "inverse_normal_samples"]


def dct_matrix(d: int) -> torch.Tensor:
    """Orthonormal DCT-II [d, d]: C[k, n] = sqrt(2/d) cos(pi (2n + 1) k / (2d)), row 0 scaled by 1/sqrt(2)."""
    if d < 1:
        raise ValueError(f"d: expected a positive integer, got {d}")
    n = torch.arange(d, dtype=torch.float64)
    c = math.sqrt(2.0 / d) * torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * d))
    c[0] /= math.sqrt(2.0)
    return c


def inverse_normal_samples(d: int, generator: torch.Generator) -> torch.Tensor:
    """g = Phi^-1(U), U ~ Uniform[0, 1)^d (fp64); a non-finite value (U = 0) becomes 0, as upstream."""
    u = torch.rand(d, generator=generator, dtype=torch.float64)
    g = torch.distributions.Normal(0.0, 1.0).icdf(u)
    return torch.where(torch.isfinite(g), g, torch.zeros_like(g))


@register
class DiJiangMethod(FeatureMapMethod):
    name = "dijiang"
    stochastic = True  # the fixed inverse-normal diagonal is a random draw
    version = 2  # P = C diag(g) applied as x P (version 1: diag(1/g) C applied as C x / g)
    layer_shared = ("projection",)  # one fixed [d, d] draw per layer (theta is per query head)

    def __init__(self, n_heads, n_kv_heads, head_dim, *, dtype=torch.float32, chunk_size: int = 64,
                 layer_idx: int = 0, seed: int = 0):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        self.dtype, self.chunk_size = dtype, chunk_size
        g = inverse_normal_samples(head_dim, generator_for("dijiang", seed, layer_idx))
        # App. F.1: orthonormal DCT times diagonal inverse-normal samples, P = C diag(g), used as z = x P
        self.register_buffer("projection", dct_matrix(head_dim) * g[None, :])
        self.theta = nn.Parameter(torch.zeros(n_heads, head_dim))

    def _features(self, q, k):
        dt = compute_dtype(q, self.dtype)
        s = self.head_dim ** -0.25
        p = self.projection.to(dt)
        fq = torch.softmax((q.to(dt) * s) @ p, dim=-1) * torch.exp(2 * self.theta.to(dt))[None, :, None, :]
        fk = torch.softmax((k.to(dt) * s) @ p, dim=-1)  # [B, Hkv, N, d]: shared by the group's query heads
        return fq, fk
