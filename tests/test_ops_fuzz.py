"""Fuzzing the attention paths a user reaches on the CPU against their dense references, outputs and gradients.

Every path against its oracle over the awkward corners: sequence lengths 1, 2, primes and just around the chunk
(32), the dense limit (256) and the block (512); odd and non-power-of-two head dims; GQA ratios 1, 2 and 7;
batches; G = 1 and G = d; causal and not; a state carried across calls (prefill, then a few tokens, then one at a
time, must equal one full causal call); sliding windows larger than the sequence, of one token, with and without
sinks; half inputs; huge but finite q/k; empty inputs. Paths: `chunked` (its torch path in float64, the fused CPU
kernel in float32 inference), `recurrent` (the torch token loop, and the C decoding step in float32), the window
operator's banded and token-loop paths, the Triton kernels under TRITON_INTERPRET=1 (tiny sizes), including the
decoding kernels of a device whose checks are deferred, and every registered method's `forward` against its
`reference`.

Hypothesis runs derandomized (the same examples every run) with a few dozen examples per property.

Tolerances. float64: the contract's 1e-10 (design.md: all backends agree to 1e-10). float32 paths against the
float64 reference: each output is a ratio of sums of at most N * F float32 products (F = 1 + d + d(d+1)/2); we see
relative errors (norm over the tensor) of 1e-7 to 3e-7, so 1e-4 leaves a factor of 300 for other shapes while a
wrong index or a missing term gives an error of order 1. Half inputs: the output is rounded to the input dtype
(relative 2^-9 for bf16, 2^-12 for fp16 per entry); we see 2.2e-3 and 3.6e-4 against the float64 reference on the
rounded inputs, and bound them by 1e-2 and 2e-3.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oal.ops.chunked as chunked
from oal.methods.base import build_method, get_method, method_names
from oal.ops import checks, cpu_kernel, oal_attention
from oal.ops.kernel import perturbed_factor, taylor_factor
from oal.ops.window import sequence_state, window_attention

F64 = torch.float64
F32_TOL = 1e-4
FUZZ = settings(max_examples=30, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))
# lengths: 1, 2, primes, around the chunk (32) and the dense limit (256), past the block (512)
LENGTHS = [1, 2, 3, 5, 7, 13, 17, 31, 32, 33, 63, 65, 127, 255, 257, 521]


def make(b, hq, hkv, n, d, dv, g, seed):
    """Random q, k, v (float64), group ids using every id, and a factor near the Taylor kernel (scale of e^s)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=F64)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=F64)
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = perturbed_factor(taylor_factor(hq, g, dtype=F64), 0.3, generator=gen)
    return q, k, v, groups, factor


def rel(got, want, floor=0.0):
    """Relative error in norm; `floor` (rms per entry) for references that vanish (dq and dL at N = 1, where the
    output is v whatever q is)."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    return float((got - want).norm() / max(float(want.norm()), floor * math.sqrt(want.numel()), 1e-300))


@st.composite
def shapes(draw, max_n=None):
    """(b, hq, hkv, n, d, dv, g): GQA 1, 2 or 7, G = 1, 2 or d."""
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 7]))
    n = draw(st.sampled_from([x for x in LENGTHS if max_n is None or x <= max_n]))
    d = draw(st.sampled_from([1, 3, 5, 8, 12]))
    g = draw(st.sampled_from(sorted({1, 2, d})))
    return draw(st.sampled_from([1, 2])), hq, hkv, n, d, draw(st.sampled_from([1, 3, 8])), g


def _splits(draw, n):
    """Cut points 0 < ... < n: a prefill, then pieces of a few tokens and single tokens."""
    cuts = {0, n}
    if n > 1:
        cuts |= set(draw(st.lists(st.integers(1, n - 1), max_size=4)))
    return sorted(cuts)


# ------------------------------------------------------------------------------------- the OAL operator, CPU


@FUZZ
@given(shape=shapes(), causal=st.booleans(), chunk=st.sampled_from([None, 1, 7, 16, 32]), seed=st.integers(0, 99))
def test_backends_match_reference_float64(shape, causal, chunk, seed):
    """chunked (torch path), recurrent and auto against the dense reference: outputs and final states."""
    b, hq, hkv, n, d, dv, g = shape
    q, k, v, groups, factor = make(*shape, seed)
    ref, ref_state = oal_attention(q, k, v, groups, factor, backend="reference", causal=causal,
                                   output_final_state=True)
    for backend in ["chunked", "auto"] + (["recurrent"] if n <= 65 else []):
        out, state = oal_attention(q, k, v, groups, factor, backend=backend, causal=causal, chunk_size=chunk,
                                   output_final_state=True)
        assert out.dtype == F64 and out.shape == (b, hq, n, dv)
        assert rel(out, ref) < 1e-10 and rel(state, ref_state) < 1e-10, (backend, shape, causal, chunk)


@FUZZ
@given(shape=shapes(max_n=257), causal=st.booleans(), chunk=st.sampled_from([None, 1, 16]),
       with_state=st.booleans(), seed=st.integers(0, 99))
def test_gradients_match_reference_float64(shape, causal, chunk, with_state, seed):
    """Gradients of q, k, v, the factor and the initial state, through the output and the final state."""
    b, hq, hkv, n, d, dv, g = shape
    q, k, v, groups, factor = make(*shape, seed)
    init = None
    if with_state:
        qq, kk, vv, _, _ = make(b, hq, hkv, 4, d, dv, g, seed + 1)
        init = oal_attention(qq, kk, vv, groups, factor, backend="reference", output_final_state=True)[1]

    def grads(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, factor)] + ([init.clone().requires_grad_()]
                                                                             if with_state else [])
        out, state = oal_attention(*leaves[:3], groups, leaves[3], backend=backend, causal=causal, chunk_size=chunk,
                                   initial_state=leaves[4] if with_state else None, output_final_state=True)
        gen = torch.Generator().manual_seed(seed)
        loss = (out * torch.randn(out.shape, generator=gen, dtype=F64)).sum() + \
            1e-2 * (state * torch.randn(state.shape, generator=gen, dtype=F64)).sum()
        return torch.autograd.grad(loss, leaves)

    want = grads("reference")
    for backend in ["chunked"] + (["recurrent"] if n <= 65 else []):
        for name, got, ref in zip(["q", "k", "v", "factor", "state"], grads(backend), want, strict=False):
            assert rel(got, ref, floor=1e-4) < 1e-9, (backend, name, shape, causal, chunk)


def test_gradcheck_tiny_odd_shapes():
    """torch.autograd.gradcheck of the chunked path (checkpointed blocks) at a prime length over two chunks, d odd,
    GQA 2, G = d, with an initial state."""
    q, k, v, groups, factor = make(1, 2, 1, 5, 3, 2, 3, seed=3)
    init = oal_attention(*make(1, 2, 1, 3, 3, 2, 3, seed=4)[:3], groups, factor, backend="reference",
                         output_final_state=True)[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, factor, init)]

    def fn(q, k, v, factor, init):
        return oal_attention(q, k, v, groups, factor, backend="chunked", chunk_size=3, initial_state=init,
                             output_final_state=True)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, fast_mode=True)


@FUZZ
@given(shape=shapes(), data=st.data(), seed=st.integers(0, 99))
def test_prefill_then_decode_equals_one_call(shape, data, seed):
    """A state carried across calls of random lengths (auto: the token loop for <= 4 tokens, chunked otherwise),
    in float64 (torch) and float32 inference (the fused kernel and the C decoding step): one causal call."""
    q, k, v, groups, factor = make(*shape, seed)
    ref, ref_state = oal_attention(q, k, v, groups, factor, backend="reference", output_final_state=True)
    cuts = _splits(data.draw, shape[3])
    for dtype, tol in ((F64, 1e-10), (torch.float32, F32_TOL)):
        with torch.inference_mode(dtype == torch.float32):
            outs, state = [], None
            for a, z in zip(cuts, cuts[1:], strict=False):
                backend = data.draw(st.sampled_from(["auto", "chunked", "recurrent"] if z - a <= 65 else ["auto"]))
                out, state = oal_attention(*(t[:, :, a:z].to(dtype) for t in (q, k, v)), groups, factor.to(dtype),
                                           backend=backend, initial_state=state, output_final_state=True)
                outs.append(out)
        assert rel(torch.cat(outs, dim=2), ref) < tol and rel(state, ref_state) < tol, (dtype, shape, cuts)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused CPU kernel's readouts and C decoding steps; scratch buffers NaN-filled."""
    if not cpu_kernel.available():
        pytest.skip("no C++ compiler: the fused CPU kernel is not built")
    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)
    seen = {"readout": 0, "decode": 0}
    for name in seen:
        real = getattr(cpu_kernel, name)
        monkeypatch.setattr(cpu_kernel, name, lambda *a, _real=real, _name=name, **kw: (
            seen.__setitem__(_name, seen[_name] + 1), _real(*a, **kw))[1])
    return seen


# b, hq, hkv, n, d, dv, g, chunk: odd d and dv, GQA 7, G = d, lengths past the dense limit and the block
FUSED = [(2, 7, 1, 257, 5, 3, 5, 16), (1, 4, 2, 521, 8, 8, 2, None), (2, 2, 2, 33, 12, 1, 1, 32),
         (1, 2, 1, 130, 3, 5, 3, 48)]


@pytest.mark.parametrize("case", FUSED, ids=[f"n{c[3]}-d{c[4]}-hq{c[1]}hkv{c[2]}" for c in FUSED])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_cpu_kernel_matches_reference(fused_calls, case, causal):
    """float32 inference runs the fused readout (and its intra-chunk term) and the C decoding step; both agree
    with the float64 reference, from a fresh sequence and from a state."""
    b, hq, hkv, n, d, dv, g, chunk = case
    q, k, v, groups, factor = make(b, hq, hkv, n, d, dv, g, seed=n)
    ref = oal_attention(q, k, v, groups, factor, backend="reference", causal=causal)
    f32 = [t.float() for t in (q, k, v)]
    with torch.inference_mode():
        out = oal_attention(*f32, groups, factor.float(), causal=causal, chunk_size=chunk)
        assert rel(out, ref) < F32_TOL
        if causal:  # a prefill with its state, then three single tokens on the C decoding step
            p = n - 3
            head, state = oal_attention(*(t[:, :, :p] for t in f32), groups, factor.float(), chunk_size=chunk,
                                        output_final_state=True)
            tail = []
            for i in range(p, n):
                o, state = oal_attention(*(t[:, :, i : i + 1] for t in f32), groups, factor.float(),
                                         initial_state=state, output_final_state=True)
                tail.append(o)
            assert rel(torch.cat([head, *tail], dim=2), ref) < F32_TOL
    # non-causal blocks run fused where their length is whole vectors (here the first 512 of 521 tokens)
    assert (fused_calls["readout"] > 0) == (causal or n > 512) and (fused_calls["decode"] > 0) == causal


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("train_factor", [False, True])
def test_half_inputs(dtype, tol, train_factor):
    """Half inputs (bf16 GEMMs where the CPU has them; fp32 while the factor trains) give outputs in their dtype,
    within rounding of the float64 reference on the rounded inputs, on every backend and across a state."""
    q, k, v, groups, factor = make(2, 7, 1, 300, 5, 3, 5, seed=1)
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    ref = oal_attention(qh.double(), kh.double(), vh.double(), groups, factor, backend="reference")
    f = factor.float().requires_grad_(train_factor)
    for backend in ("chunked", "recurrent", "auto"):
        out = oal_attention(qh, kh, vh, groups, f, backend=backend)
        assert out.dtype == dtype and rel(out, ref) < tol, backend
    head, state = oal_attention(qh[:, :, :297], kh[:, :, :297], vh[:, :, :297], groups, f, output_final_state=True)
    tail = oal_attention(qh[:, :, 297:], kh[:, :, 297:], vh[:, :, 297:], groups, f, initial_state=state)
    assert rel(torch.cat([head, tail], dim=2), ref) < tol


@pytest.mark.parametrize("q_scale,k_scale", [(1e4, 1e4), (1e8, 10.0), (1e12, 1e-6), (1e-10, 1e-10), (1e9, 1e9),
                                             (1e15, 1e15)])
def test_huge_and_tiny_inputs_float32(q_scale, k_scale):
    """q and k scaled far from 1 (the exact rescaling of Eq. 7 where the scores would overflow): every float32 path,
    one call and prefill + decode, agrees with the float64 reference."""
    q, k, v, groups, factor = make(2, 4, 2, 70, 5, 3, 3, seed=0)
    q, k = q * q_scale, k * k_scale
    ref = oal_attention(q, k, v, groups, factor, backend="reference")
    f32 = [t.float() for t in (q, k, v)]
    with torch.inference_mode():
        for backend in ("reference", "chunked", "recurrent"):
            assert rel(oal_attention(*f32, groups, factor.float(), backend=backend, chunk_size=16), ref) < F32_TOL
        head, state = oal_attention(*(t[:, :, :67] for t in f32), groups, factor.float(), output_final_state=True)
        tail = oal_attention(*(t[:, :, 67:] for t in f32), groups, factor.float(), initial_state=state)
    assert rel(torch.cat([head, tail], dim=2), ref) < F32_TOL


# ---------------------------------------------------------------------------------------- sliding windows


@st.composite
def window_cases(draw):
    """(shape, window, sinks, kernel): windows of one token, shorter and longer than the sequence; no sinks, a few,
    more than the sequence."""
    shape = draw(shapes(max_n=257))
    return shape, draw(st.sampled_from([1, 2, 5, 33, 300])), draw(st.sampled_from([0, 1, 4, 300])), draw(st.booleans())


@FUZZ
@given(case=window_cases(), data=st.data(), seed=st.integers(0, 99))
def test_window_paths_match_reference_across_calls(case, data, seed):
    """swa and oal-swa: banded, the token loop and auto (the C loop in float32 inference), a state carried across
    calls of random lengths, against the dense reference and the state built from its definition."""
    shape, window, sinks, kernel = case
    q, k, v, groups, factor = make(*shape, seed)
    kw = dict(window=window, sinks=sinks, **(dict(groups=groups) if kernel else {}))
    ref = window_attention(q, k, v, backend="reference", **kw, **(dict(factor=factor) if kernel else {}))
    ref_state = sequence_state(k, v, window, sinks, kernel)
    cuts = _splits(data.draw, shape[3])
    for dtype, tol in ((F64, 1e-10), (torch.float32, F32_TOL)):
        fkw = dict(factor=factor.to(dtype)) if kernel else {}
        with torch.inference_mode(dtype == torch.float32):
            outs, state = [], None
            for a, z in zip(cuts, cuts[1:], strict=False):
                backend = data.draw(st.sampled_from(["auto", "banded"] + (["recurrent"] if z - a <= 33 else [])))
                out, state = window_attention(*(t[:, :, a:z].to(dtype) for t in (q, k, v)), backend=backend,
                                              initial_state=state, output_final_state=True,
                                              chunk_size=data.draw(st.sampled_from([None, 1, 3, 8])), **kw, **fkw)
                outs.append(out)
        assert rel(torch.cat(outs, dim=2), ref) < tol and rel(state, ref_state) < tol, (dtype, case, cuts)


@settings(max_examples=20, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=window_cases(), chunk=st.sampled_from([None, 1, 3, 8]), seed=st.integers(0, 99))
def test_window_gradients_match_reference(case, chunk, seed):
    shape, window, sinks, kernel = case
    if shape[3] > 65:
        shape = (*shape[:3], 65, *shape[4:])
    q, k, v, groups, factor = make(*shape, seed)

    def grads(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, factor)]
        kw = dict(groups=groups, factor=leaves[3]) if kernel else {}
        out = window_attention(*leaves[:3], window=window, sinks=sinks, backend=backend, chunk_size=chunk, **kw)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
        wrt = leaves[: 4 if kernel else 3]
        got = torch.autograd.grad((out * weight).sum(), wrt, allow_unused=True)  # None: the factor is not reached
        return [torch.zeros_like(t) if g is None else g for g, t in zip(got, wrt, strict=True)]

    want = grads("reference")
    for backend in ("banded", "recurrent"):
        for name, got, ref in zip("q k v factor".split(), grads(backend), want, strict=False):
            assert rel(got, ref, floor=1e-4) < 1e-9, (backend, name, case, chunk)


# ------------------------------------------------------------------------------------------------ methods


def _build(name, hq, hkv, d, *, seed=0, groups=None):
    """`name` for a layer of these heads: a window of 3 tokens and 1 sink where it takes them, the groups where it
    uses them."""
    cls = get_method(name)
    kw = {key: val for key, val in (("window", 3), ("sinks", 1)) if key in cls.settings}
    if cls.uses_groups and groups is not None:
        kw["groups"] = groups
    return build_method(name, hq, hkv, d, seed=seed, **kw)


@settings(max_examples=36, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(method_names()), shape=shapes(max_n=130),
       causal=st.booleans(), seed=st.integers(0, 99))
def test_methods_forward_matches_reference(name, shape, causal, seed):
    """Every method's linear-time forward against its dense reference (float64; outputs and every gradient,
    the trainable kernel parameters included), and prefill + single tokens on its state equal one causal call."""
    b, hq, hkv, n, d, _, g = shape
    method = _build(name, hq, hkv, d, seed=seed, groups=torch.randint(0, g, (hq, d))).double()
    causal = causal or method.positional
    with torch.no_grad():  # move the parameters off their initial values (zero theta, unit tau, Taylor factor)
        for p in method.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed), dtype=p.dtype))
    q, k, v = make(b, hq, hkv, n, d, d, g, seed)[:3]

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, causal=causal)
        params = [p for p in method.parameters() if p.requires_grad]
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
        wrt = leaves + params
        got = torch.autograd.grad((out * weight).sum(), wrt, allow_unused=True)  # None: not reached (N = 1)
        return [out, *(torch.zeros_like(t) if g is None else g for g, t in zip(got, wrt, strict=True))]

    for got, want in zip(run(method), run(method.reference), strict=True):
        assert rel(got, want, floor=1e-4) < 1e-8, (name, shape, causal)
    if method.supports_state and causal and n > 1:
        with torch.no_grad():
            out, state = method(q[:, :, :-2], k[:, :, :-2], v[:, :, :-2], output_final_state=True)
            outs = [out]
            for i in (n - 2, n - 1):
                out, state = method(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], initial_state=state,
                                    output_final_state=True)
                outs.append(out)
            assert rel(torch.cat(outs, dim=2), method.reference(q, k, v)) < 1e-9, (name, shape)


@pytest.mark.parametrize("name", method_names())
@pytest.mark.parametrize("b,n", [(0, 5), (2, 0)])
def test_methods_take_empty_inputs(name, b, n):
    """An empty batch or sequence gives an empty output (performer's key features raised a torch error: a reshape
    with -1 of zero elements), and a state that continues."""
    method = _build(name, 4, 2, 8)
    q, k, v = torch.randn(b, 4, n, 8), torch.randn(b, 2, n, 8), torch.randn(b, 2, n, 8)
    assert method(q, k, v).shape == (b, 4, n, 8)
    if method.supports_state:
        out, state = method(q, k, v, output_final_state=True)
        assert method(q, k, v, initial_state=state).shape == (b, 4, n, 8)


# --------------------------------------------------------------------- Triton (the interpreter on the CPU)

def _triton_device():
    """The Triton kernels' device here (conftest sets TRITON_INTERPRET=1 without CUDA), or skip."""
    import oal.ops.triton as oal_triton

    device = os.environ.get("OAL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if not oal_triton.available() or (device == "cpu" and not oal_triton.interpreted()):
        pytest.skip("the Triton kernels cannot run here (no CUDA, no interpreter)")
    return device


# b, hq, hkv, n, d, dv, g, state, final: n 1 and 2 (the parallel route), primes over one and two 16-token chunks,
# d odd, GQA 7, G = d, decoding (<= 4 tokens on a state)
TRITON_CASES = [(1, 1, 1, 1, 3, 1, 1, False, False), (2, 2, 1, 2, 5, 3, 5, True, True),
                (1, 7, 1, 17, 5, 3, 2, True, True), (2, 2, 2, 33, 12, 5, 12, False, True),
                (2, 4, 2, 3, 7, 16, 3, True, False)]


@pytest.mark.parametrize("case", TRITON_CASES, ids=[f"n{c[3]}-d{c[4]}-hq{c[1]}hkv{c[2]}" for c in TRITON_CASES])
def test_triton_matches_reference_outputs_and_gradients(case):
    device = _triton_device()
    b, hq, hkv, n, d, dv, g, with_state, final = case
    q, k, v, groups, factor = make(b, hq, hkv, n, d, dv, g, seed=n)
    init = None
    if with_state:
        init = oal_attention(*make(b, hq, hkv, 5, d, dv, g, seed=7)[:3], groups, factor, backend="reference",
                             output_final_state=True)[1]

    def run(backend, dtype, grad):
        leaves = [t.to(device, dtype).requires_grad_(grad) for t in (q, k, v, factor)]
        st0 = None if init is None else init.to(device, dtype).requires_grad_(grad)
        res = oal_attention(*leaves[:3], groups.to(device), leaves[3], backend=backend, initial_state=st0,
                            output_final_state=final, chunk_size=16 if backend == "triton" else None)
        out, state = res if final else (res, None)
        if not grad:
            return [out] + ([state] if final else [])
        gen = torch.Generator().manual_seed(1)
        loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=F64).to(device)).sum()
        if final:
            loss = loss + 1e-2 * (state.double() * torch.randn(state.shape, generator=gen, dtype=F64).to(device)).sum()
        return [out, *torch.autograd.grad(loss, leaves + ([st0] if st0 is not None else []))]

    for grad in (False, True):  # no gradient: the decoding kernels for a few tokens on a state
        for got, want in zip(run("triton", torch.float32, grad), run("reference", F64, grad), strict=True):
            assert rel(got.cpu(), want.cpu(), floor=0.1) < 2e-5, (case, grad)  # floor and bound as test_triton.py


@pytest.fixture
def deferred(monkeypatch):
    """The CPU stands in for a device whose value checks are deferred (tests/test_ops_deferred.py), so that the
    decoding calls run the Triton decoding kernels; every check read at the end."""
    device = _triton_device()
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", {"cpu", "cuda"})
    monkeypatch.delenv("OAL_SYNC_CHECKS", raising=False)
    yield device
    checks.check_errors()


@pytest.mark.parametrize("window,sinks", [(5, 0), (5, 3), (1, 0), (2, 1)])
@pytest.mark.parametrize("owned", [False, True], ids=["callers-state", "cache-state"])
def test_triton_window_decoding_with_one_kv_head_and_a_batch(deferred, window, sinks, owned):
    """oal-swa's Triton decoding step on a batch of 2 with one KV head. The prefix state is a view of the window
    state whose KV-head stride is F (dv+1), not the row's size, and the kernel stepped batch rows by it: row 1 read
    and updated its own slots as its prefix (relative error 0.1-0.3 with nothing evicted yet; with evictions a
    false 'the kernel overflowed' error or wrong outputs)."""
    q, k, v, groups, factor = (t.to(deferred) for t in make(2, 3, 1, 12, 5, 3, 2, seed=window + sinks))
    kw = dict(window=window, sinks=sinks, groups=groups)
    ref = window_attention(q, k, v, backend="reference", factor=factor, **kw)
    q, k, v = (t.float() for t in (q, k, v))
    with torch.no_grad():
        out, state = window_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], factor=factor.float(),
                                      output_final_state=True, **kw)
        outs = [out]
        for i in range(2, 12, 2):
            step = [t[:, :, i : i + 2] for t in (q, k, v)]
            with checks.cache_owned(state if owned else None):
                out, state = window_attention(*step, factor=factor.float(), initial_state=state,
                                              output_final_state=True, **kw)
            outs.append(out)
        checks.check_errors()
    assert rel(torch.cat(outs, dim=2).cpu(), ref.cpu()) < F32_TOL


def test_triton_decoding_on_a_state_whose_one_kv_head_has_any_stride(deferred):
    """OAL's Triton decoding step on the cache's own state [B, 1, F, dv+1] whose (size-1) KV-head dim has a stride
    other than F (dv+1): still contiguous, so updated in place; batch row 1 was read at the wrong address."""
    q, k, v, groups, factor = (t.to(deferred) for t in make(2, 2, 1, 6, 5, 3, 2, seed=1))
    ref = oal_attention(q, k, v, groups, factor, backend="reference")
    q, k, v, factor = (t.float() for t in (q, k, v, factor))
    with torch.no_grad():
        head, state = oal_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], groups, factor, backend="triton",
                                    output_final_state=True)
        odd = torch.empty_strided(state.shape, (state.stride(0), 7, *state.stride()[2:]), device=state.device)
        odd.copy_(state)
        assert odd.is_contiguous()
        with checks.cache_owned(odd):
            tail = oal_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], groups, factor, backend="triton",
                                 initial_state=odd)
        checks.check_errors()
    assert rel(torch.cat([head, tail], dim=2).cpu(), ref.cpu()) < F32_TOL


def test_a_state_checked_first_in_inference_mode_still_trains():
    """The state check's cached diagonal index was made in inference mode when the first call with a state ran under
    torch.inference_mode (generation): every later training call with a state then raised "Inference tensors
    cannot be saved for backward" (the fuzz met it after another test's generation in the same process)."""
    checks._diagonal.cache_clear()
    q, k, v, groups, factor = make(1, 2, 1, 5, 7, 3, 2, 0)
    with torch.inference_mode():
        state = oal_attention(q, k, v, groups, factor, output_final_state=True)[1]
        oal_attention(q, k, v, groups, factor, initial_state=state)
    init = state.clone().requires_grad_()
    qq = q.clone().requires_grad_()
    out = oal_attention(qq, k, v, groups, factor, initial_state=init)
    gq, gs = torch.autograd.grad(out.sum(), (qq, init))
    assert torch.isfinite(gq).all() and torch.isfinite(gs).all() and gs.abs().sum() > 0
