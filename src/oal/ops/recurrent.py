"""Token-by-token OAL: Algorithm 1 with H0/H1/H2 packed symmetric in one state (App. D).

State of one KV head: rows [H0 (1); H1 (d); H2 (d(d+1)/2)] x (dv + 1) columns, the last column being the
denominator. Query heads sharing a KV head read the same state with their own coefficients.

On the CPU, for an fp32 state without autograd, the causal loop runs the fused C step (`cpu_kernel.decode`: one
pass over the state per call); the torch loop below is its reference and runs everywhere else.
"""

from __future__ import annotations

import torch

from oal.ops import cpu_kernel
from oal.ops.kernel import key_features, query_coefficients, query_features


def _update(state, k_t, v_t, inplace: bool = False):
    """state + psi(k_t)^T [v_t; 1] (Eq. 5, lines 7-9 of Algorithm 1) in one pass over the state.

    `inplace`: written into `state` itself (the generation cache's own state, `checks.updatable`): a new state was
    a copy of the whole state per token, a third of a decoding step."""
    u_t = torch.cat([v_t, torch.ones_like(v_t[..., :1])], dim=-1)
    psi = key_features(k_t).transpose(-1, -2)  # [B, Hkv, F, 1]
    flat = state.flatten(0, 1)
    if inplace and flat.data_ptr() == state.data_ptr():  # flatten is a view: the update lands in the state
        flat.baddbmm_(psi.flatten(0, 1), u_t.flatten(0, 1))
        return state
    return torch.baddbmm(flat, psi.flatten(0, 1), u_t.flatten(0, 1)).view_as(state)


def recurrent_step(state, q_t, k_t, v_t, coeffs, scale, weights=None, inplace: bool = False):
    """One token: update the state with (k_t, v_t), then read out for q_t. Shapes [B, H, 1, *].

    `weights`: the query coefficients already built from `coeffs` (`kernel.cached_coefficients`), or None."""
    a, b, c = coeffs
    rep = q_t.shape[1] // k_t.shape[1]
    state = _update(state, k_t, v_t, inplace)
    phi = query_features(q_t, a, b, c, scale, weights=weights)  # [B, Hq, 1, F]
    bsz, n_q = phi.shape[:2]
    phi = phi.view(bsz, n_q // rep, rep, phi.shape[-1])
    num = phi @ state  # Eq. 6: [B, Hkv, rep, dv+1]
    return state, num.view(bsz, n_q, 1, -1)


def recurrent_attention(q, k, v, coeffs, *, scale, causal, state, weights=None, inplace: bool = False):
    """Causal: loop over tokens. Non-causal: accumulate all keys first, then read out every query.

    `inplace`: update `state` itself (causal; see `_update`)."""
    outs = []
    if causal and cpu_kernel.decodes(state, q, k, v, *coeffs):
        state = state if inplace else state.clone()
        w = weights if weights is not None else query_coefficients(*coeffs, scale)
        num = cpu_kernel.decode(k, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), q, w, state)
        return num[..., :-1] / num[..., -1:], state
    if causal:
        for i in range(q.shape[2]):
            sl = slice(i, i + 1)
            state, num = recurrent_step(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], coeffs, scale, weights,
                                        inplace)
            outs.append(num)
        num = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    else:
        for i in range(k.shape[2]):
            state = _update(state, k[:, :, i : i + 1], v[:, :, i : i + 1])
        a, b, c = coeffs
        rep = q.shape[1] // k.shape[1]
        phi = query_features(q, a, b, c, scale, weights=weights)
        bsz, n_q, n, f = phi.shape
        num = (phi.view(bsz, n_q // rep, rep * n, f) @ state).view(bsz, n_q, n, -1)
    return num[..., :-1] / num[..., -1:], state
