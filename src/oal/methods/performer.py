"""Performer (FAVOR+, Choromanski et al. 2021) with App. F.1's settings.

Positive orthogonal random features, 250 per query head, drawn once per (seed, layer, query head) and
fixed (a buffer, never trained). With x = d^-1/4 q and y = d^-1/4 k,
    phi(x)_l = exp(w_l . x - |x|^2 / 2) / sqrt(m),   E[phi(x) . phi(y)] = exp(x . y) = exp(q . k / sqrt(d)).
Stabilisation: query log-features are shifted by their per-token max (a per-query factor, cancels in the
normalisation); key log-features by a max over tokens and features. In the linear path that key max is a
running max over the causal prefix (see features.py), so no query sees a future key through it; the masked dense
path (`masked_kernel`) takes it per query over the keys that query keeps.
The 1/sqrt(m) factor cancels in the normalised ratio and is dropped. Upstream's FAVOR+ code also adds a
`numerical_stabilizer` (1e-6) to every feature; App. F.1 states that the shifts cancel, which holds only without
it, so it is not added (fp64 features need no floor).
Features and causal prefix sums are computed in fp64 by default (App. E, F.1); the output is cast back to the
input dtype.
"""

from __future__ import annotations

import math

import torch

from oal.methods._common import check_qkv, compute_dtype, generator_for
from oal.methods.base import register
from oal.methods.features import FeatureMapMethod, dense_feature_kernel

__all__ = ["PerformerMethod", "orthogonal_gaussian"]


def orthogonal_gaussian(m: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """[m, d] rows: blocks of d orthonormal directions (QR of a Gaussian), each row scaled by an independent
    chi(d) length so that every row is marginally N(0, I_d) (FAVOR+'s regular-norm orthogonal features)."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        qmat, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
        blocks.append(qmat.T)
    directions = torch.cat(blocks)[:m]
    lengths = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return directions * lengths


@register
class PerformerMethod(FeatureMapMethod):
    name = "performer"
    stochastic = True
    log_keys = True  # key features stay in log space until `feature_attention` shifts them causally

    def __init__(self, n_heads, n_kv_heads, head_dim, *, n_features: int = 250, dtype=torch.float64,
                 chunk_size: int = 64, layer_idx: int = 0, seed: int = 0):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        if n_features < 1:
            raise ValueError(f"n_features: expected a positive integer, got {n_features}")
        self.n_features, self.dtype, self.chunk_size = n_features, dtype, chunk_size
        w = torch.stack([orthogonal_gaussian(n_features, head_dim, generator_for("performer", seed, layer_idx, h))
                         for h in range(n_heads)])
        # drawn in fp64, stored as a buffer: fixed, saved with the layer, never trained
        self.register_buffer("projection", w, persistent=True)

    def _log_features(self, x: torch.Tensor, per_query_head: bool) -> torch.Tensor:
        """w_l . x - |x|^2/2 for x [B, H, N, d] (already scaled), projections of the matching query heads."""
        w = self.projection.to(x.dtype)  # [Hq, m, d]
        half_sq = 0.5 * x.pow(2).sum(-1, keepdim=True)
        if per_query_head:
            return torch.einsum("bhnd,hmd->bhnm", x, w) - half_sq
        # keys [B, Hkv, N, d] against the projections of every query head in their group; k is never repeated
        b, n_kv, n, d = x.shape
        proj = torch.einsum("bgnd,grmd->bgrnm", x, w.view(n_kv, self.n_rep, -1, d)) - half_sq.unsqueeze(2)
        return proj.flatten(1, 2)  # [B, Hq, N, m]; a reshape with -1 failed on empty inputs (B or N = 0)

    def _features(self, q, k):
        dt = compute_dtype(q, self.dtype)
        s = self.head_dim ** -0.25  # q, k scaled by d^-1/4 so that x . y = q . k / sqrt(d)
        lq = self._log_features(q.to(dt) * s, True)
        fq = torch.exp(lq - lq.amax(-1, keepdim=True).detach())  # per-token query shift (cancels per row)
        lk = self._log_features(k.to(dt) * s, False)
        return fq, lk

    def dense_kernel(self, q, k):
        check_qkv(self, q, k)
        fq, lk = self._features(q, k)
        if lk.shape[-2] == 0:  # no keys: amax has nothing to reduce
            return dense_feature_kernel(fq, lk.exp())
        # one shift over all keys' tokens and features: a constant per (batch, head), cancels when normalised
        fk = torch.exp(lk - lk.detach().amax(dim=(-2, -1), keepdim=True))
        return dense_feature_kernel(fq, fk)

    def masked_kernel(self, q, k, allowed):
        """The key shift taken per query over the keys it keeps (tokens and features), a per-row constant that
        cancels as the linear path's causal running max does; a masked key cannot underflow the kept weights."""
        check_qkv(self, q, k)
        fq, lk = self._features(q, k)
        top = lk.detach().amax(-1)  # [B, Hq, M] each key's own max: factored out exactly, multiplied back below
        rel = torch.where(allowed, top.unsqueeze(-2), -torch.inf)  # [B, Hq, N, M], no grad: updated in place
        if rel.shape[-1]:
            rel.sub_(rel.amax(-1, keepdim=True).clamp_min(torch.finfo(rel.dtype).min))  # row shift; 0 if none kept
        w = dense_feature_kernel(fq, torch.exp(lk - top.unsqueeze(-1))) * rel.exp_()
        # and the row's largest weight set to 1 (per row again), so that callers casting the fp64 weights to the
        # values' dtype lose only weights too small to count
        if not w.shape[-1]:
            return w
        big = w.detach().amax(-1, keepdim=True)
        return w / torch.where(big > 0, big, 1.0)
