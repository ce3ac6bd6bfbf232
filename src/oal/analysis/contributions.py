"""Dimension-wise query-key contribution scores (paper Sec. 3.1, Eq. 2).

chi_{p,r} = 1/|Omega_p| * sum_{j <= i} |q_{p,i,r} k_{p,j,r}| / sqrt(d): the mean absolute contribution of
dimension r to the attention logits over causal pairs of one prompt. Since |q_ir k_jr| = |q_ir| |k_jr|, the sum
over j <= i is |q_ir| times a prefix sum of |k_r|, so the cost is O(N d) time and memory instead of O(N^2 d).

Encoders (`causal=False`): Omega_p is every pair (i, j) of real tokens, and the sum factorises into
(sum_i |q_ir|) (sum_j |k_jr|) over n^2 pairs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_qk(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
    if q.dim() < 2 or k.dim() < 2:
        raise ValueError(f"q, k: expected [..., N, d], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[-2:] != k.shape[-2:]:
        raise ValueError(f"k: expected the same [N, d] as q {tuple(q.shape[-2:])}, got {tuple(k.shape[-2:])}")
    if q.shape[-2] == 0:
        raise ValueError("q: sequence length N must be at least 1")
    if mask is not None and mask.shape[-1] != q.shape[-2]:
        raise ValueError(f"mask: expected [..., N] with N={q.shape[-2]}, got {tuple(mask.shape)}")
    if not (torch.isfinite(q).all() and torch.isfinite(k).all()):
        raise ValueError("q, k: non-finite values")


def _n_pairs(n_valid: torch.Tensor, causal: bool = True) -> torch.Tensor:
    if (n_valid <= 0).any():
        raise ValueError("mask: every sequence needs at least one valid token")
    # |Omega_p| = n(n+1)/2 causal pairs, n^2 pairs without the causal mask
    return n_valid * (n_valid + 1) / 2 if causal else n_valid * n_valid


def contribution_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *, mask: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Eq. (2) for one prompt: q [..., N, d], k [..., N, d] (GQA already mapped) -> chi [..., d].

    `mask` [..., N] (1/True = real token) restricts the causal pairs to real tokens (padding on either side).
    `causal=False` (encoders) takes every pair of real tokens instead of j <= i.
    `scale` defaults to 1/sqrt(d). Computed in float32 (float64 for float64 inputs). Differentiable.
    """
    _check_qk(q, k, mask)
    dt = _acc_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    aq, ak = q.to(dt).abs(), k.to(dt).abs()
    if mask is None:
        n = torch.tensor(float(q.shape[-2]), dtype=dt, device=q.device)
    else:
        m = mask.to(dt)
        aq, ak = aq * m[..., None], ak * m[..., None]
        n = m.sum(-1)[..., None]
    if not causal:  # sum over all (i, j) of |q_ir| |k_jr| = (sum_i |q_ir|) (sum_j |k_jr|)
        return aq.sum(-2) * ak.sum(-2) * scale / _n_pairs(n, causal)
    kcum = ak.cumsum(-2)  # sum_{j <= i} |k_jr|
    total = (aq * kcum).sum(-2)  # sum_{j <= i} |q_ir| |k_jr|
    return total * scale / _n_pairs(n)


def contribution_scores_reference(
    q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *, mask: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Brute-force O(N^2 d) Eq. (2): forms every causal (or, `causal=False`, every) pair explicitly. The oracle
    for the fast path."""
    _check_qk(q, k, mask)
    dt = _acc_dtype(q)
    n_tok, d = q.shape[-2:]
    scale = d**-0.5 if scale is None else scale
    pair = (q.to(dt)[..., :, None, :] * k.to(dt)[..., None, :, :]).abs() * scale  # [..., i, j, d]
    keep = torch.ones(n_tok, n_tok, dtype=torch.bool, device=q.device)
    keep = keep.tril() if causal else keep
    if mask is not None:
        valid = mask.bool()
        keep = keep & valid[..., :, None] & valid[..., None, :]
    keep = keep.to(dt)
    return (pair * keep[..., None]).sum((-3, -2)) / keep.sum((-2, -1))[..., None]


def head_contributions(
    q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None = None, scale: float | None = None,
    *, causal: bool = True,
) -> torch.Tensor:
    """Per-prompt chi for every query head: q [B, Hq, N, d], k [B, Hkv, N, d] -> [B, Hq, d].

    Query head h uses KV head h // (Hq // Hkv) (HF repeat_kv). `attention_mask` [B, N] is the padding mask;
    `causal=False` for encoders (all pairs of real tokens).
    The KV prefix sums are formed once per KV head and broadcast over its query group (no repeat copy).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q, k: expected [B, H, N, d], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    if k.shape != (b, hkv, n, d) or hkv == 0 or hq % hkv:
        raise ValueError(f"k: expected [B={b}, Hkv, N={n}, d={d}] with Hq={hq} divisible by Hkv, got {tuple(k.shape)}")
    g = hq // hkv
    qg = q.reshape(b, hkv, g, n, d)
    kg = k[:, :, None]  # broadcast over the g query heads of each KV head
    if attention_mask is not None and tuple(attention_mask.shape) != (b, n):  # [1, N] would mask every row alike
        raise ValueError(f"attention_mask: expected [B={b}, N={n}], got {tuple(attention_mask.shape)}")
    mask = None if attention_mask is None else attention_mask[:, None, None, :]
    return contribution_scores(qg, kg.expand(b, hkv, g, n, d), scale, mask=mask, causal=causal).reshape(b, hq, d)


def prefix_contributions(
    q: torch.Tensor, k: torch.Tensor, lengths: list[int], scale: float | None = None
) -> torch.Tensor:
    """chi of every prefix q[..., :n, :], k[..., :n, :] for n in `lengths` in one pass -> [len(lengths), ..., d].

    A causal prefix of a sequence sees the same q/k as the full sequence, so Table 4 (stability across sequence
    lengths) needs only one capture: the running sum over i of |q_i| * prefix(|k|) read at each length.
    """
    _check_qk(q, k, None)
    n_tok = q.shape[-2]
    if not lengths or any(not 1 <= n <= n_tok for n in lengths):
        raise ValueError(f"lengths: expected values in [1, {n_tok}], got {lengths}")
    dt = _acc_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    aq, ak = q.to(dt).abs(), k.to(dt).abs()
    running = (aq * ak.cumsum(-2)).cumsum(-2)  # [..., N, d]: causal-pair sums of every prefix
    idx = torch.tensor([n - 1 for n in lengths], device=q.device)
    pairs = torch.tensor([n * (n + 1) / 2 for n in lengths], dtype=dt, device=q.device)
    out = running.index_select(-2, idx) * scale  # [..., L, d]
    out = out / pairs[:, None]
    return out.movedim(-2, 0)


def check_finite_attention(layer: int, tensors: Mapping[str, torch.Tensor], where: str,
                           real: torch.Tensor | None = None) -> None:
    """Refuse captured attention tensors [B, H, N, d] of `layer` that hold a NaN or inf (ValueError naming the
    layer, the tensors and their heads, and what to try), where a stage first sees a layer's capture: the analysis
    and the calibration both failed on it later as "q, k: non-finite values", naming no layer. `real` [B, N]: the
    real tokens; `out` is checked there only (padded queries are never scored). `where`: the blocks it came from."""
    bad = []
    for name, t in tensors.items():
        finite = torch.isfinite(t)
        if name == "out" and real is not None:
            finite = finite | ~real.bool()[:, None, :, None]
        if not bool(finite.all()):
            heads = (~finite).transpose(0, 1).flatten(1).any(1).nonzero().flatten().tolist()
            kind = "query" if name in ("q", "out") else "KV"
            bad.append(f"{name} in {kind} head{'s' * (len(heads) > 1)} {', '.join(map(str, heads))}")
    if not bad:
        return
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    hint = (f"computed in {dtype}, which overflows: try --dtype float32 (in Python: load the model in torch.float32)"
            if dtype in ("float16", "bfloat16") else f"computed in {dtype}: check the model's weights and inputs")
    raise ValueError(f"model: layer {layer}'s attention is non-finite (NaN or inf) on {where}: "
                     f"{'; '.join(bad)}; {hint}")
