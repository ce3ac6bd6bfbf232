"""bf16 arithmetic of the Triton kernels on a GPU, at N = 16k and the paper-scale head (d = dv = 128).

Triton's CPU interpreter cannot multiply bf16, so under it the kernels take fp32 dots and tests/test_triton.py
checks no bf16 arithmetic. This test does, on CUDA only (scripts/gpu_perf.sh runs it): the kernels' bf16 output
and gradients against the fp64 torch path on the same bf16-rounded inputs, beside bf16 SDPA (flash) against fp64
softmax attention on the same inputs. Both errors are printed; the kernels must stay within a small factor of
SDPA's, so that rounding the features or states to bf16 in the dots costs no more than a softmax kernel loses.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from oal.ops import oal_attention  # noqa: E402

F64 = torch.float64
B, HQ, HKV, N, D, G = 1, 4, 1, 16384, 128, 5
# Rounding the output alone to bf16 costs about 1e-3 (relative, in norm); SDPA measures 1e-3 to 4e-3. The kernels
# round features and states to bf16 before each dot and accumulate in fp32; they may lose up to FACTOR times
# SDPA's error, and never more than CAP (first bounds, to tighten once measured on a GPU).
FACTOR, CAP = 8.0, 2e-2


def rel_err(got, want):
    got, want = got.detach().to(F64), want.detach().to(F64)
    return float((got - want).norm() / want.norm())


def inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HQ, N, D, generator=gen, device="cuda").bfloat16()
    k = torch.randn(B, HKV, N, D, generator=gen, device="cuda").bfloat16()
    v = torch.randn(B, HKV, N, D, generator=gen, device="cuda").bfloat16()
    q[..., 3] *= 8  # an outlier dimension, as in pretrained heads: large kappa
    k[..., 3] *= 8
    groups = torch.randint(0, G - 1, (HQ, D), generator=gen, device="cuda")  # the last id unused
    factor = torch.randn(HQ, G + 1, G + 1, generator=gen, device="cuda") * 0.5
    dout = torch.randn(B, HQ, N, D, generator=gen, device="cuda")
    return q, k, v, groups, factor, dout


def grads(fn, dtype, q, k, v, dout):
    """Output and the gradients of (out . dout) for q, k, v, on leaves cast to dtype."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return [out, *torch.autograd.grad((out.to(F64) * dout.to(F64)).sum(), leaves)]


def errors(fn, q, k, v, dout):
    got = grads(fn, torch.bfloat16, q, k, v, dout)
    want = grads(fn, F64, q, k, v, dout)
    return dict(zip(("out", "dq", "dk", "dv"), (rel_err(g, w) for g, w in zip(got, want, strict=True)), strict=True))


def test_bf16_at_16k_is_within_a_small_factor_of_sdpa():
    q, k, v, groups, factor, dout = inputs()

    def oal(q_, k_, v_):  # bf16 on the kernels; fp64 on the chunked torch path (the kernels refuse fp64 on CUDA)
        backend = "triton" if q_.dtype == torch.bfloat16 else "chunked"
        return oal_attention(q_, k_, v_, groups, factor.to(q_.dtype if q_.dtype == F64 else torch.float32),
                             backend=backend)

    def sdpa(q_, k_, v_):  # bf16 on the flash kernel; fp64 on the math kernel
        backend = SDPBackend.FLASH_ATTENTION if q_.dtype == torch.bfloat16 else SDPBackend.MATH
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True,
                                                                    scale=1 / math.sqrt(D))

    oal_err = errors(oal, q, k, v, dout)
    sdpa_err = errors(sdpa, q, k, v, dout)
    print(f"bf16 at N={N}, d=dv={D}, Hq={HQ}, Hkv={HKV}: relative error against fp64 (norm)")
    for name in oal_err:
        print(f"  {name:3s}  oal triton {oal_err[name]:.2e}  sdpa flash {sdpa_err[name]:.2e}  "
              f"ratio {oal_err[name] / sdpa_err[name]:.2f}")
    bad = {name: err for name, err in oal_err.items() if not (err <= FACTOR * sdpa_err[name] and err <= CAP)}
    assert not bad, f"bf16 kernel errors above {FACTOR} x SDPA's or {CAP}: {bad} (SDPA: {sdpa_err})"
