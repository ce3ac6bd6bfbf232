"""Exact softmax attention: the reference arm. No parameters, no approximation."""

from __future__ import annotations

import math

import torch.nn.functional as F

from oal.methods._common import shifted_exp
from oal.methods.base import AttentionMethod, register


@register
class SoftmaxMethod(AttentionMethod):
    name = "softmax"

    def _scores(self, q, k):
        return q @ k.repeat_interleave(self.n_rep, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])

    def dense_kernel(self, q, k):
        return shifted_exp(self._scores(q, k))

    def masked_kernel(self, q, k, allowed):
        return shifted_exp(self._scores(q, k), allowed)

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        if initial_state is not None or output_final_state:
            raise ValueError("initial_state: softmax attention keeps a KV cache, not a recurrent state")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1, enable_gqa=True)
