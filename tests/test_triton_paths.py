"""The Triton backend's parallel kernels (short fresh sequences) and decoding kernels (a few tokens on a state)
against the dense reference: outputs, final states and gradients, at odd sizes, with NaN-filled outputs.

Under Triton's interpreter on CPU (conftest.py), compiled with CUDA. Shapes are small: the interpreter is slow.
Tolerances as in tests/test_triton.py (fp32 inputs against the fp64 reference; 1e-10 in fp64).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton import DEVICE, F64, RTOL, make_inputs, prefix_state, rel_err  # noqa: E402

from oal.ops import checks, oal_attention  # noqa: E402
from oal.ops.triton import decode, parallel, routes  # noqa: E402


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch):
    monkeypatch.setattr(parallel, "NAN_SCRATCH", True)


def _count(monkeypatch, module, name):
    calls = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    return calls


def _grads(backend, q, k, v, groups, factor, dtype):
    """Output and the gradients of a fixed projection of it (no final state: the parallel path's contract)."""
    fdtype = F64 if dtype == F64 else torch.float32
    leaves = [t.detach().to(dtype if i < 3 else fdtype).requires_grad_() for i, t in enumerate((q, k, v, factor))]
    out = oal_attention(*leaves[:3], groups, leaves[3], backend=backend)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out.device)
    return [out, *torch.autograd.grad((out.to(F64) * proj).sum(), leaves)]


# b, hq, hkv, n, d, dv, g: N = 1, odd lengths past one tile (64), GQA, padded head dims, the Qwen head shape
PARALLEL = [
    pytest.param((1, 1, 1, 1, 16, 16, 1), id="N1"),
    pytest.param((1, 2, 1, 63, 16, 16, 3), id="N63-gqa2"),
    pytest.param((2, 4, 2, 100, 20, 12, 5), id="N100-B2-d20-dv12-G5"),
    pytest.param((1, 7, 1, 70, 64, 64, 6), id="N70-gqa7-d64-G6"),
]


@pytest.mark.parametrize("case", PARALLEL)
def test_parallel_kernels_match_reference(case, monkeypatch):
    b, hq, hkv, n, d, dv, g = case
    calls = _count(monkeypatch, parallel, "attention")
    q, k, v, groups, factor = make_inputs(b, hq, hkv, n, d, dv, g)
    got = _grads("triton", q, k, v, groups, factor, torch.float32)
    want = _grads("reference", q, k, v, groups, factor, F64)
    assert calls == [1], "the fresh sequence without a final state did not run the parallel kernels"
    errs = {name: rel_err(x, y) for name, x, y in zip(("out", "dq", "dk", "dv", "dfactor"), got, want, strict=True)}
    assert all(err <= RTOL for err in errs.values()), errs


TILES = sorted({(bm, bn) for bm, bn, _ in parallel.CONFIGS + parallel.CONFIGS_FP32_BIG})


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU runs the tiles its autotuner picks")
@pytest.mark.parametrize("tile", TILES, ids=[f"{bm}x{bn}" for bm, bn in TILES])
def test_parallel_kernels_match_reference_with_every_tile(tile, monkeypatch):
    """Every (BM, BN) the autotuner may pick (BM > BN, BM < BN) gives the reference's output and gradients; N = 70
    is not a multiple of any of them."""
    monkeypatch.setattr(parallel, "DEFAULT", (*tile, 1))
    q, k, v, groups, factor = make_inputs(1, 2, 1, 70, 16, 8, 3, seed=12)
    got = _grads("triton", q, k, v, groups, factor, torch.float32)
    want = _grads("reference", q, k, v, groups, factor, F64)
    errs = [rel_err(x, y) for x, y in zip(got, want, strict=True)]
    assert max(errs) <= RTOL, errs


@pytest.mark.skipif(DEVICE == "cuda", reason="fp64 runs on the chunked backend on CUDA")
def test_parallel_kernels_float64_agree_to_1e10(monkeypatch):
    calls = _count(monkeypatch, parallel, "attention")
    q, k, v, groups, factor = make_inputs(1, 2, 1, 37, 16, 8, 3, dtype=F64)
    got = _grads("triton", q, k, v, groups, factor, F64)
    want = _grads("reference", q, k, v, groups, factor, F64)
    assert calls == [1]
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-10)


def test_parallel_serves_short_sequences_only(monkeypatch):
    """Past PARALLEL_MAX, or when the final state is asked for, the chunked kernels run (same results)."""
    calls = _count(monkeypatch, parallel, "attention")
    q, k, v, groups, factor = make_inputs(1, 2, 1, 40, 16, 8, 3)
    short = oal_attention(q, k, v, groups, factor, backend="triton")
    monkeypatch.setattr(routes, "PARALLEL_MAX", 39)
    long = oal_attention(q, k, v, groups, factor, backend="triton")
    with_state, _ = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)
    assert calls == [1]
    assert rel_err(short, long) < RTOL and rel_err(with_state, long) < RTOL


# b, hq, hkv, d, dv, g, new tokens per call
DECODE = [
    pytest.param((1, 2, 1, 16, 16, 3, 1), id="T1"),
    pytest.param((2, 7, 1, 20, 12, 5, 3), id="T3-B2-gqa7-d20-dv12"),
    pytest.param((1, 4, 2, 64, 64, 4, 4), id="T4-d64"),
]


@pytest.mark.parametrize("case", DECODE)
def test_decoding_kernels_match_reference(case, monkeypatch):
    """Prefill 9 tokens (reference), then calls of T tokens on the state: outputs and final state as one call."""
    b, hq, hkv, d, dv, g, t = case
    calls = _count(monkeypatch, decode.Plan, "__call__")
    n = 9 + 3 * t
    q, k, v, groups, factor = make_inputs(b, hq, hkv, n, d, dv, g, seed=4)
    want, want_state = oal_attention(*(x.to(F64) for x in (q, k, v)), groups, factor.to(F64), backend="reference",
                                     output_final_state=True)
    _, state = oal_attention(*(x[:, :, :9] for x in (q, k, v)), groups, factor, backend="reference",
                             output_final_state=True)
    given = state.clone()
    outs = []
    with torch.no_grad():
        for s in range(9, n, t):
            sl = slice(s, s + t)
            out, state = oal_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], groups, factor, backend="triton",
                                       initial_state=state, output_final_state=True)
            outs.append(out)
    assert len(calls) == 3
    assert rel_err(torch.cat(outs, 2), want[:, :, 9:]) < RTOL and rel_err(state, want_state) < RTOL
    prefix = oal_attention(*(x[:, :, :9] for x in (q, k, v)), groups, factor, backend="reference",
                           output_final_state=True)[1]
    assert torch.equal(given, prefix), "a state passed by the caller was changed"


@pytest.mark.skipif(DEVICE == "cuda", reason="fp64 runs on the chunked backend on CUDA")
def test_decoding_kernels_float64_agree_to_1e10(monkeypatch):
    calls = _count(monkeypatch, decode.Plan, "__call__")
    q, k, v, groups, factor = make_inputs(1, 4, 2, 12, 16, 8, 3, seed=6, dtype=F64)
    want, want_state = oal_attention(q, k, v, groups, factor, backend="reference", output_final_state=True)
    _, state = oal_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], groups, factor, output_final_state=True)
    with torch.no_grad():
        out, state = oal_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], groups, factor, backend="triton",
                                   initial_state=state, output_final_state=True)
    assert calls == [1]
    torch.testing.assert_close(out, want[:, :, 10:], rtol=0, atol=1e-10)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-10)


def test_decoding_under_autograd_runs_the_chunked_kernels(monkeypatch):
    """The decoding kernels have no backward: with gradients wanted the chunked kernels run, and agree."""
    calls = _count(monkeypatch, decode.Plan, "__call__")
    q, k, v, groups, factor = make_inputs(1, 2, 1, 5, 16, 8, 3, seed=8)
    init = prefix_state(1, 2, 1, 16, 8, groups, factor).float()
    qg = q.clone().requires_grad_()
    out = oal_attention(qg, k, v, groups, factor, backend="triton", initial_state=init)
    (dq,) = torch.autograd.grad(out.sum(), qg)
    ref = oal_attention(qg.to(F64), k.to(F64), v.to(F64), groups, factor.to(F64), backend="reference",
                        initial_state=init.to(F64))
    (dq_ref,) = torch.autograd.grad(ref.sum(), qg)
    assert calls == [] and rel_err(out, ref) < RTOL and rel_err(dq, dq_ref) < RTOL


def test_owned_state_is_updated_in_place():
    """The generation cache's own state (`checks.cache_owned`) is updated in place by the decoding kernels."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 12, 16, 8, 3, seed=9)
    _, state = oal_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], groups, factor, backend="triton",
                             output_final_state=True)
    with torch.no_grad(), checks.cache_owned(state):
        _, final = oal_attention(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], groups, factor, backend="triton",
                                 initial_state=state, output_final_state=True)
    want = oal_attention(*(x.to(F64) for x in (q, k, v)), groups, factor.to(F64), backend="reference",
                         output_final_state=True)[1]
    assert final is state and rel_err(final, want) < RTOL


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU autotunes for real; here a fake timing picks the config")
def test_autotuning_the_parallel_backward_leaves_no_stale_dq_partials(monkeypatch):
    """On a GPU the first backward of a new shape autotunes _par_dq: every config runs on the same dq partials
    (PART), and a config with 128-row query blocks writes fewer rows than one with 64. Without zeroing PART
    between and after the trials, the rows a 64-row trial left were summed into the factor's gradient of that
    first call (5e-1 off). Here a real `triton.autotune` runs each config once under the interpreter and a fake
    timing makes a 128-row config win."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 200, 16, 16, 3, seed=1)
    want = _grads("triton", q, k, v, groups, factor, torch.float32)  # the interpreter's DEFAULT tiles

    def fake_bench(fn, quantiles):
        fn()
        t = [1.0, 1.0, 0.5, 0.7][fake_bench.calls % 4]  # CONFIGS[2]: BM 128
        fake_bench.calls += 1
        return [t, t, t]

    fake_bench.calls = 0
    site = parallel._site

    def tuned_site(device, grid, consts):  # the GPU's branch, with the interpreter's loops
        _, grid, meta = site(torch.device("cuda"), grid, consts)
        return True, grid, dict(meta, LOOP_FOR=False)

    monkeypatch.setattr(parallel, "_site", tuned_site)
    monkeypatch.setattr(parallel, "short_bench", fake_bench)
    parallel.tuned.cache_clear()
    try:
        first = _grads("triton", q, k, v, groups, factor, torch.float32)  # autotunes, then runs the pick
        assert parallel.CONFIGS[2][0] == 128 and fake_bench.calls >= len(parallel.CONFIGS)
        for name, a, w in zip(["out", "dq", "dk", "dv", "dfactor"], first, want, strict=True):
            assert rel_err(a, w) < 1e-5, name
    finally:
        parallel.tuned.cache_clear()  # no autotuner kept with the fake timing
