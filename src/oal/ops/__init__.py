"""The OAL operator: positive grouped quadratic attention in linear time (paper Section 4, App. D)."""

from __future__ import annotations

import functools
import logging
import math

import torch

from oal.errors import env_flag
from oal.ops import checks, plans
from oal.ops.checks import BACKENDS, check_errors
from oal.ops.checks import check as _check  # noqa: F401  (the host checks, for callers of the old name)
from oal.ops.checks import compute_dtype as _compute_dtype
from oal.ops.checks import max_abs as _max_abs
from oal.ops.checks import rescaled as _rescaled
from oal.ops.chunked import chunked_attention
from oal.ops.kernel import cached_coefficients, feature_dim
from oal.ops.recurrent import recurrent_attention
from oal.ops.reference import reference_attention

__all__ = ["BACKENDS", "check_errors", "cpu_bf16", "feature_dim", "oal_attention", "split_state", "empty_state"]

DECODE_TOKENS = 4  # `auto` runs at most this many new tokens on top of an initial state with the token loop


log = logging.getLogger("oal")


def _wants_triton(q, v, causal: bool, backend: str, chunk_size) -> bool:
    """Whether the call runs the Triton kernels: asked for (causal; non-causal runs `chunked`) or picked by auto."""
    if backend == "triton":
        return causal
    return backend == "auto" and _auto_triton(q, v, causal, chunk_size)


def _triton_deferred(q, k, v, groups, factor, eps, scale, initial_state, own, output_final_state, chunk_size,
                     sig=None):
    """The Triton kernels with the value checks on the device (`checks.start` ... `checks.finish`) and the overflow
    rescaling applied through device multipliers: no host read. `sig`: the call's signature, under which it keeps
    its plan (`plans.signature` for decoding on the cache's own state, `plans.fresh` for a fresh
    sequence)."""
    from oal.ops.triton import decode_plan, decodes, prefill_plan, triton_attention  # no triton import until used

    dtype = _compute_dtype(q.dtype)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    inplace = own and checks.updatable(initial_state, q, k, v, factor)
    kw = dict(eps=float(eps), scale=scale, initial_state=initial_state, chunk_size=chunk_size,
              need_state=output_final_state, inplace=inplace)
    q, k, v = (t.contiguous() for t in (q, k, v))
    if decodes(q, k, v, factor, initial_state):  # the decoding kernels check their inputs themselves
        chk, status = checks.start_decode(q, factor, initial_state, dtype, eps, check_state=not own)
        plan = decode_plan(q, k, v, groups, factor, eps=float(eps), scale=scale, state=initial_state,
                           chunk_size=chunk_size, inplace=inplace)
        out, final = plan(q, k, v, initial_state, status)
        checks.finish(chk)
        if plan.inplace:
            plans.keep(initial_state, sig, plan)
        return (out, final) if output_final_state else out
    plan = None
    if sig is not None and initial_state is None:
        plan = prefill_plan(q, k, v, groups, factor, eps=float(eps), scale=scale, initial_state=None,
                            need_state=output_final_state, chunk_size=chunk_size)
    if plan is not None:  # a fresh sequence on the parallel route: kept for the next calls of its signature
        plans.keep_fresh(factor, sig, plan)
        return plans.run_fresh(plan, q, k, v, factor, eps)
    chk, mults = checks.start(q, k, v, factor, initial_state, dtype, eps, scale=scale, check_state=not own)
    out, final = triton_attention(q, k, v, groups, factor, rescale=mults, status=chk.status, **kw)
    checks.finish(chk)  # the forward kernels checked their output into the status
    return (out, final) if output_final_state else out


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
    return env_flag("OAL_CPU_BF16", _cpu_has_bf16())


def empty_state(batch: int, n_kv: int, d: int, dv: int, *, dtype=torch.float32, device="cpu"):
    """Zero state [B, Hkv, 1 + d + d(d+1)/2, dv + 1]: rows H0, H1, H2 (packed), last column the denominator."""
    return torch.zeros(batch, n_kv, feature_dim(d), dv + 1, dtype=dtype, device=device)


def split_state(state: torch.Tensor, d: int):
    """Views (H0 [..., dv+1], H1 [..., d, dv+1], H2 [..., d(d+1)/2, dv+1]) of a state tensor."""
    return state[..., 0, :], state[..., 1 : 1 + d, :], state[..., 1 + d :, :]


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """OAL attention: sum_j kappa_ij v_j / sum_j kappa_ij over j <= i (all j when causal=False), with
    kappa_ij = eps + |L^T [1, s_1, ..., s_G]|^2 and s_g = scale * sum_{r in group g} q_ir k_jr (Eq. 7).

    Args:
        q: queries [B, Hq, N, d], floating point (any strides).
        k: keys [B, Hkv, N, d]; Hq a multiple of Hkv (GQA: query head h reads KV head h // (Hq / Hkv)).
        v: values [B, Hkv, N, dv].
        groups: [Hq, d] integer group ids in [0, G): each dimension's group, per query head.
        factor: [Hq, G+1, G+1], L per query head (its lower triangle is read).
        eps: the kernel's floor, a number >= 0 (0 may leave a query with no weight: a ValueError then).
        scale: the scores' scale; None is 1 / sqrt(d).
        causal: True: query i sees keys j <= i; False: every key of the call (and the initial state's).
        backend: `"auto"` (the Triton kernels on CUDA when installed, else the token loop for a few tokens on a
            state and the chunked path otherwise), `"reference"` (dense O(N^2), the oracle), `"recurrent"` (one
            token at a time), `"chunked"` (linear time in chunks) or `"triton"` (CUDA; causal only, non-causal
            runs `chunked`).
        initial_state: a state [B, Hkv, 1 + d + d(d+1)/2, dv + 1] returned by an earlier call with
            `output_final_state=True`: this call continues that sequence.
        output_final_state: also return the state after this call's keys.
        chunk_size: tokens per chunk (chunked backend); None picks it, and short fresh sequences run as one chunk.
            For `triton` a power of two >= 16, 64 by default, and at most 64 on CUDA (`auto` runs `chunked` for
            longer chunks).

    Returns:
        out [B, Hq, N, dv] in q's dtype (k, v and factor are read in q's compute dtype: float64 for float64 q,
        else float32); with `output_final_state`, the tuple (out, final state [B, Hkv, 1 + d + d(d+1)/2, dv + 1]).

    Raises:
        ValueError: bad input, naming the argument (shapes, dtypes, devices, ids out of range, NaN/Inf, a flag
            that is not a bool). On the Triton kernels' path on CUDA the checks of tensor values (NaN/Inf,
            overflow) run on the device and are reported by a later call or by `check_errors()`, so that no call
            waits for the GPU (`oal.ops.checks`; OAL_SYNC_CHECKS=1 reads them in the call itself).
    """
    checks.check_types(q, factor, causal, output_final_state)
    if torch.is_autocast_enabled(q.device.type):
        # autocast would run the torch paths' GEMMs in bf16 after they cast to fp32 on purpose (fp32 states, fp32
        # features while the factor trains): the operator keeps its own precision rules, from its inputs' dtypes
        with torch.autocast(q.device.type, enabled=False):
            return oal_attention(q, k, v, groups, factor, eps=eps, scale=scale, causal=causal, backend=backend,
                                 initial_state=initial_state, output_final_state=output_final_state,
                                 chunk_size=chunk_size)
    if q.dtype in (torch.float16, torch.bfloat16) and torch.is_grad_enabled() and factor.requires_grad:
        # Training the factor: kappa's overall scale drops out of the output (Eq. 7), so its gradient is the small
        # remainder of large terms that cancel, and half-precision features and dots left only noise of it where
        # q/k carry outliers (relative error 0.4-23: tests/test_numerics_outliers.py). Every backend runs fp32 then
        # (the GPU's dots as tf32x3); with the factor frozen (LoRA only, or inference) half inputs stay half.
        res = oal_attention(q.float(), k.float(), v.float(), groups, factor, eps=eps, scale=scale, causal=causal,
                            backend=backend, initial_state=initial_state, output_final_state=output_final_state,
                            chunk_size=chunk_size)
        return (res[0].to(q.dtype), res[1]) if output_final_state else res.to(q.dtype)
    own = checks.owned(initial_state)  # the generation cache's state: checked when it was made, updated in place
    if checks.deferred(q):  # CUDA: no host read on the kernels' path (see oal.ops.checks)
        sig = None
        if own:  # decoding on the cache's state: a plan kept by an earlier call of this signature (oal.ops.plans)
            sig = plans.signature(q, k, v, initial_state, plans.tensor_key(groups), plans.tensor_key(factor), eps,
                                  scale, causal, backend, chunk_size)
            planned = plans.run(q, k, v, factor, eps, initial_state, sig, output_final_state)
            if planned is not None:
                return planned
        elif (initial_state is None and causal and not output_final_state and chunk_size is None
              and backend in ("auto", "triton")):
            sig, planned = plans.fresh(q, k, v, groups, factor, eps, scale, backend)  # a prefill plan (below)
            if planned is not None:
                return planned
        checks.check_shapes(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size)
        if _wants_triton(q, v, causal, backend, chunk_size):
            return _triton_deferred(q, k, v, groups, factor, eps, scale, initial_state, own, output_final_state,
                                    chunk_size, sig)
    # the host checks: every value read before the kernels run (the torch paths need max |q|, |k| as numbers)
    qmax, kmax = checks.check(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size,
                              check_state=not own)
    out_dtype = q.dtype
    dtype = _compute_dtype(q.dtype)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q, factor, eps, scale, _ = _rescaled(q, qmax, kmax, factor.to(dtype), eps, scale, dtype)
    if backend == "triton" and not causal:  # the kernels are causal; the torch path serves the rest
        backend = "chunked"
    if _wants_triton(q, v, causal, backend, chunk_size):
        from oal.ops.triton import triton_attention  # optional dependency, imported on use

        out, final = triton_attention(
            q, k, v, groups, factor, eps=eps, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
            need_state=output_final_state, inplace=own and checks.updatable(initial_state, q, k, v, factor),
        )
        _check_out(out, eps, dtype)
        return (out, final) if output_final_state else out
    coeffs, weights = cached_coefficients(factor, groups, eps, scale)  # once per kernel, not per decoded token
    state = initial_state.to(dtype) if initial_state is not None else None
    if backend == "auto":  # decoding (a few tokens on a state): the token loop has the least set-up
        backend = "recurrent" if state is not None and q.shape[2] <= DECODE_TOKENS else "chunked"
    if q.numel() == 0 or k.numel() == 0:  # N = 0 or B = 0: an empty result (and the state unchanged)
        backend = "reference"
    # bf16 inputs keep bf16 features and GEMMs (fp32 accumulation inside the GEMM) where the hardware has bf16
    # GEMMs (`cpu_bf16`; GPUs do), unless the factor is trained (above); states stay in `dtype`
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
            inplace = own and state is initial_state and checks.updatable(state, q, k, v, factor)
            out, final = recurrent_attention(q, k, v, coeffs, scale=scale, causal=causal, state=state, weights=weights,
                                             inplace=inplace)
        else:
            out, final = chunked_attention(
                q, k, v, groups, factor, coeffs, eps=eps, scale=scale, causal=causal, state=state,
                state_is_zero=fresh and chunk_size is None, need_state=output_final_state, chunk_size=chunk_size,
                weights=weights,
            )
    _check_out(out, eps, dtype)
    out = out.to(out_dtype)
    return (out, final) if output_final_state else out


def _check_out(out: torch.Tensor, eps: float, dtype: torch.dtype) -> None:
    """Never a silent NaN: the inputs were finite, so a non-finite output gets a ValueError saying why."""
    try:
        _max_abs("out", out)
    except ValueError:
        raise ValueError(checks.out_message(eps, dtype)) from None
