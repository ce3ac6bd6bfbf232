"""SpectraFormer, OPRF-FastFoodL variant (Nguyen et al.), with App. F.1's settings.

Projection (FastFood, Le et al. 2013): W = (1/sqrt(p)) diag(S) H diag(G) P H diag(B), H the unnormalised
p x p Walsh-Hadamard matrix (p = d rounded up to a power of two, inputs zero-padded), P a fixed random
permutation; B, G, S in R^p are trainable, one set per layer shared by all query heads, initialised from
the standard FastFood distributions (B Rademacher, G N(0,1), S chi(p) lengths / |G|), so rows of W are
marginally N(0, I) like Performer's.

Component function (OPRF, "optimised positive random features"): with x = d^-1/4 q, y = d^-1/4 k,
    log phi(x)_l = A |w_l|^2 + sqrt(1 - 4A) w_l . x - |x|^2,
where A <= 0 is OPRF's variance-optimal value for the statistic z = |x + y|^2 (Likhosherstov et al.). Upstream
estimates z from the query and key at the *same position* (a batch mean); that pairing cannot be formed
causally for arbitrary query/key sets (sampled query positions, decoding), so each side uses its own token:
z = 2 |x|^2 (|x + y|^2 with the cross term zero on average and |y| ~ |x|). Then the per-token row max is
subtracted and 1e-4 added (upstream's stabilisation; for keys it changes the kernel, as in the adapted method).

Features: m = p + 1 (65 for d = 64): the p FastFood rows plus the zero-frequency row w = 0. This is our
reading of App. F.1's "65 positive features for d = 64" with one FastFood block (3d parameters).
Features and causal prefix sums are computed in fp64 by default, the trainable vectors stay fp32 (App. E, F.1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from oal.methods._common import compute_dtype, generator_for
from oal.methods.base import register
from oal.methods.features import FeatureMapMethod

__all__ = ["SpectraFormerMethod", "hadamard", "oprf_a"]

OFFSET = 1e-4


def hadamard(p: int) -> torch.Tensor:
    """Sylvester Walsh-Hadamard matrix [p, p] with +-1 entries, p a power of two."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def oprf_a(z: torch.Tensor, d: int) -> torch.Tensor:
    """OPRF's A from the statistic z = |x + y|^2: A = (1 - 1/rho)/8 with rho the positive root of
    2z rho^2 + (2z + d) rho - d = 0, written as 2d / (b + sqrt(b^2 + 8 z d)) so that z = 0 gives A = 0."""
    b = 2 * z + d
    rho = 2 * d / (b + torch.sqrt(b * b + 8 * z * d))
    return (1 - 1 / rho) / 8


@register
class SpectraFormerMethod(FeatureMapMethod):
    name = "spectraformer"
    stochastic = True

    def __init__(self, n_heads, n_kv_heads, head_dim, *, dtype=torch.float64, chunk_size: int = 64,
                 layer_idx: int = 0, seed: int = 0, **_ignored):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        self.dtype, self.chunk_size = dtype, chunk_size
        p = 1 << max(0, math.ceil(math.log2(head_dim)))
        self.p = p
        g = generator_for("spectraformer", seed, layer_idx)
        b = torch.randint(0, 2, (p,), generator=g).double() * 2 - 1  # Rademacher
        gauss = torch.randn(p, generator=g, dtype=torch.float64)
        chi = torch.randn(p, p, generator=g, dtype=torch.float64).norm(dim=-1)  # chi(p) lengths
        self.B = nn.Parameter(b.float())
        self.G = nn.Parameter(gauss.float())
        self.S = nn.Parameter((chi / gauss.norm()).float())
        self.register_buffer("perm", torch.randperm(p, generator=g))
        self.register_buffer("H", hadamard(p), persistent=False)

    @property
    def n_features(self) -> int:
        return self.p + 1

    def projection(self, dtype) -> torch.Tensor:
        """Rows w_l of the FastFood matrix restricted to the first d input coordinates, plus w = 0: [p+1, d]."""
        h = self.H.to(dtype)
        inner = (h * self.B.to(dtype))[self.perm]  # P H diag(B)
        w = (self.S.to(dtype)[:, None] * h * self.G.to(dtype)) @ inner / math.sqrt(self.p)
        w = w[:, : self.head_dim]
        return torch.cat([w, w.new_zeros(1, self.head_dim)])

    def _feature(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Positive OPRF features [.., N, p+1] of scaled inputs x [.., N, d]."""
        xn = x.pow(2).sum(-1, keepdim=True)
        a = oprf_a(2 * xn, self.head_dim)  # per token, from its own |x|^2 (see module doc)
        lf = a * w.pow(2).sum(-1) + torch.sqrt(1 - 4 * a) * (x @ w.T) - xn
        return torch.exp(lf - lf.amax(-1, keepdim=True).detach()) + OFFSET  # row-max shift, then +1e-4

    def _features(self, q, k):
        dt = compute_dtype(q, self.dtype)
        s = self.head_dim ** -0.25  # upstream data normaliser: x = d^-1/4 q
        w = self.projection(dt)
        return self._feature(q.to(dt) * s, w), self._feature(k.to(dt) * s, w)  # keys shared per KV head
