"""The Triton backend against the dense reference (Eq. 7): outputs, final states and gradients.

On a machine without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before triton is first imported); with CUDA (scripts/gpu_perf.sh) they run compiled.
OAL_TEST_DEVICE=cpu|cuda overrides the choice. The interpreter is slow, so the shapes are small and chosen to
cover the cases rather than to form a grid.

Tolerances. Inputs are fp32 and the reference runs in fp64. The kernels accumulate in fp32; their fp32 dots are
plain fp32 under the interpreter and three-pass tf32 on a GPU (tf32x3, about fp32 accuracy). Each output is a
ratio of sums of at most N * 2145 fp32 products; we observe relative errors of 1e-7 to 4e-7 (norm over the
tensor). The bound RTOL = 2e-5 leaves a factor of 50 for other seeds and the GPU's summation order and split
products, while any wrong index or missing term gives an error of order 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

DEVICE = os.environ.get("OAL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


pytest.importorskip("triton")  # in the dev extra on Linux, so CI runs these; other platforms have no wheel

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import oal.ops.triton as oal_triton  # noqa: E402
import oal.ops.triton.function as tfn  # noqa: E402
from oal.ops import oal_attention  # noqa: E402
from oal.ops.triton.blocks import _norm_cols, _norm_ops, _norm_store, _norm_vals  # noqa: E402

if DEVICE == "cpu" and not oal_triton.interpreted():
    raise RuntimeError("tests/test_triton.py on CPU needs TRITON_INTERPRET=1 before triton is imported (conftest.py)")

F64 = torch.float64
RTOL = 2e-5


def make_inputs(b, hq, hkv, n, d, dv, g, *, seed=0, dtype=torch.float32):
    """Random inputs; the last group id is never used, so unused rows of L must have no effect."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=F64)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=F64)
    groups = torch.randint(0, max(g - 1, 1), (hq, d), generator=gen)
    factor = torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64) * 0.5
    fdtype = F64 if dtype == F64 else torch.float32
    return [t.to(DEVICE, dtype) for t in (q, k, v)] + [groups.to(DEVICE), factor.to(DEVICE, fdtype)]


def prefix_state(b, hq, hkv, d, dv, groups, factor, *, n=9, seed=5):
    """A genuine state: the reference's final state over n earlier tokens."""
    q, k, v, *_ = make_inputs(b, hq, hkv, n, d, dv, 1, seed=seed, dtype=F64)
    return oal_attention(q, k, v, groups, factor.to(F64), backend="reference", output_final_state=True)[1]


def rel_err(got, want):
    """Relative error in norm. A reference that vanishes (dq at N = 1, where out = v whatever q is) is compared
    on a floor of 0.1 per entry (rms), below the gradients' scale here (0.3 to 5) and far above fp32 rounding."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    return float((got - want).norm() / max(float(want.norm()), 0.1 * math.sqrt(want.numel())))


def run(backend, q, k, v, groups, factor, state, *, dtype, chunk=None, with_final=True, train_factor=True):
    """Output, final state and the gradients of a fixed random projection of both, on copies cast to dtype.
    Half inputs run the half kernels only with the factor frozen (`train_factor=False`; a trained factor runs them
    in fp32, see tests/test_numerics_outliers.py), and then no factor gradient is returned."""
    leaves = [t.detach().to(dtype if i < 3 else (F64 if dtype == F64 else torch.float32)).requires_grad_(i < 3
              or train_factor) for i, t in enumerate((q, k, v, factor))]
    init = None if state is None else state.detach().to(F64 if dtype == F64 else torch.float32).requires_grad_()
    out, final = oal_attention(*leaves[:3], groups, leaves[3], backend=backend, initial_state=init,
                               output_final_state=True, chunk_size=chunk)
    gen = torch.Generator().manual_seed(1)
    loss = (out.to(F64) * torch.randn(out.shape, generator=gen, dtype=F64).to(out.device)).sum()
    if with_final:  # the final state's gradient reaches every key
        loss = loss + 1e-2 * (final.to(F64) * torch.randn(final.shape, generator=gen, dtype=F64).to(out.device)).sum()
    names = ["q", "k", "v"] + (["factor"] if train_factor else []) + (["initial_state"] if init is not None else [])
    wrt = leaves[:3] + ([leaves[3]] if train_factor else []) + ([init] if init is not None else [])
    grads = torch.autograd.grad(loss, wrt)
    return out, final, dict(zip(names, grads, strict=True))


def check_against_reference(case, *, chunk=None, seg=None, state=False, dtype=torch.float32, tol=RTOL,
                            monkeypatch=None):
    b, hq, hkv, n, d, dv, g = case
    if monkeypatch is not None:
        monkeypatch.setattr(tfn, "SEGMENT_CHUNKS", seg)
    q, k, v, groups, factor = make_inputs(b, hq, hkv, n, d, dv, g, dtype=dtype)
    init = prefix_state(b, hq, hkv, d, dv, groups, factor) if state else None
    out, final, grads = run("triton", q, k, v, groups, factor, init, dtype=dtype, chunk=chunk)
    ref, ref_final, ref_grads = run("reference", q, k, v, groups, factor, init, dtype=F64)
    assert out.dtype == dtype and out.shape == (b, hq, n, dv)
    errs = {"out": rel_err(out, ref), "final_state": rel_err(final, ref_final)}
    errs |= {f"d{name}": rel_err(grads[name], ref_grads[name]) for name in ref_grads}
    bad = {name: err for name, err in errs.items() if not err <= tol}
    assert not bad, f"{case}: relative errors above {tol:g}: {bad}"
    return errs


# b, hq, hkv, n, d, dv, g; chunk; chunks per scan segment (None: one segment; rounded down to a power of 4);
# initial state. N200 at chunk 32 is 7 chunks in 2 segments of 4: a padding chunk and a carry between segments.
CASES = [
    pytest.param((1, 1, 1, 1, 16, 16, 1), None, None, False, id="N1"),
    pytest.param((1, 2, 1, 17, 16, 16, 3), 16, None, True, id="N17-gqa2-state"),
    pytest.param((2, 2, 2, 64, 16, 24, 2), 16, 1, False, id="N64-B2-dv24-segments"),
    pytest.param((1, 7, 1, 200, 16, 16, 6), 32, 4, True, id="N200-gqa7-G6-padded-segments-state"),
    pytest.param((1, 2, 1, 50, 64, 64, 4), 16, 1, False, id="N50-d64-segments"),
    pytest.param((1, 2, 2, 33, 20, 12, 5), 16, 1, True, id="N33-d20-padded-features"),
    # the paper-scale head dims (Llama-3-8B, Qwen2.5-7B) and mixed ones: pair steps of 8 rows (tiles.TILE_SHAPES)
    pytest.param((1, 2, 1, 20, 128, 128, 3), 16, None, True, id="N20-d128-dv128-state", marks=pytest.mark.slow),
    pytest.param((1, 1, 1, 20, 128, 64, 3), 16, 1, False, id="N20-d128-dv64-segments", marks=pytest.mark.slow),
    pytest.param((1, 1, 1, 20, 64, 128, 3), 16, None, False, id="N20-d64-dv128"),
]


@pytest.mark.parametrize("case,chunk,seg,state", CASES)
def test_matches_reference(case, chunk, seg, state, monkeypatch):
    check_against_reference(case, chunk=chunk, seg=seg, state=state, monkeypatch=monkeypatch)


def test_head_dims_up_to_128_use_smaller_pair_steps():
    """Under the interpreter the d = 128 cases above run the pair loops in steps of 8 rows, d <= 64 in whole pairs."""
    assert tfn.tiles("dkv", 128, 64, False, 90)["RH"] == 8 and tfn.tiles("dkv", 64, 64, False, 90)["RH"] == 16


def test_pair_steps_of_four_rows_match_reference(monkeypatch):
    """Block pairs taken 4 rows at a time (fp32 on sm_80; the d = 128 cases above take 8) give the same results."""
    tiles = tfn.tiles
    monkeypatch.setattr(tfn, "tiles", lambda *args: dict(tiles(*args), RH=4))
    check_against_reference((1, 2, 2, 33, 20, 12, 5), chunk=16, seg=1, state=True, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("rh", [16, 4])
def test_normaliser_by_dots_matches_reference(rh, monkeypatch):
    """The normaliser rows summed by dots against `_norm_cols` (half inputs' path: the key scan's H2 rows, the
    output kernel's H1 and H2 readout; Eq. 5-6's denominator) give the reference's output, final state and
    gradients in fp32 too, where the dots are fp32 (the rounded part is then exact and the remainder zero): at
    whole pairs and at steps of 4 rows, across segments, with an initial state and padded features."""
    monkeypatch.setattr(tfn, "_norm_dot", lambda cfg: True)
    tiles = tfn.tiles
    monkeypatch.setattr(tfn, "tiles", lambda *args: dict(tiles(*args), RH=rh))
    check_against_reference((1, 2, 2, 33, 20, 12, 5), chunk=16, seg=1, state=True, monkeypatch=monkeypatch)
    check_against_reference((1, 7, 1, 200, 16, 16, 6), chunk=32, seg=4, state=True, monkeypatch=monkeypatch)


@pytest.mark.slow
def test_features_multiplied_in_a_16_bit_type_match_reference(monkeypatch):
    """The output kernel's query features multiplied in `_prod_dt` (bf16 for half inputs on a GPU: q_r q_t and
    the coefficient rounded, then the product; Eq. 6's phi(q)). The interpreter's bf16 arithmetic is not IEEE, so
    the path runs here in fp16 (10-bit products, where bf16 has 8): the output within fp16's rounding of the
    reference, and not the fp32 products' output (the path was taken)."""
    case = (1, 2, 1, 50, 64, 64, 4)
    exact = check_against_reference(case, chunk=16, seg=1, monkeypatch=monkeypatch)["out"]
    monkeypatch.setattr(tfn, "_prod_dt", lambda cfg: tl.float16)
    errs = check_against_reference(case, chunk=16, seg=1, tol=5e-3, monkeypatch=monkeypatch)
    assert errs["out"] > 10 * exact, (errs["out"], exact)


def test_half_inputs_multiply_the_features_in_bf16(monkeypatch):
    """Which inputs take bf16 products in the output kernel: half ones, whose dots are bf16 on a GPU (fp32 under
    the interpreter, and so are their products there), unless HALF_PRODUCTS is off; fp32 inputs fp32 ones."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cfg = tfn.config(torch.zeros(1, 1, 4, 16, dtype=dtype), torch.zeros(1, 3, 3), 64)
        on_gpu = dataclasses.replace(cfg, dot_dtype=torch.bfloat16) if cfg.half else cfg  # as `_dtypes` gives there
        assert tfn._prod_dt(on_gpu) == (tl.bfloat16 if cfg.half else tl.float32), dtype
        assert tfn._prod_dt(cfg) == tl.float32 or not tfn.interpreted()
        monkeypatch.setattr(tfn, "HALF_PRODUCTS", False)
        assert tfn._prod_dt(on_gpu) == tl.float32
        monkeypatch.undo()


def test_half_inputs_sum_the_normaliser_by_dots():
    """Which inputs take the dots (their features are rounded for the numerator's dot anyway) and which keep the
    sums in registers (fp32, whose three-pass dots cost more registers than the sums saved; fp64)."""
    for dtype, by_dots in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False), (F64, False)):
        q = torch.zeros(1, 1, 4, 16, dtype=dtype)
        assert tfn._norm_dot(tfn.config(q, torch.zeros(1, 3, 3), 64)) is by_dots, dtype


@pytest.mark.skipif(DEVICE == "cuda", reason="fp64 runs on the chunked backend on CUDA")
def test_float64_agrees_to_1e10(monkeypatch):
    """The contract's float64 agreement between backends holds for the kernels too (under the interpreter)."""
    check_against_reference((1, 2, 1, 37, 16, 8, 3), chunk=16, seg=1, state=True, dtype=F64, tol=1e-10,
                            monkeypatch=monkeypatch)


@pytest.mark.slow
def test_acceptance_qwen_head_shape():
    """Issue acceptance: B=1, Hq=14, Hkv=2, N=77, d=dv=64, G=5 with an unused id, causal, fp32 inputs;
    output and q/k/v/factor gradients within 1e-4 (relative, in norm) of the fp64 dense Eq. 7."""
    errs = check_against_reference((1, 14, 2, 77, 64, 64, 5), tol=1e-4)
    print("acceptance relative errors:", {name: f"{err:.2e}" for name, err in errs.items()})


def test_prefill_on_triton_then_decode():
    """Prefill on the kernels, then decode token by token from their state: equals one long reference call."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 40, 16, 8, 3, seed=3)
    want, want_state = oal_attention(*(t.to(F64) for t in (q, k, v)), groups, factor.to(F64), backend="reference",
                                     output_final_state=True)
    p = 33
    out, state = oal_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], groups, factor, backend="triton",
                               output_final_state=True)
    assert state.dtype == torch.float32
    steps = []
    for i in range(p, 40):
        backend = "triton" if i % 2 else "recurrent"  # the kernels' state feeds both decoders
        sl = slice(i, i + 1)
        o, state = oal_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], groups, factor, backend=backend,
                                 initial_state=state, output_final_state=True)
        steps.append(o)
    assert rel_err(out, want[:, :, :p]) < RTOL
    assert rel_err(torch.cat(steps, dim=2), want[:, :, p:]) < RTOL
    assert rel_err(state, want_state) < RTOL


def test_bfloat16_long_sequence_is_finite_and_close(monkeypatch):
    """bf16 at a longer length with an outlier dimension (large kappa): finite, bf16 output, close to fp64.

    Under Triton's interpreter (CPU) this tests no bf16 arithmetic: the interpreter cannot multiply bf16, so the
    kernels take fp32 dots and only the inputs, the outputs and the per-chunk states (stored in bf16, read by the
    output and dq kernels) are bf16; it checks the dtype handling and the long-sequence scan. The bf16 dots are
    checked on a GPU by tests/test_triton_gpu.py (scripts/gpu_perf.sh), at N = 16k against fp64 and beside bf16
    SDPA. On a GPU the dots take bf16 operands (features, and the per-chunk states); running this test's inputs with
    bf16 dots emulated gave relative errors of 7e-3 (output), 4e-3 to 9e-3 (dq, dk, dv) and 3e-2 (dfactor, a sum
    over all tokens, which is why a trained factor now runs fp32 kernels); bf16-rounded inputs alone give 2e-3 to
    5e-3. The bounds leave a factor of 2 or more.
    """
    monkeypatch.setattr(tfn, "SEGMENT_CHUNKS", 4)
    n = 1024
    q, k, v, groups, factor = make_inputs(1, 2, 1, n, 16, 16, 3, seed=7)
    q[..., 3] *= 8.0  # an outlier dimension, as in pretrained heads
    k[..., 3] *= 8.0
    out, _, grads = run("triton", q, k, v, groups, factor, None, dtype=torch.bfloat16, with_final=False,
                        train_factor=False)
    ref, _, ref_grads = run("reference", q, k, v, groups, factor, None, dtype=F64, with_final=False)
    assert out.dtype == torch.bfloat16
    assert all(bool(torch.isfinite(t).all()) for t in [out, *grads.values()])
    assert rel_err(out, ref) < 2e-2
    for name, tol in (("q", 3e-2), ("k", 3e-2), ("v", 3e-2)):  # the factor frozen: the half kernels' backward
        assert rel_err(grads[name], ref_grads[name]) < tol, name


def test_half_inputs_store_their_chunk_states_in_bf16(monkeypatch):
    """The keys scan stores each chunk's prefix state in bf16 for half inputs (`Config.state_dtype`: what the
    output and dq kernels' bf16 dots read it as; half the bytes of the chunked route's largest tensor, Eq. 5's H
    per chunk) and in fp32 otherwise; its segment ends, and the query scan's states (the backward adds a carry to
    them before rounding), stay fp32, and its normaliser is stored as its dot operand's two columns. The bf16
    states are the fp32 ones rounded: within one bf16 step (2^-7 relative; the interpreter truncates) on the same
    bf16-exact inputs; on a GPU the scan's own dots round the features too, so there the bound is on the whole
    tensor."""
    monkeypatch.setattr(tfn, "SEGMENT_CHUNKS", 2)  # two segments: the second pass's carried sums are stored too
    q, k, v, groups, factor = make_inputs(1, 2, 1, 150, 16, 16, 3, seed=3)
    q, k, v = (t.bfloat16().float() for t in (q, k, v))  # exact in both dtypes
    lay = tfn.layout(16)
    a, bs, cs, _, _ = tfn._params(factor, groups, 1e-4, 0.25, lay, torch.float32)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = tfn.config(q.to(dtype), factor, 16)
        keys = tfn._scan(k.to(dtype), v.to(dtype), None, (a, bs, cs), cfg, lay, 1, query=False, reverse=False,
                         carry=None, two_pass=True)
        # query mode reads Y and NW per query head
        query = tfn._scan(q.to(dtype), q.to(cfg.dot_dtype), torch.ones_like(q[..., 0]), (a, bs, cs), cfg, lay, 1,
                          query=True, reverse=True, carry=None, two_pass=False)
        runs[dtype] = keys, query
    (st32, *rest32), _ = runs[torch.float32]
    (st16, stn, tot, totn, _), query = runs[torch.bfloat16]
    assert st32.dtype == torch.float32 and st16.dtype == torch.bfloat16
    assert [t.dtype for t in (tot, totn, query[0], query[1])] == [torch.float32] * 4
    assert rest32[0].dtype == torch.float32 and rest32[0].shape == st32.shape[:-1]
    # the normaliser by dots: each row as its dot operand's two columns, in the dot type (`blocks._norm_store`)
    cfg16 = tfn.config(q.bfloat16(), factor, 16)
    assert stn.dtype == cfg16.dot_dtype and stn.shape == (*st32.shape[:-1], 2)
    gap = (st16.float() - st32).abs()
    if tfn.interpreted():  # dots in fp32 here: the first column is the fp32 sum, the second zero
        assert bool((gap <= st32.abs() * 2**-7).all()), float((gap / st32.abs().clamp_min(1e-30)).max())
        torch.testing.assert_close(stn[..., 0], rest32[0], rtol=0, atol=0)
        assert not stn[..., 1].any()
    else:
        assert rel_err(st16, st32) < 1e-2
        assert rel_err(stn.float().sum(-1), rest32[0]) < 1e-2
    assert float(st32.abs().max()) > 0  # the comparison above compared states, not zeros


@pytest.mark.parametrize("state", [False, True], ids=["fresh", "state"])
def test_half_forward_runs_its_own_chunk_and_the_backward_64(state, monkeypatch):
    """For half inputs at d, dv <= 64 the forward's key scan and output kernel take 128-token chunks
    (`tiles.FWD_CHUNK`: each program reads its chunk's state for twice the queries) and the backward keeps 64;
    an explicit chunk size runs both at it. The output, the final state and the gradients agree with the forward
    at 64 (up to the bf16 rounding of the per-chunk states, which now start at other tokens) and with fp64."""
    from oal.ops.triton import tiles as ttiles

    assert [ttiles.fwd_warps(c) for c in (16, 32, 64, 128, 256)] == [4, 4, 4, 8, 4]
    chunks = []
    scan = tfn._scan

    def spy(x, y, nw, coefs, cfg, *args, query, **kwargs):
        chunks.append((cfg.chunk, query))
        return scan(x, y, nw, coefs, cfg, *args, query=query, **kwargs)

    monkeypatch.setattr(tfn, "_scan", spy)
    q, k, v, groups, factor = make_inputs(1, 2, 1, 300, 16, 16, 3, seed=11)  # 2 chunks of 128 and 44 tokens
    q, k, v = (t.bfloat16().float() for t in (q, k, v))
    init = prefix_state(1, 2, 1, 16, 16, groups, factor) if state else None  # a prompt continued (generation)
    got = run("triton", q, k, v, groups, factor, init, dtype=torch.bfloat16, train_factor=False)
    assert chunks == [(128, False), (64, False), (64, True)]  # forward; backward: keys again, then queries
    chunks.clear()
    explicit = run("triton", q, k, v, groups, factor, init, dtype=torch.bfloat16, chunk=64, train_factor=False)
    assert chunks == [(64, False), (64, False), (64, True)]
    monkeypatch.setattr(tfn, "FWD_CHUNKS", False)
    chunks.clear()
    at64 = run("triton", q, k, v, groups, factor, init, dtype=torch.bfloat16, train_factor=False)
    assert chunks == [(64, False), (64, False), (64, True)]
    ref = run("reference", q, k, v, groups, factor, init, dtype=F64)
    torch.testing.assert_close(explicit[0], at64[0], rtol=0, atol=0)  # the same kernels at the same chunks
    assert rel_err(got[0], at64[0]) < 1e-2 and rel_err(got[1], at64[1]) < 1e-5  # final state: fp32 sums
    assert rel_err(got[0], ref[0]) < 2e-2 and rel_err(got[1], ref[1]) < 1e-4
    for name in ("q", "k", "v") + (("initial_state",) if state else ()):  # the half kernels' backward
        assert rel_err(got[2][name], at64[2][name]) < 1e-2, name
        assert rel_err(got[2][name], ref[2][name]) < 6e-2, name


@triton.jit
def _norm_roundtrip(X, STN, VALS, OPS, REF, K: tl.constexpr):
    rows = tl.arange(0, K)
    x = tl.load(X + rows)
    _norm_store(STN, 3 + rows, x, True, tl.bfloat16)  # the chunk's rows start at row 3
    tl.debug_barrier()
    tl.store(VALS + rows, _norm_vals(STN, 3, rows, True))
    col = tl.arange(0, 16)
    tl.store(OPS + rows[:, None] * 16 + col[None, :], _norm_ops(STN, 3, rows).to(tl.float32))
    tl.store(REF + rows[:, None] * 16 + col[None, :], _norm_cols(x, tl.bfloat16).to(tl.float32))


def test_split_normaliser_rows_round_trip():
    """`_norm_store` splits fp32 normaliser rows into (rounded to bf16, what the rounding left) and `_norm_vals`
    and `_norm_ops` read them back: the sum within 2^-16 of the row (2^-14 under the interpreter, which truncates),
    the operand's two columns those parts and zeros after them, as `_norm_cols` builds it from the fp32 row."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(32, generator=gen) * torch.logspace(-3, 5, 32)).to(DEVICE)
    stn = torch.full((3 + 32, 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    vals, ops, ref = (torch.empty(*shape, device=DEVICE) for shape in ((32,), (32, 16), (32, 16)))
    _norm_roundtrip[(1,)](x, stn, vals, ops, ref, K=32)
    assert bool((stn[3:, 0].float() - x).abs().le(x.abs() * 2**-7).all())
    bound = 2**-14 if tfn.interpreted() else 2**-16
    assert bool(((vals - x).abs() <= x.abs() * bound).all()), float(((vals - x) / x).abs().max())
    assert float((vals - stn[3:, 0].float()).abs().max()) > 0  # the second part carries what bf16 dropped
    torch.testing.assert_close(ops, ref, rtol=0, atol=0)
    assert not ops[:, 2:].any()


def test_half_precision_inputs_give_their_dtype():
    q, k, v, groups, factor = make_inputs(1, 2, 1, 20, 16, 16, 2, seed=2)
    ref = oal_attention(q.to(F64), k.to(F64), v.to(F64), groups, factor.to(F64), backend="reference")
    for dtype in (torch.float16, torch.bfloat16):
        out = oal_attention(q.to(dtype), k.to(dtype), v.to(dtype), groups, factor, backend="triton")
        assert out.dtype == dtype
        assert rel_err(out, ref) < 2e-2


def test_non_causal_runs_the_torch_path():
    q, k, v, groups, factor = make_inputs(1, 2, 1, 20, 16, 8, 2)
    got = oal_attention(q, k, v, groups, factor, backend="triton", causal=False)
    want = oal_attention(q, k, v, groups, factor, backend="chunked", causal=False)
    torch.testing.assert_close(got, want)


BAD = [
    dict(k=torch.randn(1, 3, 8, 16)),  # Hq % Hkv != 0
    dict(groups=torch.full((2, 16), 3)),  # id out of range
    dict(factor=torch.randn(2, 3, 4)),
    dict(q=torch.full((1, 2, 8, 16), float("nan"))),
    dict(initial_state=torch.zeros(1, 1, 3, 5)),
]


@pytest.mark.parametrize("override", BAD)
def test_bad_input_raises_like_the_other_backends(override, monkeypatch):
    monkeypatch.setenv("OAL_SYNC_CHECKS", "1")  # on CUDA the value checks otherwise report late (test_ops_deferred)
    kw = dict(q=torch.randn(1, 2, 8, 16), k=torch.randn(1, 1, 8, 16), v=torch.randn(1, 1, 8, 4),
              groups=torch.zeros(2, 16, dtype=torch.long), factor=torch.randn(2, 3, 3))
    kw.update(override)
    init = kw.pop("initial_state", None)
    init = None if init is None else init.to(DEVICE)  # refused for its shape, not for its device
    args = [kw[name].to(DEVICE) for name in ("q", "k", "v", "groups", "factor")]
    messages = []
    for backend in ("chunked", "triton"):
        with pytest.raises(ValueError) as err:
            oal_attention(*args, backend=backend, initial_state=init)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_unsupported_requests_are_clear_errors(monkeypatch):
    q, k, v, groups, factor = make_inputs(1, 2, 1, 8, 16, 8, 2)
    with pytest.raises(ValueError, match="^chunk_size: .*power of two"):
        oal_attention(q, k, v, groups, factor, backend="triton", chunk_size=24)
    big = torch.randn(1, 1, 4, 192, device=DEVICE)
    with pytest.raises(ValueError, match="^q/v: .*d, dv <= 128"):
        oal_attention(big, big, big, torch.zeros(1, 192, dtype=torch.long, device=DEVICE),
                      torch.randn(1, 2, 2, device=DEVICE), backend="triton")
    monkeypatch.setattr(oal_triton, "available", lambda: False)
    with pytest.raises(ValueError, match=r"^backend: 'triton' needs the triton package.*oal-attention\[gpu\]"):
        oal_attention(q, k, v, groups, factor, backend="triton")


@pytest.mark.parametrize("arch", [90, 80])
def test_paper_head_dims_are_accepted_on_both_targets(arch):
    """No (d, dv) in {64, 128} and no half or fp32 input is refused: their kernels fit (test_triton_compile.py)."""
    for d, dv, dtype in itertools.product((64, 128), (64, 128), (torch.bfloat16, torch.float16, torch.float32)):
        assert oal_triton.refusal(d, dv, dtype, arch) is None, (d, dv, dtype)
    assert oal_triton.refusal(64, 64, F64, arch).startswith("q: the triton backend takes bf16, fp16 or fp32")
    assert oal_triton.refusal(192, 64, torch.bfloat16, arch).startswith("q/v: the triton backend supports d, dv <= 128")


def test_block_layout_round_trip():
    """Packed state -> kernel block layout -> packed state is the identity (every feature kept once)."""
    d, dv = 20, 3
    state = torch.randn(2, 3, 1 + d + d * (d + 1) // 2, dv + 1, dtype=F64)
    blk, blkn = tfn.state_to_blocks(state, d)
    assert blk.shape == (6, tfn.layout(d).rows, dv)
    torch.testing.assert_close(tfn.blocks_to_state(blk, blkn, 2, d), state, rtol=0, atol=0)


def test_importing_oal_does_not_import_triton():
    code = "import sys, oal, oal.ops, oal.ops.triton; assert 'triton' not in sys.modules, 'triton imported'"
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_tuning_record_names_the_tiles_and_the_autotuners_picks():
    """What benchmarks.gpu records beside its timings: the half-precision tiles of the table, and each autotuner's
    pick per key once it has one."""
    import triton

    from oal.ops.triton import tiles as ttiles

    rec = tfn.tuning_record(64, 64, 90)
    assert rec["tiles"]["scan"]["RH"] == ttiles.TILES[True, False, 90]["scan"][0]
    assert rec["tiles"]["dkv"]["num_stages"] == ttiles.TILES[True, False, 90]["dkv"][1]
    assert (rec["fwd_chunk"], rec["chunk"]) == (ttiles.FWD_CHUNK[True, False, 90], tfn.CHUNK) == (128, 64)
    assert rec["tiles"]["scan_fwd"]["RH"] == rec["tiles"]["scan"]["RH"] // 2 and rec["tiles"]["fwd"]["num_warps"] == 8
    tuner = tfn._tuned_fwd_out(True, False, 90, 128)  # the forward's tuner at its own chunk: 8 warps
    assert {c.num_warps for c in tuner.configs} == {8}
    tuner.cache[(64, 64, 6, 14)] = triton.Config({"RH": 4}, num_warps=8, num_stages=1)
    try:
        assert "RH: 4" in tfn.tuning_record(64, 64, 90)["autotuned"]["fwd"]["(64, 64, 6, 14)"]
    finally:
        tuner.cache.clear()
