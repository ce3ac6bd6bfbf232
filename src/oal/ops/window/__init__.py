"""Sliding-window attention, alone (swa) or with OAL's kernel on the keys that left the window (oal-swa).

    out = window_attention(q, k, v, window=W, sinks=S)                                  # swa
    out = window_attention(q, k, v, window=W, sinks=S, groups=groups, factor=factor)    # oal-swa

swa (StreamingLLM's window with attention sinks): softmax of s_ij = scale q_i . k_j over the last W keys
(i - W < j <= i) and the first S keys (j < S). oal-swa (LoLCATs' sliding window with OAL's kernel instead of a
feature map, plus StreamingLLM's sinks): weights e^{s_ij} on the last W keys and on the first S keys, and
kappa_ij = eps + |L^T s_bar_ij|^2 (Eq. 7, `oal.ops`) on every other older key S <= j <= i - W, under one
normaliser (see `normaliser.py` for the per-query shift that keeps it finite at any logit scale). A key is
counted once: a sink inside the window is a window key. The sinks give the first tokens the peaked weight heads
put there, which the quadratic kernel cannot; sinks=0 is the hybrid with the kernel on every older key.

Shapes and GQA as `oal.ops.oal_attention`: q [B, Hq, N, d], k [B, Hkv, N, d], v [B, Hkv, N, dv], query head h
reads KV head h // (Hq // Hkv); groups [Hq, d], factor [Hq, G+1, G+1]. Causal only. The decode state is one
tensor [B, Hkv, size] (layout in `state.py`): continuing from `initial_state` equals one long call.

Backends: "reference" (dense O(N^2), a whole sequence from its start), "banded" (the fast path, O(N (W + C))
plus OAL's linear-time prefix for oal-swa), "recurrent" (the token loop; on CUDA, without a gradient, the Triton
decoding kernels of `oal.ops.triton.window_decode` instead), "auto" (recurrent for a few tokens on a state, banded
otherwise). States accumulate in fp32, or fp64 for fp64 inputs; out has q's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oal.errors import check_int
from oal.ops import checks, cpu_kernel, plans
from oal.ops.checks import compute_dtype as _compute_dtype
from oal.ops.checks import max_abs as _max_abs
from oal.ops.checks import rescaled as _rescaled
from oal.ops.kernel import cached_coefficients
from oal.ops.triton import available as triton_available
from oal.ops.triton import routes
from oal.ops.window.banded import banded_window_attention
from oal.ops.window.recurrent import recurrent_window_attention
from oal.ops.window.reference import reference_window_attention, window_log_weights
from oal.ops.window.state import (
    empty_window_state,
    join_window_state,
    sequence_state,
    split_window_state,
    window_state_size,
)

__all__ = ["BACKENDS", "empty_window_state", "sequence_state", "split_window_state", "window_attention",
           "window_log_weights", "window_state_size"]

BACKENDS = ("auto", "reference", "banded", "recurrent")
DECODE_TOKENS = 4  # `auto` runs at most this many new tokens on a state with the token loop


@dataclass(frozen=True)
class Kernel:
    """OAL's kernel as the older keys' paths evaluate it: kappa / lam, with q and factor rescaled when the scores
    would overflow (`checks.rescaled`; lam = 1 otherwise). On a device whose checks are deferred
    (`_device_kernel`) the rescaling is in q and `weights` only, and log_lam a 0-dim tensor: the token loop reads
    nothing else."""

    q: torch.Tensor
    groups: torch.Tensor
    factor: torch.Tensor
    coeffs: tuple
    eps: float
    scale: float
    log_lam: float | torch.Tensor
    weights: torch.Tensor | None = None  # the query coefficients of `coeffs` (`kernel.cached_coefficients`)


def _device_kernel(q, groups, factor, eps: float, scale: float, mults: torch.Tensor, dtype) -> Kernel:
    """`checks.rescaled`'s kernel from the device multipliers of `checks.start` (`checks.device_rescale`), with no
    host read: q * qs, and the query weights [a, scale b, scale^2 C] times m_a, m_b and m_c; lam = 1 / m_a, kept as
    log lam = -2 log(inv_s) (m_a itself underflows first)."""
    kfactor = factor.to(dtype)
    coeffs, weights = cached_coefficients(kfactor, groups, eps, scale, by_version=True)
    qs, m_a, m_b, m_c, _, inv_s = mults.to(dtype).unbind()
    d = q.shape[-1]
    parts = torch.cat([m_a.reshape(1), m_b.expand(d), m_c.expand(weights.shape[-1] - 1 - d)])
    return Kernel(q * qs, groups, kfactor, coeffs, eps, scale, -2.0 * torch.log(inv_s), weights * parts)


def _triton_decode(q, k, v, groups, factor, *, window, sinks, eps, scale, state, own, sig):
    """A few tokens on a state on a deferred device: the window decoding kernels (`triton.window_decode`), their
    checks on the device, no host read; the cache's own state updated in place, and the call's plan kept under its
    signature `sig` (`oal.ops.plans`)."""
    from oal.ops.triton.window_decode import Plan  # no triton import until the kernels are launched

    q, k, v = (t.contiguous() for t in (q, k, v))
    chk, status = checks.start_decode(q, factor, state, _compute_dtype(q.dtype), eps, check_state=not own,
                                      moments=False)
    plan = Plan(q, k, v, groups, factor, window=window, sinks=sinks, eps=eps, scale=scale, state=state,
                inplace=own and checks.updatable(state, q, k, v, factor))
    out, final = plan(q, k, v, state, status)
    checks.finish(chk)
    if plan.inplace:  # the cache's own state (`own`): only then is there a signature to keep it under
        plans.keep(state, sig, plan)
    return out, final


def _check(q, k, v, window, sinks, kernel: bool, scale, causal, backend, initial_state, chunk_size, check_state=True,
           values=True):
    """Validate everything but the kernel's own arguments; returns (max |q|, max |k|). `check_state`: read the
    initial state's values (not for the generation cache's own state, `checks.owned`). `values` False: no value is
    read (the device checks do it, `checks.start`); returns (None, None)."""
    checks.qkv_shapes(q, k, v)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {t.device}")
    bsz, n_q, n, d = q.shape
    n_kv = k.shape[1]
    check_int("window", window, 1)
    check_int("sinks", sinks, 0)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number or None, got {scale!r}")
    if causal is not True:
        raise ValueError(f"causal: sliding-window attention is causal only, got causal={causal!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, 1)
    if initial_state is not None:
        want = (bsz, n_kv, window_state_size(d, v.shape[-1], window, sinks, kernel))
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise ValueError(f"initial_state: expected shape {list(want)} (see oal.ops.window.state), got {got}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: expected a tensor on q's device {q.device}, got {initial_state.device}")
        if backend == "reference":
            raise ValueError("initial_state: the reference evaluates a whole sequence from its start; "
                             "use backend 'banded' or 'recurrent' to continue one")
        if check_state and values:
            _max_abs("initial_state", initial_state)
    if not values:
        return None, None
    qmax, kmax = _max_abs("q", q), _max_abs("k", k)
    _max_abs("v", v)
    return qmax, kmax


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    sinks: int = 0,
    groups: torch.Tensor | None = None,
    factor: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
):
    """swa (groups and factor None) or oal-swa (both given); returns out [B, Hq, N, dv] in q's dtype, and the
    state [B, Hkv, window_state_size(...)] after the call when `output_final_state`.

    `chunk_size`: queries per chunk of the banded path (None: `banded.default_chunk`)."""
    if (groups is None) != (factor is None):
        raise ValueError("groups/factor: give both (oal-swa) or neither (swa)")
    has_kernel = groups is not None
    own = checks.owned(initial_state)  # the generation cache's state: checked when it was made, updated in place
    sig = None
    if own and checks.deferred(q):  # decoding on the cache's state: an earlier call's plan (oal.ops.plans)
        sig = plans.signature(q, k, v, initial_state, window, sinks, plans.tensor_key(groups),
                              plans.tensor_key(factor), eps, scale, causal, backend, chunk_size)
        planned = plans.run(q, k, v, factor, eps, initial_state, sig, output_final_state)
        if planned is not None:
            return planned
    if backend == "auto":  # the token loop for a few tokens on a state (decoding), banded otherwise
        n = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0  # the shapes are checked below
        backend = "recurrent" if initial_state is not None and n <= DECODE_TOKENS else "banded"
    # decoding on CUDA: the value checks on the device (Triton's guard kernel) and no host read (the token loop is
    # the decode path; a prefill keeps the host checks, once per prompt)
    deferred = checks.deferred(q) and triton_available() and backend == "recurrent"
    qmax, kmax = _check(q, k, v, window, sinks, has_kernel, scale, causal, backend, initial_state, chunk_size,
                        check_state=not own, values=not deferred)
    if has_kernel:  # the kernel's own arguments (groups ids, factor shape, eps), as oal_attention checks them
        checks.check_shapes(q, k, v, groups, factor, eps, scale, None, "auto")
        if not deferred:  # on the device, the guard or the decoding call's checks read it
            checks.factor_checked(factor)  # once per factor tensor and version
    out_dtype, dtype = q.dtype, _compute_dtype(q.dtype)
    bsz, n_q, n, d = q.shape
    n_kv, dv = k.shape[1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if deferred and routes.window_decodes(q, k, v, factor, initial_state, window, sinks):
        out, final = _triton_decode(q, k, v, groups, factor, window=window, sinks=sinks, eps=float(eps),
                                    scale=scale, state=initial_state, own=own, sig=sig)
        return (out.to(out_dtype), final) if output_final_state else out.to(out_dtype)
    chk = None
    if deferred:
        chk, mults = checks.start(q, k, v, factor, initial_state, dtype, eps, scale=scale, check_state=not own,
                                  moments=False)
    elif abs(scale) * d * qmax * kmax > torch.finfo(dtype).max / 4:
        raise ValueError(f"q/k: scores up to {abs(scale) * d * qmax * kmax:.3g} overflow {dtype}; use float64")
    kernel = None
    if has_kernel and deferred:
        kernel = _device_kernel(q.to(dtype), groups, factor, eps, scale, mults, dtype)
    elif has_kernel:
        kq, kfactor, keps, kscale, lam = _rescaled(q.to(dtype), qmax, kmax, factor.to(dtype), eps, scale, dtype)
        coeffs, weights = cached_coefficients(kfactor, groups, keps, kscale)  # once per kernel, not per token
        kernel = Kernel(kq, groups, kfactor, coeffs, keps, kscale, math.log(lam), weights)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    state = None if initial_state is None else initial_state.to(dtype)

    def make_state():
        return empty_window_state(bsz, n_kv, d, dv, window, sinks, has_kernel, dtype=dtype, device=q.device)

    if n == 0 or bsz == 0:  # nothing to attend: an empty result, the state unchanged
        out, final = q.new_zeros(bsz, n_q, n, dv), (state if state is not None else make_state())
    elif backend == "reference":
        ref_kernel = (groups, factor.to(dtype), float(eps)) if has_kernel else None
        out = reference_window_attention(q, k, v, window=window, sinks=sinks, kernel=ref_kernel, scale=scale)
        final = sequence_state(k, v, window, sinks, has_kernel) if output_final_state else None
    elif backend == "recurrent":
        base = state if state is not None else make_state()
        # the state is written in place where nobody else holds it: a new one, or the cache's own (`checks.owned`)
        inplace = (state is None or (own and state is initial_state)) and checks.updatable(base, q, k, v, factor)
        if not deferred and cpu_kernel.decodes(base, q, k, v, factor):  # the loop in C
            final = base if inplace else base.clone()
            args = None if kernel is None else (kernel.q, kernel.weights, kernel.log_lam)
            out = cpu_kernel.window_decode(q, k, v, final, window=window, sinks=sinks, scale=scale, kernel=args)
        else:
            slots, prefix = split_window_state(base, d, dv, window, sinks, has_kernel)
            out, new_slots, new_prefix = recurrent_window_attention(q, k, v, sinks=sinks, kernel=kernel,
                                                                    scale=scale, slots=slots, prefix=prefix,
                                                                    inplace=inplace)
            if inplace:  # the prefix was updated in place; the slots (a few rows) are written back
                slots.copy_(new_slots)
                final = base
            else:
                final = join_window_state(new_slots, new_prefix)
    else:
        slots, prefix = None, None
        if state is not None:
            slots, prefix = split_window_state(state, d, dv, window, sinks, has_kernel)
        elif has_kernel:
            prefix = split_window_state(make_state(), d, dv, window, sinks, True)[1]
        out, slots, prefix = banded_window_attention(q, k, v, window=window, sinks=sinks, kernel=kernel, scale=scale,
                                                     slots=slots, prefix=prefix, need_state=output_final_state,
                                                     chunk_size=chunk_size)
        final = join_window_state(slots, prefix) if output_final_state else None
    if chk is not None:  # the output's check on the device, reported by a later call (`checks.drain`)
        checks.finish(chk, out)
    else:
        try:  # never a silent NaN: the inputs were finite, so say why
            _max_abs("out", out)
        except ValueError:
            what = "q/k/factor: the kernel" if has_kernel else "q/k: the scores"
            raise ValueError(f"{what} overflowed {dtype}; use float64 inputs") from None
    out = out.to(out_dtype)
    return (out, final) if output_final_state else out
