"""GPU kernels for OAL attention in Triton (optional: the `gpu` extra).

Importing this package does not import triton; `triton_attention` does, on first use. Under TRITON_INTERPRET=1
(set before this package's kernels are first imported) the kernels run on CPU tensors through Triton's
interpreter, which is how the tests exercise them without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from oal.ops.triton import routes
from oal.ops.triton.routes import decodes
from oal.ops.triton.tiles import SHARED_LIMIT, device_arch, device_shared, refusal

__all__ = ["available", "decode_plan", "decodes", "interpreted", "prefill_plan", "refusal", "triton_attention",
           "unsupported"]

INSTALL_HINT = "install the gpu extra: pip install 'oal-attention[gpu]'"


def available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1 when they were defined)."""
    if f"{__name__}.kernels" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    from oal.ops.triton.function import interpreted as defined_interpreted

    return defined_interpreted()


def unsupported(q, v, chunk_size=None) -> str | None:
    """Why the kernels cannot take these inputs (None when they can); `auto` then runs the torch path.

    On CUDA: the shapes and dtypes whose tiles do not fit the device's shared memory (tiles.refusal), chunks longer
    than the 64 tokens the tiles are checked for, and devices with less shared memory per block than the A100
    (163 KB).
    """
    d, dv = q.shape[-1], v.shape[-1]
    if q.device.type != "cuda":  # the interpreter has no shared-memory limit
        return refusal(d, dv, torch.float32, 90) if max(d, dv) > 128 else None
    if chunk_size is not None and chunk_size > 64:
        return f"chunk_size: the triton backend's tiles are checked for chunks of up to 64 tokens, got {chunk_size}"
    arch = device_arch(q.device)
    name, shared = device_shared(q.device)
    if shared < SHARED_LIMIT[arch]:
        return (f"q: the triton backend's tiles need {SHARED_LIMIT[arch] // 1024} KB of shared memory per block "
                f"(as on A100, H100), {name} has {shared // 1024} KB")
    return refusal(d, dv, q.dtype, arch)


def _usable(q, v, chunk_size) -> None:
    """A ValueError naming the argument where the kernels cannot run these inputs."""
    if not available():
        raise ValueError(f"backend: 'triton' needs the triton package; {INSTALL_HINT}")
    if q.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"backend: 'triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1), got device {q.device}"
        )
    reason = unsupported(q, v, chunk_size)
    if reason:
        raise ValueError(reason)
    if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size: the triton backend needs a power of two >= 16, got {chunk_size}")


def triton_attention(q, k, v, groups, factor, *, eps, scale, initial_state=None, chunk_size=None, need_state=True,
                     rescale=None, inplace=False, status=None):
    """Causal OAL attention on the Triton kernels. Inputs validated by `oal_attention` (`oal.ops.checks`).

    Returns (out [B, Hq, N, dv] in q's dtype, final state [B, Hkv, F, dv+1] in fp32, fp64 for fp64 inputs; None
    when not `need_state` on a fresh sequence). `rescale`, `inplace`, `status`: see `function.triton_forward`.
    """
    _usable(q, v, chunk_size)
    from oal.ops.triton.function import triton_forward

    return triton_forward(q, k, v, groups, factor, eps=eps, scale=scale, initial_state=initial_state,
                          chunk_size=chunk_size, need_state=need_state, rescale=rescale, inplace=inplace, status=status)


def decode_plan(q, k, v, groups, factor, *, eps, scale, state, chunk_size=None, inplace=False):
    """The decoding kernels' plan for a few tokens on `state` (`decodes`; inputs validated by `oal_attention`):
    `plan(q, k, v, state, status)` returns (out, the updated state) as `triton_attention` would, and runs again for
    the next calls of the same signature (`oal.ops.plans`)."""
    _usable(q, v, chunk_size)
    from oal.ops.triton.decode import Plan

    return Plan(q, k, v, groups, factor, eps, scale, state, inplace)


def prefill_plan(q, k, v, groups, factor, *, eps, scale, initial_state, need_state, chunk_size):
    """The parallel route's plan for a fresh sequence (`prefill.Plan`; inputs validated by `oal_attention`), or None
    where the call takes another route: `plan(q, k, v, factor, chk)` returns the output as `triton_attention`
    would, and runs again for the next calls of the same signature (`oal.ops.plans.fresh`)."""
    if not routes.parallel(q.shape[2], initial_state, need_state, chunk_size) or q.shape[0] == 0:
        return None
    _usable(q, v, chunk_size)
    from oal.ops.triton.prefill import Plan

    return Plan(q, k, v, groups, factor, eps, scale)
