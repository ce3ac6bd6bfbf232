"""Dense O(N^2) OAL attention: the oracle every other backend is tested against.

Evaluates Eq. 7 literally, kappa_ij = eps + |L^T s_bar_ij|^2, one query head at a time.
"""

from __future__ import annotations

import torch

from oal.ops.kernel import key_features, query_features


def group_onehot(groups: torch.Tensor, n_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[H, d, G] indicator of each dimension's group."""
    return torch.nn.functional.one_hot(groups.long(), n_groups).to(dtype)


def dense_kernel(q, k, groups, factor, *, eps: float, scale: float) -> torch.Tensor:
    """kappa [B, Hq, N, M] = eps + |L^T s_bar|^2 for q [B, Hq, N, d] and k [B, Hkv, M, d] (Eq. 7)."""
    n_q, n_kv = q.shape[1], k.shape[1]
    onehot = group_onehot(groups, factor.shape[-1] - 1, q.dtype)
    lower = torch.tril(factor)
    out = []
    for h in range(n_q):  # one head at a time keeps memory at N*M*G
        # s_ijg = sum over r in group g of q_ir k_jr, as G matmuls (one three-way einsum is ~6x slower at N 700)
        per_group = torch.einsum("bir,rg->bgir", q[:, h] * scale, onehot[h])
        s = (per_group @ k[:, h // (n_q // n_kv)].unsqueeze(1).transpose(-1, -2)).movedim(1, -1)
        s_bar = torch.cat([torch.ones_like(s[..., :1]), s], dim=-1)
        out.append(eps + (s_bar @ lower[h]).pow(2).sum(-1))
    return torch.stack(out, dim=1)


def reference_attention(q, k, v, groups, factor, *, eps, scale, causal, initial_state, coeffs, want_state):
    """Dense evaluation; returns (out, final_state or None). Inputs already validated and upcast."""
    n_q, n_kv = q.shape[1], k.shape[1]
    rep = n_q // n_kv
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # u_j = [v_j; 1]
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        mask = torch.tril(mask)
    outs = []
    for h in range(n_q):
        kv = h // rep
        kappa = dense_kernel(
            q[:, h : h + 1], k[:, kv : kv + 1], groups[h : h + 1], factor[h : h + 1], eps=eps, scale=scale
        )[:, 0]
        num = kappa.masked_fill(~mask, 0.0) @ u[:, kv]
        if initial_state is not None:  # earlier tokens through the state (Eq. 6)
            a, b, c = coeffs
            phi = query_features(q[:, h : h + 1], a[h : h + 1], b[h : h + 1], c[h : h + 1], scale)
            num = num + phi[:, 0] @ initial_state[:, h // rep]
        outs.append(num)
    num = torch.stack(outs, dim=1)
    out = num[..., :-1] / num[..., -1:]
    final = None
    if want_state:
        final = key_features(k).transpose(-1, -2) @ u
        if initial_state is not None:
            final = final + initial_state
    return out, final
