"""Dense O(N^2) sliding-window attention: the oracle the banded and recurrent paths are tested against.

Both methods are a softmax over per-pair log-weights, which makes the reference stable at any logit scale:
- swa: log w_ij = s_ij on the window (i - W < j <= i) and the sinks (j < S), -inf elsewhere;
- oal-swa: log w_ij = s_ij on the window and the sinks, log kappa_ij (Eq. 7) on every other older key
  S <= j <= i - W.
"""

from __future__ import annotations

import torch

from oal.ops.reference import dense_kernel

__all__ = ["window_log_weights", "reference_window_attention"]


def window_log_weights(q, k, positions, *, window: int, sinks: int = 0, kernel=None, scale: float, log_kappa=None):
    """log w [B, Hq, n, M] of queries q [B, Hq, n, d] at `positions` [n] against keys k [B, Hkv, M, d] at 0..M-1.

    kernel: None (swa) or (groups, factor, eps) for the older keys (oal-swa); or `log_kappa` [B, Hq, n, M], the
    log of Eq. 7 computed elsewhere (calibration's batched evaluation), for the older keys instead."""
    rep = q.shape[1] // k.shape[1]
    s = scale * q @ k.repeat_interleave(rep, dim=1).transpose(-1, -2)
    j = torch.arange(k.shape[2], device=q.device)
    i = positions.to(q.device)[:, None]
    exact = (j <= i) & ((j > i - window) | (j < sinks))  # the window and the sinks: {i - W < j <= i} u {j < S, j <= i}
    if kernel is None and log_kappa is None:  # swa: softmax over them (StreamingLLM)
        return s.masked_fill(~exact, -torch.inf)
    # y_i = (sum_exact e^s v + sum_older kappa v) / (sum_exact e^s + sum_older kappa), kappa of Eq. 7
    older = (j <= i - window) & (j >= sinks)  # every other key before the window
    if log_kappa is None:
        groups, factor, eps = kernel
        log_kappa = dense_kernel(q, k, groups, factor, eps=eps, scale=scale).log()
    return torch.where(exact, s, log_kappa.masked_fill(~older, -torch.inf))


def reference_window_attention(q, k, v, *, window: int, sinks: int = 0, kernel=None, scale: float):
    """out [B, Hq, N, dv]: softmax of the log-weights over the keys, times v (GQA: h uses KV head h // rep)."""
    positions = torch.arange(q.shape[2], device=q.device)
    logw = window_log_weights(q, k, positions, window=window, sinks=sinks, kernel=kernel, scale=scale)
    return torch.softmax(logw, dim=-1) @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
