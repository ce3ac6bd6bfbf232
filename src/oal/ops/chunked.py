"""Chunked OAL: dense kernel inside each chunk, prefix state between chunks.

For chunk c with queries Q_c and the state S_{c-1} = sum_{j before c} psi(k_j)^T u_j:

    num_c = phi(Q_c) S_{c-1}  +  tril(kappa(Q_c, K_c)) U_c          (Eq. 5-6 across chunks, Eq. 7 inside)

The intra-chunk kernel uses z_m(i, j) = L_0m + scale * (q_i * w_m) . k_j with w_m[r] = L[g(r)+1, m], so
kappa = eps + sum_m z_m^2 costs (G+1) small GEMMs against the shared KV-head keys (no repeat of K/V).
Chunks are processed a block at a time: the per-chunk state increments of a block are one batched GEMM and a
cumulative sum, so Python overhead is per block, not per chunk. Under autograd every block is checkpointed:
only the block inputs and the running state are kept, and the d(d+1)/2-wide features are recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .kernel import key_features, query_features


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[2] == n else F.pad(x, (0, 0, 0, n - x.shape[2]))


def _block_step(
    state, q, k, u, a, b, c, lower, groups, eps: float, scale: float, chunk: int, fresh: bool, need_state: bool
):
    """Causal OAL over one block of tokens. Returns (numerator [B, Hq, n, dv+1], state after the block).

    `fresh`: the block is one chunk starting from a zero state, so the state readout is skipped; then the final
    state is only built when `need_state`.
    """
    bsz, n_q, n, d = q.shape
    n_kv, dv1 = k.shape[1], u.shape[-1]
    chunk = min(chunk, n)  # a short call (decoding) is one chunk of its own length, no padding
    rep, n_c = n_q // n_kv, -(-n // chunk)
    # zero padding: padded keys have u = 0 (no value, no denominator), padded query rows are dropped
    q, k, u = (_pad_to(t, n_c * chunk) for t in (q, k, u))
    qb = q.view(bsz, n_q, n_c, chunk, d).transpose(1, 2).contiguous()  # [B, nc, Hq, C, d]
    kb = k.view(bsz, n_kv, n_c, chunk, d).transpose(1, 2)  # [B, nc, Hkv, C, d]
    ub = u.view(bsz, n_kv, n_c, chunk, dv1).transpose(1, 2)
    num, final = 0.0, None
    if not fresh or need_state:
        # state before each chunk: exclusive prefix sum of the chunks' increments (Eq. 5)
        d_state = key_features(kb).transpose(-1, -2) @ ub  # [B, nc, Hkv, F, dv+1]
        incl = torch.cumsum(d_state, dim=1) + state.unsqueeze(1)
        prev = torch.cat([state.unsqueeze(1), incl[:, :-1]], dim=1)
        final = incl[:, -1]
    if not fresh:  # inter-chunk readout (Eq. 6)
        phi = query_features(qb, a, b, c, scale)  # [B, nc, Hq, C, F]
        num = phi.view(bsz, n_c, n_kv, rep * chunk, -1) @ prev  # [B, nc, Hkv, rep*C, dv+1]
    # intra-chunk dense kernel (Eq. 7), GQA by grouping query heads per KV head
    w = torch.gather(lower[:, 1:, :], 1, groups.long().unsqueeze(-1).expand(-1, -1, lower.shape[-1]))
    w = w.transpose(1, 2) * scale  # [Hq, G+1, d]
    qw = qb.unsqueeze(3) * w.unsqueeze(-2)  # [B, nc, Hq, G+1, C, d]
    z = qw.reshape(bsz, n_c, n_kv, -1, d) @ kb.transpose(-1, -2)  # [B, nc, Hkv, rep*(G+1)*C, C]
    z = z.view(bsz, n_c, n_q, -1, chunk, chunk) + lower[:, 0, :, None, None]
    kappa = torch.tril(eps + z.square().sum(dim=3))  # [B, nc, Hq, C, C]
    num = num + kappa.view(bsz, n_c, n_kv, rep * chunk, chunk) @ ub
    num = num.view(bsz, n_c, n_q, chunk, dv1).transpose(1, 2).reshape(bsz, n_q, n_c * chunk, dv1)
    return num[:, :, :n], final


# Below this length, a sequence with no initial state is one dense chunk: cheaper than building the
# d(d+1)/2-wide query features, and still O(N) memory per query row.
DENSE_MAX = 256


def chunked_attention(
    q, k, v, groups, factor, coeffs, *, eps, scale, causal, state, state_is_zero=False, need_state=True,
    chunk_size=64, block_chunks=8,
):
    """Returns (out, final_state). Inputs already validated and upcast; `state` is the initial state."""
    a, b, c = coeffs
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    bsz, n_q, n, _ = q.shape
    rep = n_q // k.shape[1]
    block = chunk_size * block_chunks
    if not causal:
        # every key is visible: one state over all keys, then one readout per block of queries
        state = state + key_features(k).transpose(-1, -2) @ u
        outs = []
        for start in range(0, n, block):
            phi = query_features(q[:, :, start : start + block], a, b, c, scale)
            m = phi.shape[2]
            outs.append((phi.view(bsz, n_q // rep, rep * m, -1) @ state).view(bsz, n_q, m, -1))
        num = torch.cat(outs, dim=2)
        return num[..., :-1] / num[..., -1:], state
    lower = torch.tril(factor)
    use_ckpt = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, factor, state))
    fresh = state_is_zero and n <= DENSE_MAX
    if fresh:
        chunk_size = block = n
    outs = []
    for start in range(0, n, block):
        sl = slice(start, start + block)
        args = (state, q[:, :, sl], k[:, :, sl], u[:, :, sl], a, b, c, lower, groups, eps, scale, chunk_size)
        args += (fresh, need_state)
        if use_ckpt:
            num, state = checkpoint(_block_step, *args, use_reentrant=False)
        else:
            num, state = _block_step(*args)
        outs.append(num)
    num = torch.cat(outs, dim=2)
    return num[..., :-1] / num[..., -1:], state
