"""Small helpers shared by the baseline methods: seeding, compute dtype, input checks."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["check_qkv", "compute_dtype", "generator_for", "shifted_exp"]


def generator_for(*parts) -> torch.Generator:
    """A CPU generator seeded from a readable key, e.g. ("performer", seed, layer, head): reproducible."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()
    return torch.Generator().manual_seed(int(digest[:15], 16))


def compute_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs stay fp64 (tests, paper runs); otherwise the method's configured dtype."""
    return torch.float64 if x.dtype == torch.float64 else dtype


def check_qkv(method, q, k, v=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            # integer q/k were cast silently by the feature maps, or failed deep in torch (TaylorShift's norm)
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a floating-point tensor, got {got}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q/k: expected 4-D [B, H, N, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[1] != method.n_heads or k.shape[1] != method.n_kv_heads:
        raise ValueError(f"q/k: expected {method.n_heads} query and {method.n_kv_heads} KV heads, "
                         f"got {q.shape[1]} and {k.shape[1]}")
    if q.shape[-1] != method.head_dim or k.shape[-1] != method.head_dim:
        raise ValueError(f"q/k: expected head_dim {method.head_dim}, got {q.shape[-1]} and {k.shape[-1]}")
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v: expected [B, Hkv, N, dv] matching k {tuple(k.shape)}, got {tuple(v.shape)}")


def shifted_exp(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """exp(logits - row max), 0 where `allowed` is False: the unnormalised weights of softmax and the window
    methods. The shift is a per-row factor (it cancels in the normalised output) taken over the allowed keys only,
    so that no masked key's larger logit underflows the kept weights."""
    if allowed is not None:
        logits = torch.where(allowed, logits, -torch.inf)
    if logits.shape[-1] == 0:  # no keys: amax has nothing to reduce
        return logits.exp()
    top = logits.amax(-1, keepdim=True)
    if allowed is not None:
        top = top.clamp_min(torch.finfo(top.dtype).min)  # a row with no allowed key: all its weights 0
    return torch.exp(logits - top)
