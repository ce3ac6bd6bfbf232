"""Decoding calls that repeat: the cache's own state, the same shapes and kernel, one token after another.

Every such call validates the same shapes, looks up the same coefficients and works out the same grids and
scratch buffers. On a GPU at batch 1 that host work, not the kernels, is most of a decoding step
(docs/performance/gpu.md). So the first call of a signature takes the full path and keeps a plan (what its launches
need: `triton.decode.Plan`, `triton.window_decode.Plan`); the next calls with the same signature run the plan.

The signature holds everything the full path's checks and choices read: shapes, dtypes and device of q, k, v and
the state, the kernel's tensors (identity, shape and version counter: an in-place write, e.g. a training step,
makes a new plan), the options, and on CUDA the current stream (a plan's scratch buffers are reused, which is safe
in one stream's order). A plan is kept per state tensor (the cache updates its own state in place, so a layer's
state is one tensor for a whole generation) and dropped with it; it holds no reference to the state.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from oal.ops import checks
from oal.ops.kernel import version

_PLANS = WeakIdKeyDictionary()  # the cache's own state -> (signature, plan)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a signature holds of a kernel tensor: identity, shape and (version counter, address). Anything else is
    held by identity (the full path refuses it, so no plan is kept for it)."""
    if not isinstance(t, torch.Tensor):
        return None if t is None else ("not a tensor", id(t))
    return id(t), t.shape, version(t)


def signature(q, k, v, state, *options) -> tuple | None:
    """The signature of a decoding call on `state` (see the module docstring); `options`: the call's other
    arguments (kernel tensors through `tensor_key`). None for inputs that are not tensors (the full path names
    them)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    sig = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, state.shape, state.dtype,
           state.is_contiguous(), *options)
    if q.device.type == "cuda":
        sig += (torch.cuda.current_stream(q.device).cuda_stream,)
    return sig


def get(state: torch.Tensor, sig: tuple | None):
    """The plan kept for `state` if it was made for `sig`, else None."""
    hit = _PLANS.get(state) if sig is not None else None
    return hit[1] if hit is not None and hit[0] == sig else None


def keep(state: torch.Tensor, sig: tuple | None, plan) -> None:
    if sig is not None:
        _PLANS[state] = (sig, plan)


def run(q, k, v, factor, eps: float, state: torch.Tensor, sig: tuple | None, output_final_state: bool):
    """A decoding call on the cache's own `state` that an earlier call of signature `sig` kept a plan for: the plan
    run, its checks in the shared status (`checks.decode_check`); returns what the operator returns, or None
    without a plan (or where the state may not be updated in place now: the full path decides)."""
    plan = get(state, sig)
    if plan is None or not checks.updatable(state, q, k, v, factor):
        return None
    chk = checks.decode_check(q.device, checks.compute_dtype(q.dtype), eps, factor is not None)
    out, final = plan(q.contiguous(), k.contiguous(), v.contiguous(), state, chk.status)
    checks.finish(chk)
    return (out, final) if output_final_state else out
