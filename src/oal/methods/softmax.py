"""Exact softmax attention: the reference arm. No parameters, no approximation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from oal.methods.base import AttentionMethod, register


def _shifted_exp(scores: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """exp(scores - row max), 0 where `allowed` is False. The shift is a per-row factor (it cancels in the normalised
    output) taken over the allowed keys only, so that no masked key's larger score underflows the kept weights."""
    if allowed is not None:
        scores = torch.where(allowed, scores, -torch.inf)
    if scores.shape[-1] == 0:  # no keys: amax has nothing to reduce
        return scores.exp()
    top = scores.amax(-1, keepdim=True)
    if allowed is not None:
        top = top.clamp_min(torch.finfo(top.dtype).min)  # a row with no allowed key: all its weights 0
    return torch.exp(scores - top)


@register
class SoftmaxMethod(AttentionMethod):
    name = "softmax"

    def _scores(self, q, k):
        return q @ k.repeat_interleave(self.n_rep, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])

    def dense_kernel(self, q, k):
        return _shifted_exp(self._scores(q, k))

    def masked_kernel(self, q, k, allowed):
        return _shifted_exp(self._scores(q, k), allowed)

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        if initial_state is not None or output_final_state:
            raise ValueError("initial_state: softmax attention keeps a KV cache, not a recurrent state")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1, enable_gqa=True)
