"""Causal linear attention over positive feature maps, shared by Performer, SpectraFormer and DiJiang.

out_i = phi(q_i) . sum_{j<=i} psi(k_j) [v_j; 1]  /  last column,   evaluated chunk by chunk:
inside a chunk the C x C feature products are masked densely, across chunks a prefix state
S = sum_j psi(k_j)^T [v_j; 1]  ([m, dv+1] per head) carries the past. Memory per chunk is O(C^2 + m dv).

Key features may be given as *log*-features (Performer). Each key j is exponentiated after subtracting its
own max over features t_j (its top feature is 1), and query i's weights carry exp(t_j - M_i), where M_i is the
running max of t over the keys i sees (j <= i, the carried state's shift included): a factor exp(-M_i) shared by
every key of query i, which cancels in the normalised ratio (sum_j w_j c v_j / sum_j w_j c = sum_j w_j v_j /
sum_j w_j), so the result is exact. No key after i enters i's shift, not even one later in i's chunk (one shift
per chunk let such a key underflow every earlier key's weight: rows of 0). The state is kept at the shift of the
keys it holds and rescaled when that grows. Added work per chunk: C x C factors beside the C x C x m products.

GQA: query features are [B, Hq, N, m]; key features are either shared per KV head [B, Hkv, N, m] or per
query head [B, Hq, N, m] (methods whose key map depends on the query head). Values are never repeated.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from oal.methods._common import check_qkv
from oal.methods.base import AttentionMethod

__all__ = ["FeatureMapMethod", "dense_feature_kernel", "feature_attention"]


def _group(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, H, N, m] -> [B, Hkv, H // Hkv, N, m] (H = Hkv gives a broadcast axis of size 1)."""
    b, h, n, m = x.shape
    return x.reshape(b, n_kv, h // n_kv, n, m)


def dense_feature_kernel(fq: torch.Tensor, fk: torch.Tensor) -> torch.Tensor:
    """Weights [B, Hq, N, M] = fq . fk for fq [B, Hq, N, m] and fk [B, Hkv or Hq, M, m]."""
    n_kv = fk.shape[1]
    w = _group(fq, n_kv) @ _group(fk, n_kv).transpose(-1, -2)
    return w.reshape(fq.shape[0], fq.shape[1], fq.shape[2], fk.shape[2])


def _causal_log_chunk(q_c, k_c, u_c, state, shift):
    """One causal chunk with key log-features k_c [.., C, m]: (rows [.., C, dv+1], state, shift), the state and
    its shift [.., 1, 1] carried in and out. Shifts are detached: they cancel exactly (module doc)."""
    top = k_c.detach().amax(-1, keepdim=True)  # [.., C, 1] t_j, each key's max over features
    run = torch.maximum(shift, top.cummax(-2).values)  # M_i: over the keys query i sees, never a later one
    k_c = torch.exp(k_c - top)
    rel = (top.transpose(-1, -2) - run).clamp_max(0).exp()  # [.., C, C] exp(t_j - M_i); the clamp only hits j > i
    w = ((q_c @ k_c.transpose(-1, -2)) * rel).tril()
    rows = (q_c @ state) * torch.exp(shift - run) + w @ u_c
    new = run[..., -1:, :]  # the chunk's last query sees every key the state will hold
    state = state * torch.exp(shift - new) + k_c.transpose(-1, -2) @ (u_c * torch.exp(top - new))
    return rows, state, new


def feature_attention(fq, fk, v, *, causal: bool = True, log_keys: bool = False, chunk_size: int = 64,
                      initial_state=None, output_final_state: bool = False):
    """Normalised linear attention; returns out [B, Hq, N, dv] (and the final state if asked).

    fq [B, Hq, N, m] > 0; fk [B, Hk, N, m] (Hk = Hkv or Hq), positive features or, with `log_keys`,
    log-features; v [B, Hkv, N, dv]. The state is [B, Hk, m, dv + 1] (last column: denominator), with one
    extra row [.., m, 0] holding the running log-shift when `log_keys`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    bsz, n_q, n, m = fq.shape
    n_kv, dv = v.shape[1], v.shape[-1]
    hk = fk.shape[1]
    if hk not in (n_kv, n_q) or fk.shape[2] != n or fk.shape[3] != m:
        raise ValueError(f"fk: expected [{bsz}, {n_kv} or {n_q}, {n}, {m}], got {tuple(fk.shape)}")
    q5 = _group(fq, n_kv)  # [B, Hkv, r, N, m]
    k5 = _group(fk, n_kv)  # [B, Hkv, 1 or r, N, m]
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).to(fq.dtype).unsqueeze(2)  # [B, Hkv, 1, N, dv+1]
    r_k = k5.shape[2]
    if initial_state is not None:
        want = (bsz, hk, m + int(log_keys), dv + 1)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected shape {list(want)}, got {tuple(initial_state.shape)}")
        st = _group(initial_state.to(fq.dtype), n_kv)
        state, shift = st[..., :m, :], (st[..., m:, :1] if log_keys else None)
    else:
        state = fq.new_zeros(bsz, n_kv, r_k, m, dv + 1)
        shift = fq.new_full((bsz, n_kv, r_k, 1, 1), -torch.inf) if log_keys else None
    outs = []
    step = chunk_size if causal else max(n, 1)
    for c0 in range(0, n, step):
        q_c, k_c, u_c = q5[..., c0:c0 + step, :], k5[..., c0:c0 + step, :], u[..., c0:c0 + step, :]
        if log_keys and causal:
            y_c, state, shift = _causal_log_chunk(q_c, k_c, u_c, state, shift)
            outs.append(y_c)
        elif causal:
            w = (q_c @ k_c.transpose(-1, -2)).tril()  # intra-chunk, j <= i
            outs.append(q_c @ state + w @ u_c)
            state = state + k_c.transpose(-1, -2) @ u_c
        else:
            if log_keys:  # one chunk, every key visible to every query: one shift for all
                new = torch.maximum(shift, k_c.detach().amax(dim=(-2, -1), keepdim=True))
                state = state * torch.exp(shift - new)
                k_c, shift = torch.exp(k_c - new), new
            state = state + k_c.transpose(-1, -2) @ u_c
    if not causal:
        outs = [q5 @ state]
    if n == 0:
        outs = [q5.new_zeros(bsz, n_kv, q5.shape[2], 0, dv + 1)]
    y = torch.cat(outs, dim=-2)
    den = y[..., -1:].clamp_min(torch.finfo(y.dtype).tiny)  # guards 0/0 from full underflow only
    out = (y[..., :-1] / den).reshape(bsz, n_q, n, dv)
    if not output_final_state:
        return out
    if log_keys:
        state = torch.cat([state, torch.nn.functional.pad(shift.expand(*shift.shape[:-1], 1), (0, dv))], dim=-2)
    return out, state.reshape(bsz, hk, state.shape[-2], dv + 1)


class FeatureMapMethod(AttentionMethod):
    """A method whose kernel is fq . fk: subclasses implement `_features(q, k) -> (fq, fk)` and set `chunk_size`."""

    supports_state = True
    log_keys: ClassVar[bool] = False  # `_features` returns key log-features (see `feature_attention`)

    def _features(self, q, k):
        raise NotImplementedError

    def dense_kernel(self, q, k):
        check_qkv(self, q, k)
        return dense_feature_kernel(*self._features(q, k))

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        check_qkv(self, q, k, v)
        fq, fk = self._features(q, k)
        res = feature_attention(fq, fk, v, causal=causal, log_keys=self.log_keys, chunk_size=self.chunk_size,
                                initial_state=initial_state, output_final_state=output_final_state)
        if output_final_state:
            return res[0].to(v.dtype), res[1]
        return res.to(v.dtype)
