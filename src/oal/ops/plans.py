"""Calls that repeat: decoding on the cache's own state, one token after another, and fresh sequences of one length.

Every such call validates the same shapes, looks up the same coefficients and works out the same grids and
scratch buffers. On a GPU at batch 1 that host work, not the kernels, is most of a decoding step
(docs/design/gpu-kernels.md). So the first call of a signature takes the full path and keeps a plan (what its launches
need: `triton.decode.Plan`, `triton.window_decode.Plan`); the next calls with the same signature run the plan.

The signature holds everything the full path's checks and choices read: shapes, dtypes and device of q, k, v and
the state, the kernel's tensors (identity, shape and version counter: an in-place write, e.g. a training step,
makes a new plan), the options, and on CUDA the current stream (a plan's scratch buffers are reused, which is safe
in one stream's order). A plan is kept per state tensor (the cache updates its own state in place, so a layer's
state is one tensor for a whole generation) and dropped with it; it holds no reference to the state.

A fresh sequence's forward without a gradient on the parallel kernels (a prefill, an evaluation, a benchmark at
one length) keeps its plan (`triton.prefill.Plan`) per factor tensor, one per layer of a model, for the last
length it saw: a model's calls at that length run their plans (`fresh`, `run_fresh`). A plan is made
by the second call in a row at a length, not the first, so that calls whose lengths keep changing (an
evaluation's batches) neither build plans nor work out signatures they would never use: they pay one lookup.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from oal.ops import checks
from oal.ops.kernel import version
from oal.ops.triton import routes

_PLANS = WeakIdKeyDictionary()  # the cache's own state -> (signature, plan)
_FRESH = WeakIdKeyDictionary()  # factor -> [length, signature, plan] of its last fresh-sequence forward


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
    return _inputs(q, k, v, state.shape, state.dtype, state.is_contiguous(), *options)


def _inputs(q, k, v, *options) -> tuple | None:
    """The signature's common part; None where an option is a tensor (eps, scale: the full path refuses it, and a
    signature compared with `==` would read its value)."""
    if any(isinstance(o, torch.Tensor) for o in options):
        return None
    sig = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, *options)
    if q.device.type == "cuda":
        sig += (torch.cuda.current_stream(q.device).cuda_stream,)
    return sig


def fresh(q, k, v, groups, factor, eps, scale, backend) -> tuple[tuple | None, torch.Tensor | None]:
    """(signature, output) of a fresh sequence's forward: the output of the plan an earlier call of this signature
    kept (on `factor`), or None; the signature under which the full path keeps one, or None where no plan may run
    or be kept: a gradient, more than `routes.PARALLEL_MAX` tokens (read now: the parallel kernels' route), or a
    length other than the factor's last fresh call's (this call records its length). The caller asks only for
    causal calls without a state, a final state or a chunk size."""
    tensors = (q, k, v, factor)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or q.dim() != 4:
        return None, None  # (bad input: the full path names it)
    n = q.shape[2]
    if not 0 < n <= routes.PARALLEL_MAX:
        return None, None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None, None  # training: autograd's path
    hit = _FRESH.get(factor)
    if hit is None:
        _FRESH[factor] = [n, None, None]
        return None, None
    if hit[0] != n:
        hit[:] = n, None, None  # in place: one lookup a call while the lengths keep changing
        return None, None
    sig = _inputs(q, k, v, tensor_key(groups), tensor_key(factor), torch.is_inference_mode_enabled(), eps, scale,
                  backend)
    if sig is None or hit[1] != sig:
        return sig, None
    return sig, run_fresh(hit[2], q, k, v, factor, eps)


def run_fresh(plan, q, k, v, factor, eps: float) -> torch.Tensor:
    """A fresh sequence's forward on `plan` (`triton.prefill.Plan`), under the call's own device check."""
    chk = checks.begin(q.device, checks.compute_dtype(q.dtype), eps)
    out = plan(q.contiguous(), k.contiguous(), v.contiguous(), factor, chk)
    checks.finish(chk)
    return out


def keep_fresh(factor: torch.Tensor, sig: tuple | None, plan) -> None:
    if sig is not None:
        _FRESH[factor] = [sig[0][2], sig, plan]  # the length: q.shape[2] (q.shape leads a signature)


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
