"""One normaliser over the window's softmax terms and the older keys' kernel terms, stable at any logit scale.

For query i with exact keys W_i = {i - W < j <= i} u {j < S, j <= i} (the window and the sinks) and older keys
O_i = {S <= j <= i - W}:

    y_i = (sum_{W_i} e^{s_ij} u_j + sum_{O_i} kappa_ij u_j)_{:dv} / (same)_{dv},   u_j = [v_j; 1].

The window part arrives as (m_i, A_i) with m_i = max_{W_i} s_ij and A_i = sum_{W_i} e^{s_ij - m_i} u_j (so
A_i[-1] >= 1), the older part as the raw sum B_i = sum_{O_i} kappa_ij u_j / lam (lam > 0 a known rescaling of the
kernel, see `oal.ops._rescaled`), D_i = B_i[-1] its denominator. Both are multiplied by e^{-c_i} with

    c_i = max(m_i, log(lam D_i)):   window weight e^{m_i - c_i} <= 1,   older weight (B_i / D_i) e^{log(lam D_i) - c_i}

so no exponent is positive and nothing can overflow, and one of the two weights is exactly 1, so the combined
denominator is >= 1 (never 0/0). The older weight is written through B_i / D_i (a weighted mean of u, bounded)
so that e^{-c_i} itself, which overflows when every logit is very negative, is never formed. c_i is a per-query
constant that cancels in the ratio, so it carries no gradient.
"""

from __future__ import annotations

import math

import torch


def merge_max(m: torch.Tensor, acc: torch.Tensor, s: torch.Tensor, u: torch.Tensor):
    """(m, acc) of a running softmax sum extended by scores s [..., n, M] (-inf: not visible) on rows u [..., M, c].

    m [..., n] finite, acc [..., n, c] = sum exp(s - m) u so far; returns both with the new keys added."""
    new = torch.maximum(m, s.detach().amax(-1))
    return new, acc * torch.exp(m - new).unsqueeze(-1) + torch.exp(s - new.unsqueeze(-1)) @ u


def normalise(m: torch.Tensor, acc: torch.Tensor, older: torch.Tensor | None = None,
              log_lam: float | torch.Tensor = 0.0):
    """out [..., n, dv] from the window's (m [..., n], acc [..., n, dv+1]) and the older keys' raw sum
    older [..., n, dv+1] (kernel divided by lam), or None when there is no kernel part. `log_lam`: log(lam), a
    number or a 0-dim tensor on the device (the device checks' rescaling, never read on the host)."""
    if older is not None:
        den = older[..., -1].detach()
        filled = den > 0  # no older key (or only rounding noise): weight 0
        safe = torch.where(filled, den, torch.ones_like(den))
        log_older = (safe.log() + log_lam).masked_fill(~filled, -math.inf)
        c = torch.maximum(m, log_older)
        old = older / safe.unsqueeze(-1) * torch.exp(log_older - c).unsqueeze(-1)
        acc = acc * torch.exp(m - c).unsqueeze(-1) + old
    return acc[..., :-1] / acc[..., -1:]
