"""Concentration statistics, isotropic Gaussian controls (App. A.1, Fig. 5) and stability measures (App. A.3)."""

from __future__ import annotations

import torch

from oal.analysis.contributions import head_contributions


def topk_concentration(chi: torch.Tensor, k: int = 5) -> torch.Tensor:
    """Share of the total contribution held by the k largest dims: chi [..., d] -> [...]."""
    if not 1 <= k <= chi.shape[-1]:
        raise ValueError(f"k: expected 1 <= k <= d={chi.shape[-1]}, got {k}")
    return chi.topk(k, dim=-1).values.sum(-1) / chi.sum(-1)


def share_at(chi: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """Share of the total contribution at given dims: chi [..., d], dims [..., k] -> [...]."""
    return chi.gather(-1, dims).sum(-1) / chi.sum(-1)


def gaussian_chi(
    n_prompts: int, n_heads: int, head_dim: int, lengths: list[int], generator: torch.Generator, *,
    causal: bool = True,
) -> torch.Tensor:
    """Isotropic control: chi of i.i.d. N(0, 1) post-RoPE q and k with the real shape -> [P, H, d].

    Each prompt keeps its real token count and the model's pair set (`causal=False` for encoders: every pair), so
    the control differs from the model only in the q/k distribution.
    """
    if len(lengths) != n_prompts:
        raise ValueError(f"lengths: expected {n_prompts} prompt lengths, got {len(lengths)}")
    out = torch.empty(n_prompts, n_heads, head_dim, dtype=torch.float64)
    for p, n in enumerate(lengths):
        q = torch.randn(1, n_heads, n, head_dim, generator=generator, dtype=torch.float64)
        k = torch.randn(1, n_heads, n, head_dim, generator=generator, dtype=torch.float64)
        out[p] = head_contributions(q, k, causal=causal)[0]
    return out


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean rank) along the last dim, 1-based."""
    order = x.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks.scatter_(-1, order, torch.arange(1, x.shape[-1] + 1, dtype=torch.float64).expand(x.shape).contiguous())
    flat_x, flat_r = x.reshape(-1, x.shape[-1]), ranks.reshape(-1, x.shape[-1])
    for row in range(flat_x.shape[0]):  # ties are rare in real scores; fix them row by row
        vals, inverse, counts = torch.unique(flat_x[row], return_inverse=True, return_counts=True)
        if (counts > 1).any():
            mean_rank = torch.zeros(vals.numel(), dtype=torch.float64).index_add_(0, inverse, flat_r[row])
            flat_r[row] = (mean_rank / counts)[inverse]
    return flat_r.reshape(x.shape)


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation along the last dim (Pearson correlation of average ranks) -> [...]."""
    if a.shape != b.shape:
        raise ValueError(f"b: expected shape {tuple(a.shape)}, got {tuple(b.shape)}")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int = 5) -> torch.Tensor:
    """How many of the top-k dims of a are also top-k dims of b -> LongTensor [...]."""
    ta, tb = a.topk(k, dim=-1).indices, b.topk(k, dim=-1).indices
    return (ta[..., :, None] == tb[..., None, :]).any(-1).sum(-1)
