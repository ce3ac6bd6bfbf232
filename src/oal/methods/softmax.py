"""Exact softmax attention: the reference arm. No parameters, no approximation."""

from __future__ import annotations

import math

import torch.nn.functional as F

from oal.methods._common import check_qkv, shifted_exp
from oal.methods.base import AttentionMethod, causal_mask, register
from oal.ops.checks import deferred, max_abs


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
        check_qkv(self, q, k, v)  # SDPA broadcast a 3-D q
        if not deferred(q):  # SDPA gave a NaN query a row of zeros; the other methods refuse. On the host only
            # where the operator's own value checks are (`ops.checks.deferred`): on CUDA it would stall every call
            for name, t in (("q", q), ("k", k), ("v", v)):
                max_abs(name, t)
        n, m = q.shape[2], k.shape[2]
        if causal and 1 < n != m:  # the last n of m positions query (`causal_mask`, as `reference`); SDPA's
            # is_causal aligns query i with key i instead (one query, a decoding step, sees every key: no mask)
            mask = causal_mask(n, m, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and n > 1, enable_gqa=True)
