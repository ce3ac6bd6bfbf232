"""OAL (grouped positive quadratic, Section 4.3) and the learned global quadratic (G = 1, App. D)."""

from __future__ import annotations

import math

import torch
from torch import nn

from oal.methods.base import AttentionMethod, register
from oal.ops import oal_attention
from oal.ops.kernel import taylor_factor
from oal.ops.reference import dense_kernel


@register
class OALMethod(AttentionMethod):
    """Groups are a fixed buffer [Hq, d]; the factor L [Hq, G+1, G+1] is the trainable parameter."""

    name = "oal"
    supports_state = True
    uses_groups = True
    adapts_from_calibration = True  # App. F.2 (and F.1 for the learned global, a subclass)

    def __init__(
        self,
        n_heads,
        n_kv_heads,
        head_dim,
        *,
        groups=None,
        factor=None,
        n_groups: int = 2,
        eps: float = 1e-6,
        layer_idx: int = 0,
        seed: int = 0,
    ):
        super().__init__(n_heads, n_kv_heads, head_dim, layer_idx=layer_idx, seed=seed)
        if groups is None:
            groups = torch.zeros(n_heads, head_dim, dtype=torch.long)
        groups = torch.as_tensor(groups, dtype=torch.long)
        if groups.shape != (n_heads, head_dim):
            raise ValueError(f"groups: expected shape [{n_heads}, {head_dim}], got {tuple(groups.shape)}")
        if factor is None:
            n_groups = max(n_groups, int(groups.max()) + 1)
            factor = taylor_factor(n_heads, n_groups)
        self.register_buffer("groups", groups)
        self.factor = nn.Parameter(torch.as_tensor(factor, dtype=torch.float32).clone())
        self.eps = float(eps)

    @property
    def n_groups(self) -> int:
        return self.factor.shape[-1] - 1

    @property
    def n_kernel_params(self) -> int:
        """(G_h + 1)(G_h + 2) / 2 entries of the lower triangle of L per head, G_h the groups head h uses (App. D);
        the factor tensor is padded to the layer's largest G, and padded or unused rows have no effect."""
        if not self.factor.requires_grad:
            return 0
        used = [int(torch.unique(g).numel()) for g in self.groups]
        return sum((g + 1) * (g + 2) // 2 for g in used)

    def dense_kernel(self, q, k):
        return dense_kernel(
            q, k, self.groups, self.factor.to(q.dtype), eps=self.eps, scale=1.0 / math.sqrt(q.shape[-1])
        )

    def forward(self, q, k, v, *, causal=True, initial_state=None, output_final_state=False):
        return oal_attention(
            q,
            k,
            v,
            self.groups,
            self.factor,
            eps=self.eps,
            causal=causal,
            initial_state=initial_state,
            output_final_state=output_final_state,
        )


@register
class GlobalMethod(OALMethod):
    """The learned global quadratic a + b s + c s^2 as the one-group instance of OAL (App. D)."""

    name = "global"
    uses_groups = False  # one group whatever the caller's grouping

    def __init__(
        self,
        n_heads,
        n_kv_heads,
        head_dim,
        *,
        factor=None,
        eps: float = 1e-6,
        groups=None,
        n_groups: int = 1,
        layer_idx: int = 0,
        seed: int = 0,
    ):
        # groups / n_groups are accepted and ignored (one group whatever the caller's grouping): a saved record
        # holds n_groups = 1, and callers pass OAL's settings to both
        super().__init__(
            n_heads,
            n_kv_heads,
            head_dim,
            groups=None,  # one group; built once the base class has checked the sizes
            factor=factor,
            n_groups=1,
            eps=eps,
            layer_idx=layer_idx,
            seed=seed,
        )
