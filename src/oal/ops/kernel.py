"""OAL kernel parameters: factor L -> coefficients (a, b, C), feature maps and initialisations.

The kernel of one query head is (paper Eq. 7)

    kappa(q, k) = eps + |L^T s_bar|^2,   s_bar = [1, s_1, ..., s_G],   s_g = scale * sum_{r in g} q_r k_r,

which expands to a + sum_r b_r x_r + sum_{r,t} C_rt x_r x_t with x_r = scale q_r k_r (Eq. 3, Eq. 24).
Its separable form is phi(q) . psi(k) with key features psi(k) = [1, k, k_r k_t (r <= t)] shared by all
query heads of a KV head, and query features phi(q) that carry the per-head coefficients.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "coefficients",
    "factor_to_matrix",
    "feature_dim",
    "global_embedded_factor",
    "key_features",
    "packed_pairs",
    "pair_products",
    "perturbed_factor",
    "query_features",
    "taylor_factor",
]

# Cholesky factor of the Taylor quadratic 1 + s + s^2/2 as M = [[1, 1/2], [1/2, 1/2]].
_TAYLOR_GLOBAL = ((1.0, 0.0), (0.5, 0.5))


def feature_dim(d: int) -> int:
    """Rows of the state of one KV head: 1 (H0) + d (H1) + d(d+1)/2 (H2, packed symmetric)."""
    return 1 + d + d * (d + 1) // 2


_PAIR_CACHE: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def packed_pairs(d: int, device: torch.device | str = "cpu"):
    """Indices (r, t) with r <= t in row-major order, and the multiplicity (1 diagonal, 2 off) of each pair."""
    key = (d, str(device))
    if key not in _PAIR_CACHE:
        r, t = torch.triu_indices(d, d, device=device)
        mult = torch.where(r == t, 1.0, 2.0).to(device)
        _PAIR_CACHE[key] = (r, t, mult)
    return _PAIR_CACHE[key]


def factor_to_matrix(factor: torch.Tensor) -> torch.Tensor:
    """M = L L^T with L the lower triangle of `factor` (Section 4.3)."""
    lower = torch.tril(factor)
    return lower @ lower.transpose(-1, -2)


def coefficients(factor: torch.Tensor, groups: torch.Tensor, eps: float):
    """Map factor [H, G+1, G+1] and groups [H, d] to (a [H], b [H, d], C [H, d, d]) as in Section 4.3."""
    m = factor_to_matrix(factor)
    idx = groups.long() + 1  # group id g lives at row/column g+1 of M (row 0 is the constant)
    a = eps + m[:, 0, 0]
    b = 2.0 * torch.gather(m[:, 0, :], 1, idx)
    rows = torch.gather(m, 1, idx.unsqueeze(-1).expand(-1, -1, m.shape[-1]))  # [H, d, G+1]
    c = torch.gather(rows, 2, idx.unsqueeze(1).expand(-1, idx.shape[1], -1))  # [H, d, d]
    return a, b, c


_GATHER_MAX = 1 << 15  # elements of x below which pair_products gathers instead of slicing


def pair_products(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x_r x_t for r <= t in `packed_pairs` order [..., d(d+1)/2].

    Built from d contiguous slices x_r * x[r:], an order of magnitude faster on CPU than a gather. With `out`
    (no autograd) the products are written in place.
    """
    d = x.shape[-1]
    if x.numel() <= _GATHER_MAX:  # few rows (decoding): one gather beats d small ops
        r, t, _ = packed_pairs(d, x.device)
        return torch.mul(x[..., r], x[..., t], out=out)
    if out is None:
        return torch.cat([x[..., r : r + 1] * x[..., r:] for r in range(d)], dim=-1)
    start = 0
    for r in range(d):
        torch.mul(x[..., r : r + 1], x[..., r:], out=out[..., start : start + d - r])
        start += d - r
    return out


def query_features(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale: float, out=None):
    """phi(q) [..., H, N, F] for q [..., H, N, d] with per-head coefficients (Eq. 6, packed symmetric).

    `out`: a buffer to fill (inference only; under autograd a new tensor is built).
    """
    d = q.shape[-1]
    r, t, mult = packed_pairs(d, q.device)
    c_packed = (c[:, r, t] * mult.to(c.dtype)) * (scale * scale)  # [H, P]
    if torch.is_grad_enabled() and (q.requires_grad or c.requires_grad or b.requires_grad):
        const = a.view(-1, 1, 1).expand(*q.shape[:-1], 1)
        quad = pair_products(q) * c_packed[:, None, :]
        return torch.cat([const.to(q.dtype), q * (b * scale)[:, None, :], quad], dim=-1)
    # inference: fill one buffer in place, without the temporaries of cat
    if out is None:
        out = torch.empty(*q.shape[:-1], feature_dim(d), dtype=q.dtype, device=q.device)
    out[..., 0] = a.view(-1, 1).to(q.dtype)
    torch.mul(q, (b * scale)[:, None, :], out=out[..., 1 : 1 + d])
    quad = pair_products(q, out[..., 1 + d :])
    quad.mul_(c_packed[:, None, :])
    return out


def key_features(k: torch.Tensor, out=None) -> torch.Tensor:
    """psi(k) [..., N, F] = [1, k, k_r k_t (r <= t)]: the keys' side of the state update (Eq. 5)."""
    d = k.shape[-1]
    if torch.is_grad_enabled() and k.requires_grad:
        ones = torch.ones(*k.shape[:-1], 1, dtype=k.dtype, device=k.device)
        return torch.cat([ones, k, pair_products(k)], dim=-1)
    if out is None:
        out = torch.empty(*k.shape[:-1], feature_dim(d), dtype=k.dtype, device=k.device)
    out[..., 0] = 1.0
    out[..., 1 : 1 + d] = k
    pair_products(k, out[..., 1 + d :])
    return out


def _embed_global(lower2: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Place 2x2 global factors [H, 2, 2] into [H, G+1, G+1] so that every group shares (a, b, c) (App. D)."""
    heads = lower2.shape[0]
    out = lower2.new_zeros(heads, n_groups + 1, n_groups + 1)
    out[:, 0, 0] = lower2[:, 0, 0]
    out[:, 1:, 0] = lower2[:, 1, 0, None]
    out[:, 1:, 1] = lower2[:, 1, 1, None]
    return out


def taylor_factor(n_heads: int, n_groups: int, dtype=torch.float32) -> torch.Tensor:
    """Factor whose kernel is eps + 1 + s + s^2/2 for any grouping (second-order Taylor initialisation)."""
    base = torch.tensor(_TAYLOR_GLOBAL, dtype=dtype).expand(n_heads, 2, 2)
    return _embed_global(base, n_groups)


def global_embedded_factor(global_factor: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Embed learned G=1 factors [H, 2, 2] into G groups: the same polynomial a + b s + c s^2 (App. D)."""
    if global_factor.dim() != 3 or global_factor.shape[-2:] != (2, 2):
        raise ValueError(f"global_factor: expected shape [H, 2, 2], got {tuple(global_factor.shape)}")
    return _embed_global(torch.tril(global_factor), n_groups)


def perturbed_factor(factor: torch.Tensor, std: float = 0.05, generator: torch.Generator | None = None):
    """Gaussian perturbation of the lower triangle, relative to each head's largest entry.

    The embedded global factor has zero columns, which are a stationary point of the loss; the noise lets
    calibration use the extra group coefficients.
    """
    noise = torch.randn(factor.shape, generator=generator, dtype=factor.dtype)
    size = torch.tril(factor).abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-3)
    return torch.tril(factor + std * size * noise.to(factor.device))


def learned_global_from_coefficients(a: float, b: float, c: float, eps: float = 1e-6) -> torch.Tensor:
    """2x2 lower factor for a + b s + c s^2 (needs a - eps >= 0, c >= 0 and b^2 <= 4 (a - eps) c)."""
    m00, m01, m11 = a - eps, b / 2.0, c
    l00 = math.sqrt(max(m00, 0.0))
    l10 = m01 / l00 if l00 > 0 else 0.0
    l11 = math.sqrt(max(m11 - l10 * l10, 0.0))
    return torch.tensor([[l00, 0.0], [l10, l11]])
