"""OAL kernel parameters: factor L -> coefficients (a, b, C), feature maps and initialisations.

The kernel of one query head is (paper Eq. 7)

    kappa(q, k) = eps + |L^T s_bar|^2,   s_bar = [1, s_1, ..., s_G],   s_g = scale * sum_{r in g} q_r k_r,

which expands to a + sum_r b_r x_r + sum_{r,t} C_rt x_r x_t with x_r = scale q_r k_r (Eq. 3, Eq. 24).
Its separable form is phi(q) . psi(k) with key features psi(k) = [1, k, k_r k_t (r <= t)] shared by all
query heads of a KV head, and query features phi(q) that carry the per-head coefficients.
"""

from __future__ import annotations

import math
import threading
from functools import cache

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "cached_coefficients",
    "coefficients",
    "factor_to_matrix",
    "feature_dim",
    "features",
    "global_embedded_factor",
    "key_features",
    "packed_pairs",
    "pair_products",
    "perturbed_factor",
    "query_coefficients",
    "query_features",
    "taylor_factor",
    "weighted_features",
    "weighted_pairs",
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
        # normal tensors, also when first asked for in inference mode: autograd saves them later
        with torch.inference_mode(False):
            r, t = torch.triu_indices(d, d, device=device)
            mult = torch.where(r == t, 1.0, 2.0).to(device)
        _PAIR_CACHE[key] = (r, t, mult)
    return _PAIR_CACHE[key]


@cache
def row_maps(d: int, device: torch.device):
    """(ROWR, ROWT) int32 [F] of the decoding kernels (Triton's and the CPU's): row f of a packed state is x_r x_t,
    -1 standing for 1."""
    r, t, _ = packed_pairs(d, "cpu")
    lin = torch.arange(d)
    rowr = torch.cat([torch.tensor([-1]), lin, r])
    rowt = torch.cat([torch.tensor([-1]), torch.full((d,), -1), t])
    return rowr.to(device, torch.int32), rowt.to(device, torch.int32)


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


# factor tensor -> (eps, scale, mode), factor and groups as they were, (a, b, c), w: decoding calls the operator
# once per token with the same kernel; entries go when the factor tensor does
_COEFF_CACHE = WeakIdKeyDictionary()


def version(t: torch.Tensor) -> tuple[int, int]:
    """(version counter, address) of a tensor, what the caches keyed "by version" compare. Inference tensors have
    no counter (-1): they can only be written inside inference mode."""
    return (-1 if t.is_inference() else t._version), t.data_ptr()


def _unchanged(then: torch.Tensor, now: torch.Tensor) -> bool:
    # compared by value (the kernel is a few hundred numbers), so any write, `.data` ones included, invalidates
    return then.dtype == now.dtype and then.shape == now.shape and then.device == now.device and torch.equal(then, now)


def cached_coefficients(factor: torch.Tensor, groups: torch.Tensor, eps: float, scale: float, *,
                        by_version: bool = False, dtype: torch.dtype | None = None):
    """((a, b, c), w): `coefficients` and `query_coefficients`, built once and reused while factor, groups, eps and
    scale are unchanged. Where gradients must reach the factor (grad mode and factor.requires_grad) both are
    built fresh every call. `dtype`: built from the factor in this dtype (default: its own).

    `by_version` (devices where a read of a value stalls the host, `checks.deferred`): "unchanged" means the same
    tensors with the same version counters, not the same values; a write through `.data` bypasses the counter and
    is not seen there."""
    dtype = factor.dtype if dtype is None else dtype
    if torch.is_grad_enabled() and factor.requires_grad:
        coeffs = coefficients(factor.to(dtype), groups, eps)
        return coeffs, query_coefficients(*coeffs, scale)
    key = (float(eps), float(scale), torch.is_inference_mode_enabled(), dtype)
    if by_version:
        key += (version(factor), id(groups), version(groups))
    hit = _COEFF_CACHE.get(factor)
    if hit is not None and hit[0] == key and (
            by_version or (_unchanged(hit[1], factor) and _unchanged(hit[2], groups))):
        return hit[3], hit[4]
    with torch.no_grad():
        coeffs = coefficients(factor.to(dtype), groups, eps)
        w = query_coefficients(*coeffs, scale)
        # by version: keep groups itself (its id is in the key, so it must not be reused), never the factor (the key)
        kept = (None, groups) if by_version else (factor.detach().clone(), groups.detach().clone())
        _COEFF_CACHE[factor] = (key, *kept, coeffs, w)
    return coeffs, w


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


def query_coefficients(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale: float) -> torch.Tensor:
    """w [H, F] with phi(q) = w * psi(q): the per-head weights [a, scale b_r, scale^2 m_rt C_rt] (Eq. 6).

    m_rt is the multiplicity of the packed pair (1 on the diagonal, 2 off it), so that the packed sum over
    r <= t equals the full sum over r, t.
    """
    r, t, mult = packed_pairs(b.shape[-1], b.device)
    quad = c[:, r, t] * mult.to(c.dtype) * (scale * scale)
    return torch.cat([a[:, None].to(b.dtype), b * scale, quad], dim=1)


def query_features(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scale: float, out=None,
                   weights: torch.Tensor | None = None):
    """phi(q) [..., H, N, F] for q [..., H, N, d] with per-head coefficients (Eq. 6, packed symmetric).

    `out`: a buffer to fill (inference only; under autograd a new tensor is built). `weights`: the
    `query_coefficients(a, b, c, scale)` already built (`cached_coefficients`).
    """
    w = query_coefficients(a, b, c, scale) if weights is None else weights
    w = w[:, None, :].to(q.dtype)  # [H, 1, F]
    if torch.is_grad_enabled() and (q.requires_grad or w.requires_grad):
        return key_features(q) * w
    return key_features(q, out=out).mul_(w)


def key_features(k: torch.Tensor, out=None) -> torch.Tensor:
    """psi(k) [..., N, F] = [1, k, k_r k_t (r <= t)]: the keys' side of the state update (Eq. 5)."""
    return features(k, dim=-1, out=out)


def features(x: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None, plan: bool = False) -> torch.Tensor:
    """psi(x) = [1, x, x_r x_t (r <= t)] built along `dim` (of size d; the result has F there).

    Along the last dim (token-major) the pair products come from `pair_products`. Along an outer dim
    (feature-major) every pair block x_r * x[r:] is one long contiguous stretch, the cheapest layout to build,
    which the GEMMs then read without a copy. With `out` (inference) the result is written in place; x may
    already be the view out.narrow(dim, 1, d), and is then not copied. `plan`: x and out are buffers that live on
    (the chunked operator's scratch), so their views are cached (`_plan`).
    """
    dim = dim % x.dim()
    d = x.shape[dim]
    last = dim == x.dim() - 1
    if torch.is_grad_enabled() and x.requires_grad:
        ones = torch.ones_like(x.narrow(dim, 0, 1))
        if last:
            return torch.cat([ones, x, pair_products(x)], dim=dim)
        pairs = [x.narrow(dim, r, 1) * x.narrow(dim, r, d - r) for r in range(d)]
        return torch.cat([ones, x, *pairs], dim=dim)
    if out is None:
        shape = list(x.shape)
        shape[dim] = feature_dim(d)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    out.narrow(dim, 0, 1).fill_(1.0)
    lin = out.narrow(dim, 1, d)
    if lin.data_ptr() != x.data_ptr() or lin.stride() != x.stride():
        lin.copy_(x)
    if last:
        pair_products(x, out.narrow(dim, 1 + d, d * (d + 1) // 2))
        return out
    for x_r, x_rest, out_r in _plan(_pair_views, x, out, dim=dim, cache=plan):
        torch.mul(x_r, x_rest, out=out_r)
    return out


def weighted_features(x: torch.Tensor, w: torch.Tensor, dim: int, out: torch.Tensor, tmp: torch.Tensor | None = None,
                      plan: bool = False):
    """w * psi(x) along an outer `dim` of x, written into `out` in one pass (inference; x is not a view of out).

    The reference is `features(x, dim) * w` (w broadcasts against out, F at `dim`). Pair block r is built as
    (x[r:] * w_r) * x_r: the small product stays in cache (`tmp`, x's shape, optional), and the F-wide result is
    written once instead of written and then scaled in place, which was a second full pass over it. `plan`: as in
    `features`, for x, w, out and tmp.
    """
    dim = dim % x.dim()
    d = x.shape[dim]
    wdim = dim - (out.dim() - w.dim())  # the feature dim of w, aligned from the right
    tmp = torch.empty(x.shape, dtype=out.dtype, device=x.device) if tmp is None else tmp
    head = out.narrow(dim, 0, 1)
    head.copy_(w.narrow(wdim, 0, 1).expand_as(head))
    torch.mul(x, w.narrow(wdim, 1, d), out=out.narrow(dim, 1, d))
    pairs = out.shape[dim] - 1 - d
    weighted_pairs(x, w.narrow(wdim, 1 + d, pairs), dim, out.narrow(dim, 1 + d, pairs), tmp, plan)
    return out


def weighted_pairs(x: torch.Tensor, w: torch.Tensor, dim: int, out: torch.Tensor, tmp: torch.Tensor | None = None,
                   plan: bool = False):
    """The pair rows of `weighted_features` alone: w_rt x_r x_t (r <= t, packed order) along `dim`, into `out`
    (d(d+1)/2 there; w holds the pair weights only)."""
    dim = dim % x.dim()
    tmp = torch.empty(x.shape, dtype=out.dtype, device=x.device) if tmp is None else tmp
    for x_rest, w_r, tmp_r, x_r, out_r in _plan(_weighted_pair_views, x, w, tmp, out, dim=dim, cache=plan):
        torch.mul(torch.mul(x_rest, w_r, out=tmp_r), x_r, out=out_r)
    return out


def _pair_views(x, out, dim):
    """Per pair block r of `features`: (x_r, x[r:], out's stretch of the block), all along `dim`."""
    d, start, views = x.shape[dim], 1 + x.shape[dim], []
    for r in range(d):
        views.append((x.narrow(dim, r, 1), x.narrow(dim, r, d - r), out.narrow(dim, start, d - r)))
        start += d - r
    return views


def _weighted_pair_views(x, w, tmp, out, dim):
    """Per pair block r of `weighted_pairs`: (x[r:], w's stretch, tmp, x_r, out's stretch)."""
    d, start, views = x.shape[dim], 0, []
    wdim = dim - (out.dim() - w.dim())
    for r in range(d):
        views.append((x.narrow(dim, r, d - r), w.narrow(wdim, start, d - r), tmp.narrow(dim, 0, d - r),
                      x.narrow(dim, r, 1), out.narrow(dim, start, d - r)))
        start += d - r
    return views


def clear_plans() -> None:
    """Forget the cached views (and with them the buffers they hold)."""
    with _PLANS_LOCK:
        _PLANS.clear()


_PLANS: dict = {}  # (builder, tensors' addresses and layouts, dim) -> the views of `_pair_views` and kin
_PLANS_MAX = 32
_PLANS_LOCK = threading.Lock()


def _plan(build, *tensors, dim: int, cache: bool):
    """`build(*tensors, dim)`, cached (with `cache`) by the tensors' addresses, shapes, strides and dtypes.

    The chunked operator calls the feature maps with the same scratch buffers block after block and call after
    call; building the d views of every pair block again each time was a seventh of its time (tens of thousands
    of narrow/slice dispatches per 16k-token call). A cached plan holds its tensors, so an address in a key
    cannot be reused by another tensor while the plan lives; the oldest plans go first, and `clear_plans()` drops
    them all (the operator calls it when it replaces or releases a scratch buffer)."""
    if not cache:
        return build(*tensors, dim)
    key = (build, dim, *((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for t in tensors))
    views = _PLANS.get(key)
    if views is None:
        views = build(*tensors, dim)
        with _PLANS_LOCK:  # the operator's workers build plans concurrently
            while len(_PLANS) >= _PLANS_MAX:
                del _PLANS[next(iter(_PLANS))]
            _PLANS[key] = views
    return views


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
