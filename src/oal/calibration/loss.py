"""The loss of calibration (Eq. 20): a method's normalised causal output at sampled query positions, and its
per-head validation MSE, both against the frozen softmax output.

The OAL family (oal, global, and the sliding-window hybrids oal-swa, global-swa) is evaluated in one batched Eq. 7
for all heads and all stacked initialisations (`_oal_dense_kernel`; `method.dense_kernel`, one head at a time, is
the reference); every other method through its own `dense_kernel`. A sliding window's weights depend on where each
query sits, so the sampled positions go with the queries.
"""

from __future__ import annotations

import math

import torch

from oal.calibration.data import LayerData
from oal.methods.base import AttentionMethod, repeat_kv

__all__ = ["sampled_dense_output"]


def _is_oal(method) -> bool:
    return method.name in ("oal", "global") and hasattr(method, "factor") and hasattr(method, "groups")


def _is_window_oal(method) -> bool:
    """oal-swa and global-swa: a sliding window with OAL's kernel on the older keys."""
    return method.positional and hasattr(method, "factor") and hasattr(method, "groups")


def _group_scores(groups, n_groups: int, q, k):
    """s_bar [B, H, G+1, n, M] = [1, s_1, ..., s_G], s_g = scale * sum_{r in g} q_r k_r (the vector in Eq. 7)."""
    bsz, heads, n, d = q.shape
    onehot = torch.nn.functional.one_hot(groups.long(), n_groups).to(q.dtype).transpose(1, 2)  # [H, G, d]
    kr = repeat_kv(k, heads // k.shape[1])  # [B, H, M, d]
    qg = (q.unsqueeze(2) * onehot[None, :, :, None, :] / math.sqrt(d)).reshape(bsz, heads, n_groups * n, d)
    s = (qg @ kr.transpose(-1, -2)).view(bsz, heads, n_groups, n, -1)  # one GEMM per head, no broadcast copy
    return torch.cat([torch.ones_like(s[:, :, :1]), s], dim=2)


def _oal_dense_kernel(method, q, k, n_copies: int = 1):
    """Vectorised Eq. 7 for OAL-family methods: kappa = eps + |L^T s_bar|^2 for all heads at once.

    `method` may hold `n_copies` stacked copies (initialisations) of the H heads of q with the same groups: s_bar
    is computed once per head and shared, only the cheap (G+1)^2 map L^T differs. Returns [B, I*H, n, M].
    `method.dense_kernel` (one head at a time) is the reference.
    """
    bsz, heads, n = q.shape[:3]
    g1 = method.factor.shape[-1]
    lower = torch.tril(method.factor).to(q.dtype).view(n_copies, heads, g1, g1)
    s_bar = _group_scores(method.groups[:heads], g1 - 1, q, k)  # [B, H, G+1, n, M]
    m = s_bar.shape[-1]
    # all copies' L^T stacked per head, so one matmul per head and no broadcast copy of s_bar
    lt = lower.transpose(-1, -2).permute(1, 0, 2, 3).reshape(heads, n_copies * g1, g1)  # [H, I*(G+1), G+1]
    z = (lt @ s_bar.reshape(bsz, heads, g1, n * m)).view(bsz, heads, n_copies, g1, n * m)  # L^T s_bar
    kappa = method.eps + (z * z).sum(3)  # [B, H, I, n*M]
    return kappa.transpose(1, 2).reshape(bsz, n_copies * heads, n, m)


def _window_oal_weights(method, q, k, positions, n_copies: int):
    """oal-swa / global-swa weights [B, I*H, n, M] at query `positions`: e^s on each query's window and sinks, Eq. 7
    on its other older keys from `_oal_dense_kernel` (s_bar shared by the I copies), as `method.dense_kernel` gives
    them (the per-row shift by the largest log-weight cancels in the normaliser)."""
    from oal.ops.window import window_log_weights

    log_kappa = _oal_dense_kernel(method, q, k, n_copies).log()
    logw = window_log_weights(q.repeat(1, n_copies, 1, 1), k.repeat(1, n_copies, 1, 1), positions,
                              window=method.window, sinks=method.sinks, scale=1.0 / math.sqrt(q.shape[-1]),
                              log_kappa=log_kappa)
    return torch.exp(logw - logw.amax(-1, keepdim=True))


def sampled_dense_output(method: AttentionMethod, q, k, v, positions: torch.Tensor, n_copies: int = 1, *,
                         causal: bool = True, key_mask: torch.Tensor | None = None):
    """Normalised causal output at query `positions` [n] only: q [B, H, N, d] -> [B, I*H, n, dv].

    Each selected query i attends keys j <= i of the causal prefix; no N x N matrix is formed. With
    `n_copies` = I > 1 the method holds I stacked copies of the H heads (one per initialisation).
    `causal=False` (encoders): every key is visible; `key_mask` [B, N] (True = real token) drops padded keys.
    """
    m = int(positions.max()) + 1 if causal else k.shape[2]
    qs, ks = q[:, :, positions], k[:, :, :m]
    if method.positional and not causal:
        raise ValueError(f"method: {method.name!r} is causal only (a sliding window); the data is non-causal")
    if causal:
        mask = torch.arange(m, device=q.device)[None, :] <= positions[:, None]
    else:
        mask = torch.ones(1, m, dtype=torch.bool, device=q.device)
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :m].bool()  # [B, 1, n, m]
    if _is_oal(method):
        w = _oal_dense_kernel(method, qs, ks, n_copies)
    elif _is_window_oal(method):
        w = _window_oal_weights(method, qs, ks, positions, n_copies)
    else:  # masked before any shift over keys; a sliding window's weights depend on where each query sits
        where = {"positions": positions} if method.positional else {}
        w = method.masked_kernel(qs.repeat(1, n_copies, 1, 1), ks.repeat(1, n_copies, 1, 1), mask, **where)
    w = w.masked_fill(~mask, 0.0).to(v.dtype)
    bsz, heads, n = qs.shape[:3]
    vr = repeat_kv(v[:, :, :m], heads // v.shape[1]).unsqueeze(1)  # [B, 1, H, m, dv]
    out = (w.view(bsz, n_copies, heads, n, m) @ vr) / w.view(bsz, n_copies, heads, n, m).sum(-1, keepdim=True)
    return out.reshape(bsz, n_copies * heads, n, -1)


def _val_mse(method, data: LayerData, n_copies: int = 1, query_chunk: int = 256) -> torch.Tensor:
    """Per-head validation MSE [I*H] of the causal output on all positions of all validation sequences.

    OAL-family methods (with or without a sliding window) use the dense kernel when it is cheaper than the linear
    path (N*G*d < F*(dv+1), F the state rows); otherwise (and for every other method) the method's own linear-time
    forward runs. Non-causal or padded data (encoders, short sequences) always take the dense path, over real query
    positions only.
    """
    n, d, dv = data.q.shape[2], data.q.shape[3], data.v.shape[3]
    target = data.out.repeat(1, n_copies, 1, 1)
    with torch.no_grad():
        dense = not data.causal or data.mask is not None
        cheap = (_is_oal(method) or _is_window_oal(method)) and \
            n * (method.factor.shape[-1] - 1) * d < (1 + d + d * (d + 1) // 2) * (dv + 1)
        if dense or cheap:
            err, count = 0, 0
            for s in range(data.q.shape[0]):
                qs, ks, vs = data.q[s : s + 1], data.k[s : s + 1], data.v[s : s + 1]
                key_mask = None if data.mask is None else data.mask[s : s + 1]
                real = torch.arange(n, device=qs.device) if key_mask is None else key_mask[0].nonzero().flatten()
                for start in range(0, real.numel(), query_chunk):
                    pos = real[start : start + query_chunk]
                    pred = sampled_dense_output(method, qs, ks, vs, pos, n_copies, causal=data.causal,
                                                key_mask=key_mask)
                    err = err + (pred - target[s : s + 1, :, pos]).square().sum(dim=(0, 2, 3))
                count += real.numel()
            return err / (count * dv)
        q, k, v = (t.repeat(1, n_copies, 1, 1) for t in (data.q, data.k, data.v))
        out = method(q, k, v, causal=True)
        return (out.to(target.dtype) - target).square().mean(dim=(0, 2, 3))
