"""SpectraFormer, OPRF-FastFoodL variant (Nguyen et al.), with App. F.1's settings.

Projection (FastFood, Le et al. 2013): W = (1/sqrt(p)) diag(S) H diag(G) P H diag(B), H the unnormalised
p x p Walsh-Hadamard matrix (p = d rounded up to a power of two, inputs zero-padded), P a fixed random
permutation; B, G, S in R^p are trainable, one set per layer shared by all query heads, initialised from
the standard FastFood distributions (B Rademacher, G N(0,1), S chi(p) lengths / |G|), so rows of W are
marginally N(0, I) like Performer's.

Features, as the official code (dukenguyenxyz/spectraformer: `PerformerAttention` -> `FastAttention` with
`SmoothedFastFoodRandomFeatures` and `get_rfs_torch`, rf_type "oprf") computes them. With x = d^-1/4 q (keys
alike), the FastFood map scales its input once more by sqrt(softmax_temp) = d^-1/4 and appends a constant
"smoothing" coordinate 1, giving the d + 1 = 65 pre-activations (App. F.1's "65 positive features for d = 64")
    u(x) = [d^-1/4 W x ; 1].
OPRF ("optimised positive random features", Likhosherstov et al.) then forms
A |w|^2 + sqrt(1 - 4A) u_l - |x|^2; upstream's FastFood branch takes |w| as the norm of the vector S*G*B, one
number for every feature, so A |w|^2 and -|x|^2 are per-token constants that the per-token row-max shift removes
exactly. What remains, and what we compute:
    phi(x)_l = exp(b(x) (u_l - max_l' u_l')) + 1e-4,   b(x) = sqrt(1 - 4 A(x)) >= 1,
the row-max shift and 1e-4 offset being upstream's stabilisation (App. F.1). With the offset the shift is part
of the function (it does not cancel), so gradients flow through it (not detached), as upstream.

A <= 0 is OPRF's variance-optimal value (`oprf_a`) for the statistic z ~ |x + y|^2. Upstream estimates it per
head and *position*: z_t = mean_b |x_bt|^2 + mean_b |y_bt|^2 + 2 mean_b x_bt . mean_b y_bt, a mean over the
batch axis, and uses A_t for the query and the key at position t. We keep a per-token value from the token's
own norm instead, z = 2 |x|^2 (|x + y|^2 with the cross term zero on average and |y| ~ |x|), because (1) the
method interface evaluates arbitrary query sets against key prefixes (sampled query positions for Tables 1/2,
calibration), where the key at position t has no query t to pair with, (2) key features must not depend on the
queries to be shared per KV head and carried in the decoding state, and (3) a batch mean would make one
sequence's output depend on the other sequences in its batch. (With batch size 1 and q_t ~ k_t upstream's z_t
is the same quantity.)

Features and causal prefix sums are computed in fp64 by default, the trainable vectors stay fp32 (App. E, F.1).

Version 2: version 1 applied W to x without upstream's second d^-1/4, used a zero projection row as the 65th
feature, added a per-row A |w_l|^2 and detached the row max; kernels files of version 1 are refused on load.
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
    if p < 1 or p & (p - 1):
        raise ValueError(f"p: expected a power of two, got {p}")
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
    version = 2  # upstream's feature map (see module doc); version 1 computed another one from the same B, G, S
    layer_shared = ("B", "G", "S", "perm", "H")  # App. F.1: one set per layer, shared by its query heads

    def __init__(self, n_heads, n_kv_heads, head_dim, *, dtype=torch.float64, chunk_size: int = 64,
                 n_features: int | None = None, layer_idx: int = 0, seed: int = 0):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        self.dtype, self.chunk_size = dtype, chunk_size
        p = 1 << max(0, math.ceil(math.log2(head_dim)))
        self.p = p
        if n_features is not None and n_features != self.n_features:  # saved records hold it; a different one
            # was dropped silently, as if it set the feature count (head_dim sets it: FastFood's power of two, + 1)
            raise ValueError(f"n_features: spectraformer has p + 1 = {self.n_features} features for head_dim "
                             f"{head_dim} (p the next power of two), got {n_features!r}")
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
        """Rows w_l of the FastFood matrix restricted to the first d input coordinates: [p, d]."""
        h = self.H.to(dtype)
        inner = (h * self.B.to(dtype))[self.perm]  # P H diag(B)
        w = (self.S.to(dtype)[:, None] * h * self.G.to(dtype)) @ inner / math.sqrt(self.p)
        return w[:, : self.head_dim]

    def _feature(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Positive OPRF features [.., N, p+1] of scaled inputs x = d^-1/4 q [.., N, d] (see module doc)."""
        d = self.head_dim
        b = torch.sqrt(1 - 4 * oprf_a(2 * x.pow(2).sum(-1, keepdim=True), d))  # per token, own |x|^2
        u = torch.cat([(x * d ** -0.25) @ w.T, torch.ones_like(x[..., :1])], dim=-1)  # FastFood's d^-1/4, then 1
        lf = b * u
        return torch.exp(lf - lf.amax(-1, keepdim=True)) + OFFSET  # upstream: per-token row max, then +1e-4

    def _features(self, q, k):
        dt = compute_dtype(q, self.dtype)
        s = self.head_dim ** -0.25  # upstream data normaliser: x = d^-1/4 q
        w = self.projection(dt)
        return self._feature(q.to(dt) * s, w), self._feature(k.to(dt) * s, w)  # keys shared per KV head
