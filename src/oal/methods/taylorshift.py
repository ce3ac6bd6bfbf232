"""TaylorShift (Nauen et al. 2024) as adapted in App. F.1.

kappa(q, k) = 1 + s + s^2 / 2 with s = tau_h q^ . k^, q^ and k^ l2-normalised, tau_h a trainable per-head
temperature (init 1); no output-amplitude normalisation, the usual numerator / denominator only.
1 + s + s^2/2 = ((1 + s)^2 + 1) / 2 > 0, so the weights are positive.

Linear path: this is exactly the one-group OAL kernel (Eq. 7) with the Taylor factor L = [[1, 0], [1/2, 1/2]]
(M = L L^T = [[1, 1/2], [1/2, 1/2]]: a = 1, b = 1, C = 1/2), eps = 0 and scale = 1, applied to
(tau_h q^, k^): s_1 = sum_r tau q^_r k^_r = s. So we call the tested OAL operator (its H0/H1/H2 state, GQA
sharing per KV head, chunked autograd) instead of a second quadratic feature expansion.
"""

from __future__ import annotations

import torch
from torch import nn

from oal.methods._common import check_qkv
from oal.methods.base import AttentionMethod, register
from oal.ops import oal_attention
from oal.ops.kernel import taylor_factor

__all__ = ["TaylorShiftMethod"]


@register
class TaylorShiftMethod(AttentionMethod):
    name = "taylorshift"
    supports_state = True

    def __init__(self, n_heads, n_kv_heads, head_dim, *, chunk_size: int | None = None, layer_idx: int = 0,
                 seed: int = 0):
        # chunk_size: the other baselines' setting, taken so that one set builds them all; OAL's operator, which
        # this method runs, picks its own chunks
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        self.tau = nn.Parameter(torch.ones(n_heads))
        # fixed: one group and the Taylor factor, buffers so that they move with the model (not saved; not named
        # `factor`, which marks the calibrated OAL-family kernels elsewhere)
        self.register_buffer("groups", torch.zeros(n_heads, head_dim, dtype=torch.long), persistent=False)
        self.register_buffer("taylor", taylor_factor(n_heads, 1, dtype=torch.float64), persistent=False)

    def _normalised(self, q, k):
        qn = torch.nn.functional.normalize(q, dim=-1) * self.tau.to(q.dtype)[None, :, None, None]
        return qn, torch.nn.functional.normalize(k, dim=-1)

    def dense_kernel(self, q, k):
        check_qkv(self, q, k)
        qn, kn = self._normalised(q, k)
        s = qn @ kn.repeat_interleave(self.n_rep, dim=1).transpose(-1, -2)  # s = tau q^ . k^
        return 1 + s + 0.5 * s * s

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        check_qkv(self, q, k, v)
        qn, kn = self._normalised(q, k)
        factor = self.taylor.to(qn.dtype)  # exact in every dtype (entries 1, 1/2, 0)
        return oal_attention(qn, kn, v, self.groups, factor, eps=0.0, scale=1.0, causal=causal,
                             initial_state=initial_state, output_final_state=output_final_state)
