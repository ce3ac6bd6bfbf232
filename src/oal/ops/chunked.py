"""Chunked OAL: dense kernel inside each chunk, prefix state between chunks.

For chunk c with queries Q_c and the state S_{c-1} = sum_{j before c} psi(k_j)^T u_j:

    num_c = phi(Q_c) S_{c-1}  +  tril(kappa(Q_c, K_c)) U_c          (Eq. 5-6 across chunks, Eq. 7 inside)

The intra-chunk kernel uses z_m(i, j) = L_0m + scale * (q_i * w_m) . k_j with w_m[r] = L[g(r)+1, m], so
kappa = eps + sum_m z_m^2 costs (G+1) small GEMMs against the shared KV-head keys (no repeat of K/V).
Under autograd every chunk step is checkpointed: only the chunk inputs and the running state are kept,
and the d(d+1)/2-wide query features are recomputed in backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .kernel import key_features, query_features


def _chunk_step(state, q_c, k_c, u_c, a, b, c, lower, groups, eps: float, scale: float, causal: bool):
    bsz, n_q, n_c, d = q_c.shape
    n_kv = k_c.shape[1]
    rep = n_q // n_kv
    # inter-chunk: previous tokens through the state (Eq. 6)
    phi = query_features(q_c, a, b, c, scale).view(bsz, n_kv, rep * n_c, -1)
    num = phi @ state
    # intra-chunk: dense kernel (Eq. 7) grouped per KV head
    w = torch.gather(lower[:, 1:, :], 1, groups.long().unsqueeze(-1).expand(-1, -1, lower.shape[-1]))
    w = (w.transpose(1, 2) * scale).view(n_kv, rep, -1, 1, d)  # [Hkv, rep, G+1, 1, d]
    qw = q_c.view(bsz, n_kv, rep, 1, n_c, d) * w
    z = qw.reshape(bsz, n_kv, -1, d) @ k_c.transpose(-1, -2)  # [B, Hkv, rep*(G+1)*C, C]
    z = z.view(bsz, n_kv, rep, -1, n_c, n_c) + lower[:, 0, :].view(n_kv, rep, -1, 1, 1)
    kappa = eps + z.square().sum(dim=3)  # [B, Hkv, rep, C, C]
    if causal:
        kappa = torch.tril(kappa)
    num = num + (kappa.reshape(bsz, n_kv, rep * n_c, n_c) @ u_c)
    state = state + key_features(k_c).transpose(-1, -2) @ u_c  # Eq. 5
    return num.view(bsz, n_q, n_c, -1), state


def chunked_attention(q, k, v, groups, factor, coeffs, *, eps, scale, causal, state, chunk_size=64):
    """Returns (out, final_state). Inputs already validated and upcast; `state` is the initial state."""
    a, b, c = coeffs
    lower = torch.tril(factor)
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    n = q.shape[2]
    if not causal:
        # every key is visible: one state over all keys, then one readout (chunked over queries)
        state = state + key_features(k).transpose(-1, -2) @ u
        outs = []
        bsz, n_q = q.shape[:2]
        rep = n_q // k.shape[1]
        for start in range(0, n, chunk_size):
            phi = query_features(q[:, :, start : start + chunk_size], a, b, c, scale)
            m = phi.shape[2]
            outs.append((phi.view(bsz, n_q // rep, rep * m, -1) @ state).view(bsz, n_q, m, -1))
        num = torch.cat(outs, dim=2)
        return num[..., :-1] / num[..., -1:], state
    use_ckpt = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, factor, state))
    outs = []
    for start in range(0, n, chunk_size):
        sl = slice(start, start + chunk_size)
        args = (state, q[:, :, sl], k[:, :, sl], u[:, :, sl], a, b, c, lower, groups, eps, scale, causal)
        if use_ckpt:
            num, state = checkpoint(_chunk_step, *args, use_reentrant=False)
        else:
            num, state = _chunk_step(*args)
        outs.append(num)
    num = torch.cat(outs, dim=2)
    return num[..., :-1] / num[..., -1:], state
