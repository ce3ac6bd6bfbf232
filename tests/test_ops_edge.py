"""The operator's edge cases (issue 15): empty inputs, degenerate kernels, extreme magnitudes, wrong devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oal.ops import BACKENDS, empty_state, oal_attention
from oal.ops.kernel import taylor_factor

F64 = torch.float64
BACKEND_LIST = [b for b in BACKENDS if b in ("reference", "recurrent", "chunked", "auto")]


def make(b=1, hq=2, hkv=1, n=9, d=16, dv=4, g=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=F64).to(dtype)
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = (torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64) * 0.5).to(dtype)
    return q, k, v, groups, factor


@pytest.mark.parametrize("backend", BACKEND_LIST)
@pytest.mark.parametrize("causal", [True, False])
def test_empty_sequence_gives_empty_output_and_unchanged_state(backend, causal):
    q, k, v, groups, factor = make(n=0)
    init = torch.randn(1, 1, 1 + 16 + 16 * 17 // 2, 5).abs()  # a state: its denominator column holds key moments (>= 0)
    out, state = oal_attention(q, k, v, groups, factor, backend=backend, causal=causal, initial_state=init,
                               output_final_state=True)
    assert out.shape == (1, 2, 0, 4) and out.dtype == q.dtype
    assert torch.equal(state, init)
    out, state = oal_attention(q, k, v, groups, factor, backend=backend, causal=causal, output_final_state=True)
    assert out.shape == (1, 2, 0, 4) and torch.equal(state, empty_state(1, 1, 16, 4))


@pytest.mark.parametrize("backend", BACKEND_LIST)
def test_empty_batch_gives_empty_output(backend):
    q, k, v, groups, factor = make(b=0)
    out, state = oal_attention(q, k, v, groups, factor, backend=backend, output_final_state=True)
    assert out.shape == (0, 2, 9, 4) and state.shape == (0, 1, 1 + 16 + 136, 5)


def test_zero_head_dim_is_refused():
    q, k, v, groups, factor = make(d=0)
    with pytest.raises(ValueError, match=r"^q: expected a head dimension d >= 1"):
        oal_attention(q, k, v, groups, factor)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_initial_state_is_refused(bad):
    q, k, v, groups, factor = make()
    init = torch.zeros(1, 1, 1 + 16 + 136, 5)
    init[0, 0, 7, 2] = bad
    with pytest.raises(ValueError, match=r"^initial_state: contains NaN or Inf"):
        oal_attention(q, k, v, groups, factor, initial_state=init)


@pytest.mark.parametrize("backend", BACKEND_LIST)
def test_eps_zero_with_zero_factor_is_a_clear_error(backend):
    """eps = 0 and L = 0 make kappa identically 0, so every output is 0/0: refused, never a silent NaN."""
    q, k, v, groups, factor = make()
    with pytest.raises(ValueError, match=r"^eps: with eps=0 the kernel vanished"):
        oal_attention(q, k, v, groups, torch.zeros_like(factor), eps=0.0, backend=backend)
    # eps = 0 is fine while the kernel stays positive (the Taylor factor: 1 + s + s^2/2 >= 1/2)
    out = oal_attention(q, k, v, groups, taylor_factor(2, 2), eps=0.0, backend=backend)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("final", [False, True])
def test_eps_zero_with_zero_factor_is_a_clear_error_on_the_triton_kernels(final):
    """The Triton kernels with the host's checks (the CPU under the interpreter; CUDA with OAL_SYNC_CHECKS=1): the
    same error, from both routes (parallel without the final state, chunked with it). It was a silent NaN."""
    if not _triton_runs_here():
        pytest.skip("triton cannot run here")
    q, k, v, groups, factor = make()
    with pytest.raises(ValueError, match=r"^eps: with eps=0 the kernel vanished"):
        oal_attention(q, k, v, groups, torch.zeros_like(factor), eps=0.0, backend="triton", output_final_state=final)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_bad_chunk_size_is_refused(chunk_size):
    q, k, v, groups, factor = make()
    with pytest.raises(ValueError, match=r"^chunk_size: expected a positive integer or None"):
        oal_attention(q, k, v, groups, factor, backend="chunked", chunk_size=chunk_size)


def _triton_runs_here() -> bool:
    import oal.ops.triton as oal_triton

    return oal_triton.available() and (torch.cuda.is_available() or oal_triton.interpreted())


# triton (under the interpreter on CPU, see conftest.py) gets the same rescaling before its kernels
TRITON = pytest.param("triton", marks=pytest.mark.skipif(not _triton_runs_here(), reason="triton cannot run here"))


@pytest.mark.parametrize("q_scale,k_scale", [(1e10, 1.0), (1.0, 1e10), (1e10, 1e10), (1e15, 1e3)])
@pytest.mark.parametrize("backend", ["reference", "recurrent", "chunked", TRITON])
def test_huge_scores_are_rescaled_exactly(q_scale, k_scale, backend):
    """q/k scaled by 1e10 overflowed float32 (all-NaN output); the exact rescaling of Eq. 7 keeps them finite."""
    q, k, v, groups, factor = make(n=40)
    q, k = q * q_scale, k * k_scale
    want = oal_attention(q.double(), k.double(), v.double(), groups, factor.double(), backend="reference")
    out = oal_attention(q, k, v, groups, factor, backend=backend, chunk_size=16)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    # float64 needs no rescaling and agrees with the float32 result's reference to 1e-10 across backends
    out64 = oal_attention(q.double(), k.double(), v.double(), groups, factor.double(), backend=backend, chunk_size=16)
    torch.testing.assert_close(out64, want, rtol=0, atol=1e-10)


def test_keys_beyond_the_state_range_are_refused():
    q, k, v, groups, factor = make()
    with pytest.raises(ValueError, match=r"^k: values up to .* overflow the torch.float32 state"):
        oal_attention(q, k * 1e18, v, groups, factor)


def test_state_that_overflows_is_a_clear_error():
    """q huge and k tiny: the float32 features cannot hold the products; a clear error instead of NaN."""
    q, k, v, groups, factor = make(n=300)  # longer than one dense chunk, so the features are built
    with pytest.raises(ValueError, match=r"^q/k/factor: the kernel overflowed"):
        oal_attention(q * 1e30, k * 1e-30, v, groups, factor, backend="chunked")


@pytest.mark.parametrize("name", ["groups", "factor", "k", "v", "initial_state"])
def test_tensors_on_another_device_are_refused(name):
    q, k, v, groups, factor = make()
    kw = dict(q=q, k=k, v=v, groups=groups, factor=factor, initial_state=torch.zeros(1, 1, 153, 5))
    kw[name] = kw[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: expected a tensor on q's device cpu, got meta"):
        oal_attention(kw["q"], kw["k"], kw["v"], kw["groups"], kw["factor"], initial_state=kw["initial_state"])


def test_auto_picks_triton_only_for_causal_cuda_inputs(monkeypatch):
    """`auto`: the Triton kernels for causal CUDA tensors when triton is installed; chunked on CPU."""
    import oal.ops as ops
    import oal.ops.triton as oal_triton

    # a stand-in for a CUDA tensor (only its device, shape and dtype are read), so the choice is tested without a GPU
    cuda = SimpleNamespace(device=torch.device("cuda"), shape=(1, 2, 9, 16), dtype=torch.float32)
    monkeypatch.setattr(oal_triton, "available", lambda: True)
    monkeypatch.setattr(oal_triton, "device_arch", lambda device: 90)
    monkeypatch.setattr(oal_triton, "device_shared", lambda device: ("H100", 227 * 1024))
    assert ops._auto_triton(cuda, cuda, True)
    assert not ops._auto_triton(cuda, cuda, False)  # the kernels are causal
    assert not ops._auto_triton(SimpleNamespace(**{**vars(cuda), "dtype": F64}), cuda, True)  # fp64: torch paths
    q, k, v, groups, factor = make()
    assert not ops._auto_triton(q, v, True)  # CPU tensors
    calls = []
    chunked = ops.chunked_attention
    monkeypatch.setattr(ops, "chunked_attention", lambda *a, **kw: calls.append(1) or chunked(*a, **kw))
    oal_attention(q, k, v, groups, factor)
    assert calls == [1]


def test_auto_falls_back_with_one_warning_per_reason(monkeypatch, caplog):
    """Inputs the kernels refuse (here: a device with too little shared memory) run the torch path, said once."""
    import oal.ops as ops
    import oal.ops.triton as oal_triton

    cuda = SimpleNamespace(device=torch.device("cuda"), shape=(1, 2, 9, 128), dtype=torch.bfloat16)
    monkeypatch.setattr(oal_triton, "available", lambda: True)
    monkeypatch.setattr(oal_triton, "device_arch", lambda device: 80)
    monkeypatch.setattr(oal_triton, "device_shared", lambda device: ("RTX A6000", 99 * 1024))
    monkeypatch.setattr(ops, "_FALLBACK_WARNED", set())
    with caplog.at_level("WARNING", logger="oal"):
        assert not ops._auto_triton(cuda, cuda, True)
        assert not ops._auto_triton(cuda, cuda, True)
    warnings = [r.getMessage() for r in caplog.records if "chunked torch path" in r.getMessage()]
    assert len(warnings) == 1 and "163 KB of shared memory" in warnings[0] and "RTX A6000 has 99 KB" in warnings[0]
    monkeypatch.setattr(oal_triton, "device_shared", lambda device: ("A100", 163 * 1024))
    assert ops._auto_triton(cuda, cuda, True, chunk_size=64)
    assert not ops._auto_triton(cuda, cuda, True, chunk_size=128)  # longer chunks than the tiles are checked for
