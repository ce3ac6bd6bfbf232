"""The OAL operator: positive grouped quadratic attention in linear time (paper Section 4, App. D)."""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

from oal.ops.chunked import chunked_attention
from oal.ops.kernel import cached_coefficients, feature_dim, packed_pairs
from oal.ops.recurrent import recurrent_attention
from oal.ops.reference import reference_attention

__all__ = ["BACKENDS", "cpu_bf16", "feature_dim", "oal_attention", "split_state", "empty_state"]

BACKENDS = ("auto", "reference", "recurrent", "chunked", "triton")
DECODE_TOKENS = 4  # `auto` runs at most this many new tokens on top of an initial state with the token loop


log = logging.getLogger("oal")


def _auto_triton(q: torch.Tensor, v: torch.Tensor, causal: bool, chunk_size: int | None = None) -> bool:
    """`auto` on CUDA: the Triton kernels when installed (causal) and when they take these inputs, else the torch
    paths with a warning, once per reason."""
    if q.device.type != "cuda" or not causal:
        return False
    from oal.ops import triton as oal_triton

    if oal_triton.available():
        reason = oal_triton.unsupported(q, v, chunk_size)
        if reason is None:
            return True
    else:
        reason = f"triton is not installed; {oal_triton.INSTALL_HINT}"
    if reason not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(reason)
        log.warning("CUDA attention runs the chunked torch path: %s", reason)
    return False


_FALLBACK_WARNED: set[str] = set()


@functools.cache
def _cpu_has_bf16() -> bool:
    from oal.ops.tuning import cpu_info

    return any(f in cpu_info()["flags"] for f in ("avx512_bf16", "amx_bf16"))


def cpu_bf16() -> bool:
    """Whether bf16 inputs on the CPU run bf16 features and GEMMs (fp32 accumulation, fp32 state): on CPUs with
    native bf16 dot products (avx512_bf16 or AMX), where bf16 GEMMs run at several times the fp32 rate (here 4.5x).
    Elsewhere bf16 has no GEMM instructions of its own, and bf16 inputs run the fp32 path (exact; outputs in bf16).
    OAL_CPU_BF16=1 or 0 overrides the detection."""
    forced = os.environ.get("OAL_CPU_BF16", "")
    return forced != "0" if forced else _cpu_has_bf16()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # states accumulate in fp32, or fp64 for fp64 inputs
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_state(batch: int, n_kv: int, d: int, dv: int, *, dtype=torch.float32, device="cpu"):
    """Zero state [B, Hkv, 1 + d + d(d+1)/2, dv + 1]: rows H0, H1, H2 (packed), last column the denominator."""
    return torch.zeros(batch, n_kv, feature_dim(d), dv + 1, dtype=dtype, device=device)


def split_state(state: torch.Tensor, d: int):
    """Views (H0 [..., dv+1], H1 [..., d, dv+1], H2 [..., d(d+1)/2, dv+1]) of a state tensor."""
    return state[..., 0, :], state[..., 1 : 1 + d, :], state[..., 1 + d :, :]


def _check(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 4-D tensor [B, H, N, d], got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    bsz, n_q, n, d = q.shape
    if d == 0:
        raise ValueError("q: expected a head dimension d >= 1, got d = 0")
    if k.shape[0] != bsz or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"k: expected shape [{bsz}, Hkv, {n}, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    n_kv = k.shape[1]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected shape [{bsz}, {n_kv}, {n}, dv] to match k, got {tuple(v.shape)}")
    if n_kv == 0 or n_q % n_kv != 0:
        raise ValueError(f"q/k: query heads Hq={n_q} must be a multiple of KV heads Hkv={n_kv}")
    if (
        not isinstance(factor, torch.Tensor)
        or factor.dim() != 3
        or factor.shape[0] != n_q
        or (factor.shape[1] != factor.shape[2] or factor.shape[1] < 2)
    ):
        got = tuple(factor.shape) if isinstance(factor, torch.Tensor) else type(factor).__name__
        raise ValueError(f"factor: expected shape [Hq={n_q}, G+1, G+1] with G >= 1, got {got}")
    n_groups = factor.shape[1] - 1
    if not isinstance(groups, torch.Tensor) or groups.shape != (n_q, d):
        got = tuple(groups.shape) if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise ValueError(f"groups: expected an integer tensor of shape [Hq={n_q}, d={d}], got {got}")
    if groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
        raise ValueError(f"groups: expected an integer dtype, got {groups.dtype}")
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise ValueError(f"initial_state: expected a tensor or None, got {type(initial_state).__name__}")
    for name, t in (("k", k), ("v", v), ("groups", groups), ("factor", factor), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {t.device}")
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= n_groups):
        raise ValueError(
            f"groups: ids must lie in [0, G={n_groups}), got range [{int(groups.min())}, {int(groups.max())}]"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number or None, got {scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size!r}")
    if initial_state is not None:
        want = (bsz, n_kv, feature_dim(d), v.shape[-1] + 1)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected shape {list(want)}, got {tuple(initial_state.shape)}")
    mags = {name: _max_abs(name, t) for name, t in (("q", q), ("k", k), ("v", v), ("factor", factor))}
    if initial_state is not None:
        _max_abs("initial_state", initial_state)
        _check_denominator(initial_state, d)
    return mags["q"], mags["k"]


def _check_denominator(state: torch.Tensor, d: int) -> None:
    """A state's last column sums [1, k_j, k_j k_j^T] over the keys so far, so its token count (H0) and the sums of
    squares on H2's diagonal cannot be negative; a state that breaks this makes normalisers negative or zero."""
    den = state[..., -1]
    r, t, _ = packed_pairs(d, state.device)
    count, squares = den[..., 0], den[..., 1 + d :][..., r == t]
    if (count < 0).any() or (squares < 0).any():
        raise ValueError(f"initial_state: its denominator column (index dv) must hold key moments (token count "
                         f">= 0, sums of squares k_r^2 >= 0), got count {float(count.min()):.4g} and squares down "
                         f"to {float(squares.min()):.4g}; pass the state a previous call returned")


def _max_abs(name: str, t: torch.Tensor) -> float:
    """max |t|, or a ValueError naming `name` if t holds NaN or Inf (one pass: aminmax propagates NaN)."""
    if t.numel() == 0:
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(t.detach()))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name}: contains NaN or Inf values")
    return max(-lo, hi)


def _rescaled(q, qmax: float, kmax: float, factor, eps: float, scale: float, dtype: torch.dtype):
    """(q, factor, eps, scale, lam) with which `dtype` evaluates kappa / lam without overflow (max |q|, |k| given).

    kappa / lam = eps / lam + |L'^T [1, s / sqrt(lam)]|^2 with L' = L whose row 0 is divided by sqrt(lam)
    (Eq. 7), and the output num / den does not change when every kappa is divided by lam. So scores too large
    for `dtype` (bound s_max beyond max^(1/4), where the readout's s^2-sized terms could overflow) are evaluated
    exactly with lam = s_max^2: q / max|q| and scale 1 / (d max|k|), which keeps the query features near 1
    and the state (raw keys, by contract) unchanged. Keys whose own products k_r k_t overflow are refused.
    lam is 1 when nothing was rescaled (the sliding-window hybrid needs it: there kappa's scale does not cancel).
    """
    info = torch.finfo(dtype)
    if kmax * kmax > info.max / 1e6:  # the state holds the raw products k_r k_t
        raise ValueError(f"k: values up to {kmax:.3g} overflow the {dtype} state (k_r k_t); use float64")
    d = q.shape[-1]
    s_max = abs(scale) * d * qmax * kmax  # |s| <= scale d max|q| max|k|
    if s_max <= info.max**0.25:
        return q, factor, eps, scale, 1.0
    row0 = torch.ones(factor.shape[-1], 1, dtype=factor.dtype, device=factor.device)
    row0[0] = 1.0 / s_max
    return q / qmax, factor * row0, eps / s_max**2, math.copysign(1.0 / (d * kmax), scale), s_max**2


def oal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: torch.Tensor,
    factor: torch.Tensor,
    *,
    eps: float = 1e-6,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
):
    """OAL attention: sum_j kappa_ij v_j / sum_j kappa_ij over j <= i (all j when causal=False).

    q [B, Hq, N, d], k [B, Hkv, N, d], v [B, Hkv, N, dv]; groups [Hq, d] ids in [0, G); factor
    [Hq, G+1, G+1] (lower triangle read). Returns out [B, Hq, N, dv] in q's dtype, and the final state
    [B, Hkv, 1 + d + d(d+1)/2, dv + 1] when `output_final_state`. `initial_state` continues a sequence.
    `chunk_size` (chunked backend): tokens per chunk; None picks it, and short fresh sequences run as one chunk.
    For `triton` (causal only; non-causal runs `chunked`) it is a power of two >= 16, 64 by default, and at most 64
    on CUDA (`auto` runs `chunked` for longer chunks).
    """
    qmax, kmax = _check(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size)
    out_dtype = q.dtype
    dtype = _compute_dtype(q.dtype)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, factor, eps, scale, _ = _rescaled(q, qmax, kmax, factor.to(dtype), eps, scale, dtype)
    if backend == "triton" and not causal:  # the kernels are causal; the torch path serves the rest
        backend = "chunked"
    if backend == "triton" or (backend == "auto" and _auto_triton(q, v, causal, chunk_size)):
        from oal.ops.triton import triton_attention  # optional dependency, imported on use

        out, final = triton_attention(
            q, k, v, groups, factor, eps=eps, scale=scale, initial_state=initial_state, chunk_size=chunk_size
        )
        return (out, final) if output_final_state else out
    coeffs, weights = cached_coefficients(factor, groups, eps, scale)  # once per kernel, not per decoded token
    state = initial_state.to(dtype) if initial_state is not None else None
    if backend == "auto":  # decoding (a few tokens on a state): the token loop has the least set-up
        backend = "recurrent" if state is not None and q.shape[2] <= DECODE_TOKENS else "chunked"
    if q.numel() == 0 or k.numel() == 0:  # N = 0 or B = 0: an empty result (and the state unchanged)
        backend = "reference"
    # bf16 inputs keep bf16 features and GEMMs (fp32 accumulation inside the GEMM) where the hardware has bf16
    # GEMMs (`cpu_bf16`; GPUs do); states stay in `dtype`
    low = (backend == "chunked" and q.dtype == k.dtype == v.dtype == torch.bfloat16
           and (q.device.type != "cpu" or cpu_bf16()))
    q, k, v = (t.to(torch.bfloat16 if low else dtype) for t in (q, k, v))
    if backend == "reference":
        out, final = reference_attention(
            q, k, v, groups, factor, eps=eps, scale=scale, causal=causal, initial_state=state, coeffs=coeffs,
            want_state=output_final_state
        )
    else:
        fresh = state is None
        if fresh:
            state = empty_state(q.shape[0], k.shape[1], d, v.shape[-1], dtype=dtype, device=q.device)
        if backend == "recurrent":
            out, final = recurrent_attention(q, k, v, coeffs, scale=scale, causal=causal, state=state, weights=weights)
        else:
            out, final = chunked_attention(
                q, k, v, groups, factor, coeffs, eps=eps, scale=scale, causal=causal, state=state,
                state_is_zero=fresh and chunk_size is None, need_state=output_final_state, chunk_size=chunk_size,
                weights=weights,
            )
    try:  # never a silent NaN: the inputs were finite, so say why
        _max_abs("out", out)
    except ValueError:
        if eps == 0:
            raise ValueError("eps: with eps=0 the kernel vanished for every visible key of some query (0/0); "
                             "use eps > 0") from None
        raise ValueError(f"q/k/factor: the kernel overflowed {dtype}; use float64 inputs") from None
    out = out.to(out_dtype)
    return (out, final) if output_final_state else out
