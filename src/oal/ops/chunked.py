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

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .kernel import feature_dim, key_features, query_features

# Tests set this to fill scratch buffers with NaN, so that a read of an unwritten entry shows up.
NAN_SCRATCH = False


def _scratch(ws: dict | None, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor | None:
    """A reusable buffer of `shape` (inference only: ws is None under autograd).

    Reusing the blocks' large temporaries avoids fresh allocations, whose first-touch page faults cost about as
    much as filling them.
    """
    if ws is None:
        return None
    n = math.prod(shape)
    buf = ws.get(name)
    if buf is None or buf.numel() < n:
        fill = float("nan") if NAN_SCRATCH else 0.0
        buf = ws[name] = torch.full((n,), fill, dtype=like.dtype, device=like.device)
    return buf[:n].view(shape)


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[2] == n else F.pad(x, (0, 0, 0, n - x.shape[2]))


def _block_step(
    state, q, k, u, a, b, c, lower, groups, eps: float, scale: float, chunk: int, fresh: bool, need_state: bool,
    ws: dict | None = None,
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
        psi = key_features(kb, out=_scratch(ws, "psi", (bsz, n_c, n_kv, chunk, feature_dim(d)), q))
        d_state = psi.transpose(-1, -2) @ ub  # [B, nc, Hkv, F, dv+1]
        incl = torch.cumsum(d_state, dim=1) + state.unsqueeze(1)
        prev = torch.cat([state.unsqueeze(1), incl[:, :-1]], dim=1)
        final = incl[:, -1]
    if not fresh:  # inter-chunk readout (Eq. 6)
        phi = query_features(qb, a, b, c, scale, out=_scratch(ws, "phi", (bsz, n_c, n_q, chunk, feature_dim(d)), q))
        num = phi.view(bsz, n_c, n_kv, rep * chunk, -1) @ prev  # [B, nc, Hkv, rep*C, dv+1]
    # intra-chunk dense kernel (Eq. 7), GQA by grouping query heads per KV head
    w = torch.gather(lower[:, 1:, :], 1, groups.long().unsqueeze(-1).expand(-1, -1, lower.shape[-1]))
    w = w.transpose(1, 2) * scale  # [Hq, G+1, d]
    n_m = w.shape[1]
    if ws is None:  # autograd: out-of-place
        qw = qb.unsqueeze(3) * w.unsqueeze(-2)  # [B, nc, Hq, G+1, C, d]
        z = qw.reshape(bsz, n_c, n_kv, -1, d) @ kb.transpose(-1, -2)  # [B, nc, Hkv, rep*(G+1)*C, C]
        sq = (z.view(bsz, n_c, n_q, n_m, chunk, chunk) + lower[:, 0, :, None, None]).square()
    else:  # inference: the same in reused buffers
        qw = torch.mul(qb.unsqueeze(3), w.unsqueeze(-2), out=_scratch(ws, "qw", (bsz, n_c, n_q, n_m, chunk, d), q))
        z = torch.matmul(qw.view(bsz, n_c, n_kv, -1, d), kb.transpose(-1, -2),
                         out=_scratch(ws, "z", (bsz, n_c, n_kv, rep * n_m * chunk, chunk), q))
        sq = z.view(bsz, n_c, n_q, n_m, chunk, chunk).add_(lower[:, 0, :, None, None]).square_()
    kappa = torch.tril(eps + sq.sum(dim=3))  # [B, nc, Hq, C, C]
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
    ws = None if use_ckpt else {}  # scratch buffers shared by the blocks (inference only)
    outs = []
    for start in range(0, n, block):
        sl = slice(start, start + block)
        args = (state, q[:, :, sl], k[:, :, sl], u[:, :, sl], a, b, c, lower, groups, eps, scale, chunk_size)
        args += (fresh, need_state)
        if use_ckpt:
            num, state = checkpoint(_block_step, *args, use_reentrant=False)
        else:
            num, state = _block_step(*args, ws=ws)
        outs.append(num)
    num = torch.cat(outs, dim=2)
    return num[..., :-1] / num[..., -1:], state
