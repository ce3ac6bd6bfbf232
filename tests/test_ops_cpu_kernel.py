"""The fused CPU kernel (`oal.ops.cpu_kernel`, csrc/readout.cpp) against the torch path and the dense reference:
odd head dims (padded bf16 pairs), odd value dims (remainder tiles), chunks of one and several vectors, GQA,
batches, an initial state, both worker layouts, NaN-filled scratch; bf16 queries with and without bf16 dot
products; where it must not run; and its build (cached, atomic, one clear line without a compiler)."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oal.ops.chunked as chunked
from oal.ops import cpu_chain, cpu_kernel, oal_attention, tuning
from oal.ops.kernel import perturbed_factor, taylor_factor

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ compiler: the fused readout is not built")
F64 = torch.float64


def make(b, hq, hkv, n, d, dv, g=3, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, dd, generator=gen, dtype=F64) for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
    q, k, v = (t.to(dtype) for t in (q, k, v))  # the reference runs on the rounded inputs
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = perturbed_factor(taylor_factor(hq, g, dtype=F64), 0.3, generator=gen)
    return q, k, v, groups, factor


class Calls(list):
    """The fused readout's calls: the queries' dtype of each, in `intras` whether it took the intra-chunk term and
    in `finals` whether it wrote the normalised output itself; in `chains` the features' dtype of each chain of
    chunk states the kernel built."""

    def __init__(self):
        super().__init__()
        self.intras = []
        self.finals = []
        self.chains = []


@pytest.fixture
def calls(monkeypatch):
    """Records the fused readout's calls (`Calls`); scratch buffers NaN-filled (an unwritten entry shows up)."""
    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)
    seen = Calls()
    real = cpu_kernel.readout

    def spy(x, w, states, out, intra=None, final=None):
        seen.append(x.dtype)
        seen.intras.append(intra is not None)
        seen.finals.append(final is not None)
        return real(x, w, states, out, intra, final)

    chain = cpu_chain.states
    monkeypatch.setattr(cpu_kernel, "readout", spy)
    monkeypatch.setattr(cpu_chain, "states", lambda psi, *a: seen.chains.append(psi.dtype) or chain(psi, *a))
    return seen


def _token_major(x):
    """Feature-major queries [nc, B, Hkv, d, rep, C] (the layout the tests build) -> the operator's token-major
    [B, Hkv * rep, nc * C, d], which `readout` takes."""
    nc, b, hkv, d, rep, c = x.shape
    return x.permute(1, 2, 4, 0, 5, 3).reshape(b, hkv * rep, nc * c, d).contiguous()


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


# (B, Hq, Hkv, N, d, dv, chunk in vectors): the Qwen head shape; odd d and dv with GQA 3 and a batch of 2; three
# vectors a chunk (a two-vector tile and a one-vector tile)
SHAPES = [(1, 14, 2, 1000, 64, 64, 2), (2, 3, 1, 261, 5, 7, 1), (1, 4, 2, 333, 17, 12, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pipeline", [False, True])
def test_fused_readout_matches_reference_and_torch_path(monkeypatch, calls, shape, pipeline):
    bsz, hq, hkv, n, d, dv, vectors = shape
    chunk = vectors * cpu_kernel.vector_width()
    q, k, v, groups, factor = make(bsz, hq, hkv, n, d, dv)
    init = torch.randn(bsz, hkv, 1 + d + d * (d + 1) // 2, dv + 1, generator=torch.Generator().manual_seed(1)).abs()
    want, want_state = oal_attention(q.double(), k.double(), v.double(), groups, factor, backend="reference",
                                     initial_state=init.double(), output_final_state=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the serial layout splits the items over two workers, the pipelined one runs blocks
    copies, real_copy = [], chunked._feature_major
    monkeypatch.setattr(chunked, "_feature_major", lambda *a: copies.append(1) or real_copy(*a))
    try:
        with torch.inference_mode(), tuning.forced(tuning.Settings(chunk, 2, pipeline=pipeline)):
            got, state = oal_attention(q, k, v, groups, factor.float(), backend="chunked", initial_state=init,
                                       output_final_state=True)
            assert not copies  # the kernel gathers its own queries: no feature-major copy of them
            monkeypatch.setenv("OAL_CPU_KERNEL", "0")
            torch_path = oal_attention(q, k, v, groups, factor.float(), backend="chunked", initial_state=init)
    finally:
        torch.set_num_threads(threads)
    assert calls and set(calls) == {torch.float32}  # the fused readout ran, and only where it was on
    assert all(calls.intras)  # with the chunks' own keys (the torch intra-chunk GEMMs did not run)
    assert all(calls.finals)  # and divided into the output itself
    assert calls.chains  # the chunk states by the kernel too
    # fp32 level (its sums run in another order than the GEMM's: about 3x the torch path's error, 1e-6 here)
    assert _rel(got, want) < 1e-5 and _rel(state, want_state) < 1e-5, (_rel(got, want), _rel(state, want_state))
    assert _rel(got, torch_path.double()) < 1e-5


@pytest.mark.parametrize("case", ["unused group ids", "more groups than the kernel takes"])
def test_fused_intra_chunk_term_edge_groups(calls, case):
    """Group ids a head leaves unused (empty ranges in `bounds`), and G + 1 above GMAX: then the readout is still
    fused and the intra-chunk term runs the torch GEMMs."""
    g = 3 if case == "unused group ids" else cpu_kernel.GMAX
    q, k, v, groups, factor = make(1, 4, 2, 200, 12, 6, g=g)
    if case == "unused group ids":
        groups = torch.where(groups == 1, 2, groups)  # id 1 unused in every head
        groups[0] = 0  # head 0: one group only
    want = oal_attention(q.double(), k.double(), v.double(), groups, factor, backend="reference")
    with torch.inference_mode():
        got = oal_attention(q, k, v, groups, factor.float(), backend="chunked",
                            chunk_size=cpu_kernel.vector_width())
    assert calls and all(calls.intras) == (case == "unused group ids")
    assert _rel(got, want) < 1e-5


def test_fused_non_causal(calls):
    q, k, v, groups, factor = make(1, 4, 2, 3 * cpu_kernel.vector_width(), 9, 5)
    want = oal_attention(q.double(), k.double(), v.double(), groups, factor, backend="reference", causal=False)
    with torch.inference_mode():
        got = oal_attention(q, k, v, groups, factor.float(), backend="chunked", causal=False)
    assert calls and _rel(got, want) < 1e-5


def _bf16_mode(monkeypatch, mode: str) -> None:
    """Run bf16 queries on AMX tiles ("amx"; skipped without them), vector dot products ("dots") or widened
    ("fp32")."""
    if mode == "amx" and not cpu_kernel.amx():
        pytest.skip("no AMX-BF16 here (or the OS does not grant the tile registers)")
    monkeypatch.setattr(cpu_kernel, "AMX", mode == "amx")
    monkeypatch.setattr(cpu_kernel, "BF16_DOTS", mode != "fp32")
    assert cpu_kernel.amx() == (mode == "amx")


@pytest.mark.parametrize("mode", ["amx", "dots", "fp32"])
@pytest.mark.parametrize("d", [64, 5])
def test_fused_bf16_error_at_most_the_torch_paths(monkeypatch, calls, mode, d):
    """bf16 queries: with their quadratic features on AMX tiles (and the chunk states there too) or in bf16 dot
    products (features and state rounded to bf16, fp32 accumulation; odd d pads the last pair of a row) or widened
    to fp32, the error against float64 is no larger than the torch bf16 path's, and stays at bf16 SDPA's level."""
    monkeypatch.setenv("OAL_CPU_BF16", "1")
    _bf16_mode(monkeypatch, mode)
    q, k, v, groups, factor = make(1, 4, 2, 600, d, 64, g=5, dtype=torch.bfloat16)
    want = oal_attention(q.double(), k.double(), v.double(), groups, factor, backend="reference")
    with torch.inference_mode():
        got = oal_attention(q, k, v, groups, factor.float())
        monkeypatch.setenv("OAL_CPU_KERNEL", "0")
        torch_path = oal_attention(q, k, v, groups, factor.float())
    assert calls == [torch.bfloat16] * len(calls) and calls and all(calls.intras)
    assert bool(calls.chains) == (mode == "amx")  # the chunk states on the tiles too (chunks of 64 tokens)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_err = _rel(sdpa(q, k, v, is_causal=True, enable_gqa=True),
                    sdpa(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True))
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) <= 1.02 * _rel(torch_path, want), (_rel(got, want), _rel(torch_path, want))
    assert _rel(got, want) <= 1.25 * sdpa_err


# (chunks, batch, KV heads, d, query heads a KV head, chunk, dv + 1): the Qwen head shape; odd d (a padded pair, and
# pairs not a multiple of 16); value widths of whole tile blocks only (64, 16), a part only (8), both (13, 65), and
# more blocks than one pass takes (151)
READOUT_SHAPES = [(3, 1, 2, 64, 7, 64, 65), (2, 2, 1, 5, 3, 16, 8), (2, 1, 2, 17, 2, 48, 13), (1, 1, 1, 9, 3, 32, 151),
                  (1, 1, 1, 1, 1, 16, 2), (1, 2, 1, 8, 2, 16, 64), (2, 1, 1, 3, 1, 32, 16)]


@pytest.mark.parametrize("shape", READOUT_SHAPES)
def test_amx_readout_matches_the_dot_products_and_float64(monkeypatch, shape):
    """The AMX readout (Eq. 6 on the tiles) against the vector dot products, which round the same bf16 pairs and
    sum in another order: fp32 agreement; both against float64 on the rounded pairs; the output is written whole
    (NaN-filled before). Random states and weights of both signs, so that no error cancels."""
    _bf16_mode(monkeypatch, "amx")
    nc, b, hkv, d, rep, c, dv1 = shape
    gen = torch.Generator().manual_seed(sum(shape))
    feats = 1 + d + d * (d + 1) // 2
    x = torch.randn(nc, b, hkv, d, rep, c, generator=gen).to(torch.bfloat16)
    w = torch.randn(hkv, rep, feats, generator=gen)
    states = torch.randn(nc, b, hkv, feats, dv1, generator=gen)
    got = {}
    for mode in ("amx", "dots"):
        monkeypatch.setattr(cpu_kernel, "AMX", mode == "amx")
        got[mode] = cpu_kernel.readout(_token_major(x), w, states, torch.full((nc, b, hkv, dv1, rep * c), float("nan")))
    assert not got["amx"].isnan().any()
    assert _rel(got["amx"], got["dots"].double()) < 1e-5
    # float64 on what the tiles see: constant and linear features exact, quadratic ones and the state's rows
    # rounded to bf16 (Eq. 6: num_i = sum_f phi_f(q_i) S_f)
    xd = x.double().permute(0, 1, 2, 4, 5, 3)  # [nc, b, hkv, rep, c, d]
    r, t = torch.triu_indices(d, d)
    quad = (xd[..., r] * xd[..., t] * w[:, :, None, 1 + d:].double()).to(torch.bfloat16).double()
    phi = torch.cat([w[:, :, None, :1].double().expand(*xd.shape[:-1], 1), xd * w[:, :, None, 1:1 + d].double(),
                     quad], -1)
    sd = torch.cat([states[..., :1 + d, :], states[..., 1 + d:, :].to(torch.bfloat16).float()], -2).double()
    want = torch.einsum("nbhjcf,nbhfo->nbhojc", phi, sd).reshape(nc, b, hkv, dv1, rep * c)
    assert _rel(got["amx"], want) < 1e-5


@pytest.mark.parametrize("mode", ["amx", "dots", "fp32"])
@pytest.mark.parametrize("shape", [(2, 2, 2, 5, 3, 48, 8), (3, 1, 2, 64, 7, 64, 65), (1, 1, 1, 9, 2, 32, 21)])
def test_the_kernels_own_division_is_the_torch_division(monkeypatch, mode, shape):
    """With `final` the kernel divides each numerator by its denominator (Eq. 6-7) and writes the output rows
    itself: the same bits as torch dividing the numerator it returns into a strided view of the output, fp32 and
    bf16 (round to nearest even, NaN as torch writes it), value widths of whole vectors, a part (7, 20) and
    both; every other entry of the output's storage untouched. The queries are read from a strided view too."""
    nc, b, hkv, d, rep, c, dv1 = shape
    if mode != "fp32":
        _bf16_mode(monkeypatch, mode)
    gen = torch.Generator().manual_seed(sum(shape))
    feats = 1 + d + d * (d + 1) // 2
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    x = torch.randn(nc, b, hkv, d, rep, c, generator=gen).to(dtype)
    w = torch.randn(hkv, rep, feats, generator=gen)
    states = torch.randn(nc, b, hkv, feats, dv1, generator=gen)
    states[0, 0, 0, :, -1] = 0  # a zero denominator for the first item: inf outputs, as torch gives,
    states[0, 0, 0, 0] = 0  # and NaN where the numerator is 0 too (queries 0 leave only the constant feature)
    x[0, 0, 0, :, 0, :3] = 0
    q = torch.zeros(b, hkv * rep + 1, nc * c + 2, d + 3, dtype=dtype)[:, 1:, 2:, 1 : 1 + d]  # strided, as the
    q.copy_(_token_major(x))  # operator's block slices are
    num = cpu_kernel.readout(q, w, states, torch.empty(nc, b, hkv, dv1, rep * c))
    # the operator's output [B, Hq, N, dv] lives in a wider buffer: its rows are strided
    room = torch.full((b, hkv * rep + 1, nc * c + 5, dv1 + 2), -7.0).to(dtype)
    final = room[:, 1:, 3 : 3 + nc * c, 1:dv1]
    got = cpu_kernel.readout(q, w, states, None, final=final)
    assert got is final
    want = torch.full_like(room, -7.0)
    num = num.view(nc, b, hkv, dv1, rep, c)
    res = want[:, 1:, 3 : 3 + nc * c, 1:dv1].view(b, hkv, rep, nc, c, dv1 - 1).permute(3, 0, 1, 5, 2, 4)
    torch.div(num[:, :, :, :-1], num[:, :, :, -1:], out=res)
    assert final.isnan().any() and final.isinf().any()
    assert torch.equal(room.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def _chain_inputs(b, hkv, feats, nc, c, dv1, dtype, seed):
    """psi [b, hkv, F, nc * c], values ug whose rows are strided by head (a slice of heads, as the operator's
    slices are) and prev [nc + 1, ...] NaN-filled but for the state before the first chunk."""
    gen = torch.Generator().manual_seed(seed)
    psi = torch.randn(b, hkv, feats, nc * c, generator=gen).to(dtype)
    ug = torch.randn(b, hkv + 1, nc * c, dv1, generator=gen).to(dtype)[:, 1:]
    prev = torch.full((nc + 1, b, hkv, feats, dv1), float("nan"))
    prev[0] = torch.randn(b, hkv, feats, dv1, generator=gen)
    return psi, ug, prev


def _chain_float64(prev, psi, ug, c):
    """Eq. 5 in float64 from prev[0]: S_{i+1} = S_i + psi(K_i)^T U_i for every chunk i, stacked."""
    want = [prev[0].double()]
    for i in range(prev.shape[0] - 1):
        want.append(want[-1] + psi[..., i * c : (i + 1) * c].double() @ ug[:, :, i * c : (i + 1) * c].double())
    return torch.stack(want)


# (B, Hkv, F, chunks, chunk, dv + 1): the Qwen head shape at chunks of 64 and 128; F and dv + 1 with parts only
# (5, 3), whole 16-row blocks and a part (37 = 2 x 16 + 5; 20 = 16 + 4), whole only (16), several column passes (151)
CHAIN_SHAPES = [(1, 2, 2145, 3, 64, 65), (2, 3, 37, 2, 32, 20), (1, 1, 16, 1, 96, 16), (1, 1, 5, 2, 32, 3),
                (1, 2, 2145, 2, 128, 151)]


@pytest.mark.parametrize("shape", CHAIN_SHAPES)
def test_amx_chain_of_states_is_exact_in_fp32(shape):
    """The chain of chunk states on the AMX tiles (Eq. 5: S_{c+1} = S_c + psi(K_c)^T U_c) against float64 on the
    same bf16 features and values: fp32 level (the products are exact on the tiles, the sums fp32), where the torch
    path's bf16 increments are not; every state written (NaN-filled before); the values' rows strided by head as
    the operator's slices are."""
    if not cpu_kernel.amx():
        pytest.skip("no AMX-BF16 here (or the OS does not grant the tile registers)")
    b, hkv, feats, nc, c, dv1 = shape
    psi, ug, prev = _chain_inputs(*shape, torch.bfloat16, sum(shape))
    assert cpu_chain.chains(psi, torch.float32, c)
    assert cpu_chain.states(psi, ug, prev) is prev
    want = _chain_float64(prev, psi, ug, c)
    assert _rel(prev, want) < 1e-6
    rounded = want[0] + torch.stack([(psi[..., i * c : (i + 1) * c] @ ug[:, :, i * c : (i + 1) * c]).double()
                                     for i in range(nc)]).cumsum(0)
    assert _rel(rounded, want[1:]) > 10 * _rel(prev[1:], want[1:])  # what the torch path's rounding costs


@pytest.mark.parametrize("shape", [(1, 2, 2145, 3, 2, 65), (2, 3, 37, 2, 1, 20), (1, 1, 16, 1, 3, 16),
                                   (1, 1, 5, 2, 1, 3), (1, 2, 2145, 2, 8, 151)])
def test_fp32_chain_of_states_matches_float64(shape):
    """The fp32 chain (Eq. 5, blocks of state rows accumulated in registers): float64's states at fp32 level, every
    state written; the chunk in whole vectors (shape[4]), F not a multiple of the row block, columns in whole
    vectors and a rest (dot products over the tokens), the values strided by head."""
    b, hkv, feats, nc, vectors, dv1 = shape
    c = vectors * cpu_kernel.vector_width()
    psi, ug, prev = _chain_inputs(b, hkv, feats, nc, c, dv1, torch.float32, sum(shape))
    assert cpu_chain.chains(psi, torch.float32, c) and not cpu_chain.chains(psi, torch.float64, c)
    assert cpu_chain.states(psi, ug, prev) is prev
    assert _rel(prev, _chain_float64(prev, psi, ug, c)) < 1e-6


def test_chain_of_states_refuses_layouts_it_would_misread():
    psi, ug = torch.zeros(1, 2, 10, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 64, 5, dtype=torch.bfloat16)
    prev = torch.zeros(2, 1, 2, 10, 5)
    assert not cpu_chain.chains(psi, torch.float32, 48)  # bf16 in whole tile steps of 32 tokens only
    with pytest.raises(ValueError, match="ug: expected torch.float32 values"):
        cpu_chain.states(psi.float(), ug, prev)  # bf16 values against fp32 features
    with pytest.raises(ValueError, match="psi: expected contiguous float32 or bfloat16"):
        cpu_chain.states(psi.double(), ug.double(), prev)
    with pytest.raises(ValueError, match="C a multiple of 32 for 3 chunks"):  # 63 tokens: chunks of 21
        cpu_chain.states(psi[..., :63].contiguous(), ug, torch.zeros(4, 1, 2, 10, 5))
    with pytest.raises(ValueError, match="ug: expected torch.bfloat16 values .* with contiguous rows"):
        cpu_chain.states(psi, ug.transpose(-1, -2).contiguous().transpose(-1, -2), prev)
    with pytest.raises(ValueError, match="prev: expected a contiguous float32"):
        cpu_chain.states(psi, ug, prev.double())


def test_not_used_under_autograd_fp64_or_odd_chunks(calls):
    """Gradients, float64 and chunks that are not whole vectors run the torch path (and stay exact)."""
    q, k, v, groups, factor = make(1, 4, 2, 300, 8, 4)
    q.requires_grad_(True)
    out = oal_attention(q, k, v, groups, factor.float(), backend="chunked")
    (grad,) = torch.autograd.grad(out.sum(), q)
    qd = q.detach().double().requires_grad_(True)
    want = oal_attention(qd, k.double(), v.double(), groups, factor, backend="reference")
    (grad_want,) = torch.autograd.grad(want.sum(), qd)
    assert _rel(grad, grad_want) < 1e-4
    with torch.inference_mode():
        oal_attention(q.detach().double(), k.double(), v.double(), groups, factor, backend="chunked")
        odd = oal_attention(q.detach(), k, v, groups, factor.float(), backend="chunked",
                            chunk_size=cpu_kernel.vector_width() + 3)
    assert not calls
    assert _rel(odd, want.detach()) < 1e-5


def test_group_bound_matches_the_source():
    """cpu_kernel.GMAX (which calls take the intra-chunk term) is the C kernel's own array bound."""
    assert f"#define GMAX {cpu_kernel.GMAX} " in cpu_kernel.SOURCE.read_text()


def test_readout_refuses_layouts_the_kernel_would_misread():
    x = torch.zeros(1, 4, cpu_kernel.vector_width(), 3)  # queries [B, Hkv * rep, N, d]
    w, states = torch.zeros(2, 2, 10), torch.zeros(1, 1, 2, 10, 4)
    out = torch.zeros(1, 1, 2, 4, 2 * cpu_kernel.vector_width())
    cpu_kernel.readout(x, w, states, out)  # the layout it takes
    with pytest.raises(ValueError, match="w: expected a contiguous float32"):
        cpu_kernel.readout(x, w.double(), states, out)
    with pytest.raises(ValueError, match="states: .*shape \\[1, 1, 2, 10, 4\\]"):
        cpu_kernel.readout(x, w, torch.zeros(1, 1, 2, 9, 4), out)  # F of another head dim
    with pytest.raises(ValueError, match="out: .*not contiguous"):
        cpu_kernel.readout(x, w, states, out.transpose(-1, -2).contiguous().transpose(-1, -2))
    with pytest.raises(ValueError, match="q: expected .*last dim contiguous"):
        cpu_kernel.readout(x.transpose(-1, -2).contiguous().transpose(-1, -2), w, states, out)
    with pytest.raises(ValueError, match="q: expected .* for 1 chunks"):
        cpu_kernel.readout(x[:, :3], w, states, out)  # a query head missing
    if cpu_kernel.vector_width() > 1:
        with pytest.raises(ValueError, match="q: expected .* multiple of"):  # chunks not whole vectors
            cpu_kernel.readout(x[:, :, :-1], w, states, out)
    c = cpu_kernel.vector_width()
    for g in (0, cpu_kernel.GMAX):  # no group, or more than the kernel's z sums hold
        intra = cpu_kernel.Intra(torch.zeros(1, 1, 2, c, 4), torch.zeros(1, 1, 2, c, 4),
                                 torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, g + 1, dtype=torch.int32),
                                 torch.zeros(4, g + 1, g + 1), 1e-6)
        with pytest.raises(ValueError, match="intra.lower: 1 to 15 groups"):
            cpu_kernel.readout(x, w, states, out, intra)
    final = torch.zeros(1, 4, cpu_kernel.vector_width(), 3)
    cpu_kernel.readout(x, w, states, None, final=final)  # the output it writes
    with pytest.raises(ValueError, match="exactly one of out"):
        cpu_kernel.readout(x, w, states, out, final=final)
    with pytest.raises(ValueError, match="final: .*shape \\[1, 4, 16, 3\\]" if cpu_kernel.vector_width() == 16
                       else "final: expected"):
        cpu_kernel.readout(x, w, states, None, final=final[:, :3])
    with pytest.raises(ValueError, match="final: .*last dim is contiguous"):
        cpu_kernel.readout(x, w, states, None, final=final.transpose(-1, -2).contiguous().transpose(-1, -2))


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils) to list the library's symbols")
def test_the_library_shares_no_object_with_another_build():
    """No GNU_UNIQUE symbol ('u': a static local of an inline function, which the dynamic loader merges across every
    library of the process, RTLD_LOCAL or not): two builds of the kernel in one process (another revision, the
    sanitizer's) must not share the AMX path's per-thread scratch, whose layout may differ."""
    cpu_kernel.available()
    lib = Path(cpu_kernel._STATUS)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    assert "oal_readout_bf16" in symbols.stdout
    assert [ln for ln in symbols.stdout.splitlines() if ln.split()[1:2] == ["u"]] == []


def test_build_is_cached_and_missing_compiler_is_one_line(monkeypatch, tmp_path, caplog):
    path = cpu_kernel.build(tmp_path)
    stamp = path.stat().st_mtime_ns
    assert cpu_kernel.build(tmp_path) == path and path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.with_suffix(".json").name, path.name]  # and its record
    if platform.machine() in ("x86_64", "AMD64"):  # another target is another build (a mixed cluster's AVX2 nodes)
        monkeypatch.setenv("OAL_CPU_MARCH", "x86-64-v2")
        assert cpu_kernel.build(tmp_path) != path
        monkeypatch.delenv("OAL_CPU_MARCH")
    monkeypatch.setenv("CXX", "ccache g++")  # a $CXX that is not one program was called "no compiler found"
    with pytest.raises(RuntimeError, match="CXX='ccache g\\+\\+' is not a program on PATH .*unset it"):
        cpu_kernel.build(tmp_path / "other")
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_kernel.build(tmp_path / "other")
    for name, value in (("_LIB", None), ("_TRIED", False), ("_STATUS", "")):
        monkeypatch.setattr(cpu_kernel, name, value)
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "empty"))
    q, k, v, groups, factor = make(1, 2, 1, 300, 4, 3)
    with caplog.at_level(logging.WARNING, logger="oal"), torch.inference_mode():
        out = oal_attention(q, k, v, groups, factor.float(), backend="chunked")  # the torch path
    assert not cpu_kernel.available()
    assert [r.getMessage() for r in caplog.records if "fused CPU kernel is unavailable" in r.getMessage()]
    want = oal_attention(q.double(), k.double(), v.double(), groups, factor, backend="reference")
    assert _rel(out, want) < 1e-5


def test_a_failing_compile_names_the_error(monkeypatch, tmp_path):
    bad = tmp_path / "readout.cpp"
    bad.write_text("int broken( {\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", bad)
    with pytest.raises(RuntimeError, match=r"failed on readout\.cpp \(building into .*\): .*error"):
        cpu_kernel.build(tmp_path / "build")
    assert not list((tmp_path / "build").iterdir())  # nothing half-written


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("march,width", [("x86-64-v3", 8), ("x86-64", 4)])
def test_other_vector_widths(monkeypatch, tmp_path, calls, march, width):
    """The AVX2 (8-wide, 16 registers) and SSE (4-wide) builds of the kernel, as a mixed cluster's older nodes
    build it, against the reference."""
    monkeypatch.setenv("OAL_CPU_MARCH", march)
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path))
    for name, value in (("_LIB", None), ("_TRIED", False), ("_STATUS", "")):  # restored afterwards
        monkeypatch.setattr(cpu_kernel, name, value)
    assert cpu_kernel.vector_width() == width
    q, k, v, groups, factor = make(2, 6, 2, 150, 7, 5, g=4)
    want = oal_attention(q.double(), k.double(), v.double(), groups, factor, backend="reference")
    with torch.inference_mode():
        got = oal_attention(q, k, v, groups, factor.float(), backend="chunked", chunk_size=3 * width)
    assert calls and all(calls.intras) and _rel(got, want) < 1e-5
    from oal.ops.window import window_attention  # the decoding steps at this width (value columns 6: a tail)

    kw = dict(window=4, sinks=1, groups=groups, factor=factor)
    _, state = window_attention(q[:, :, :147], k[:, :, :147], v[:, :, :147], output_final_state=True, **kw)
    with torch.inference_mode():
        got = window_attention(q[:, :, 147:], k[:, :, 147:], v[:, :, 147:], initial_state=state, **kw)
    ref = window_attention(q.double(), k.double(), v.double(), backend="reference", **kw)
    assert _rel(got, ref[:, :, 147:]) < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="AddressSanitizer through LD_PRELOAD")
def test_clean_under_address_sanitizer():
    """scripts/cpu_kernel_asan.py: the kernel built with -fsanitize=address at odd shapes, fp32 and bf16 (about 30
    s)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "cpu_kernel_asan.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    if "has no libasan.so" in res.stderr + res.stdout:
        pytest.skip("the compiler has no AddressSanitizer runtime")
    assert res.returncode == 0 and "clean under AddressSanitizer" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


# ------------------------------------------------------------------------------ the decoding step (oal_decode_f32)


@pytest.fixture
def decodes(monkeypatch):
    """Records the fused decoding step's calls (their token counts)."""
    seen = []
    real = cpu_kernel.decode

    def spy(k, u, q, w, state):
        seen.append(k.shape[2])
        return real(k, u, q, w, state)

    monkeypatch.setattr(cpu_kernel, "decode", spy)
    return seen


@pytest.mark.parametrize("dv", [7, 64, 150], ids=["tail-only", "vectors+tail", "wide"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_decoding_step_matches_the_token_loop_and_the_reference(monkeypatch, decodes, dv, tokens):
    """Algorithm 1 (Eq. 5 then Eq. 6) for a few tokens on a state: the C step (one pass per token and head) gives
    the torch loop's outputs and state and the fp64 reference's outputs; value widths that leave only scalar
    columns, full vectors and a tail, and more columns than the step keeps in registers."""
    q, k, v, groups, factor = make(2, 6, 2, 12, 9, dv)
    _, state = oal_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], groups, factor.float(), output_final_state=True)
    step = [t[:, :, 9 : 9 + tokens] for t in (q, k, v)]
    before = state.clone()
    with torch.inference_mode():
        got, got_state = oal_attention(*step, groups, factor.float(), initial_state=state, output_final_state=True)
    assert decodes == [tokens] and torch.equal(state, before)  # a new state: the caller's is left alone
    monkeypatch.setattr(cpu_kernel, "enabled", lambda: False)
    with torch.inference_mode():
        want, want_state = oal_attention(*step, groups, factor.float(), initial_state=state, output_final_state=True)
    assert decodes == [tokens]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-6, atol=1e-5)
    ref = oal_attention(*(t[:, :, : 9 + tokens].double() for t in (q, k, v)), groups, factor, backend="reference")
    assert _rel(got, ref[:, :, 9:]) < 1e-5


def test_decoding_step_updates_the_caches_state_in_place(decodes):
    from oal.ops import checks

    q, k, v, groups, factor = make(1, 4, 2, 6, 8, 8)
    _, state = oal_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], groups, factor.float(), output_final_state=True)
    before = state.clone()
    with torch.no_grad(), checks.cache_owned(state):
        _, final = oal_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], groups, factor.float(), initial_state=state,
                                 output_final_state=True)
    assert decodes == [1] and final is state and not torch.equal(state, before)


def test_decoding_step_split_over_workers_gives_the_same(monkeypatch, decodes):
    """Batch rows and KV heads split over the operator's workers (a large state) give the single call's result."""
    q, k, v, groups, factor = make(3, 6, 3, 7, 8, 5)
    _, state = oal_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], groups, factor.float(), output_final_state=True)
    step = [t[:, :, 6:] for t in (q, k, v)]
    with torch.inference_mode():
        one = oal_attention(*step, groups, factor.float(), initial_state=state)
        monkeypatch.setattr(cpu_kernel, "DECODE_SPLIT", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        split = oal_attention(*step, groups, factor.float(), initial_state=state)
    assert decodes == [1, 1] and torch.equal(one, split)


def test_decoding_step_is_not_used_under_autograd_or_fp64(decodes):
    q, k, v, groups, factor = make(1, 2, 1, 5, 6, 4)
    _, state = oal_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], groups, factor.float(), output_final_state=True)
    leaf = q[:, :, 4:].clone().requires_grad_()
    out = oal_attention(leaf, k[:, :, 4:], v[:, :, 4:], groups, factor.float(), initial_state=state)
    assert torch.autograd.grad(out.sum(), leaf)[0].abs().sum() > 0
    with torch.inference_mode():
        oal_attention(*(t[:, :, 4:].double() for t in (q, k, v)), groups, factor, initial_state=state.double())
    assert decodes == []


def test_decoding_step_refuses_shapes_the_kernel_would_misread():
    k, u, q = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 6), torch.zeros(1, 4, 1, 4)
    state, w = torch.zeros(1, 2, 15, 6), torch.zeros(4, 15)
    with pytest.raises(ValueError, match=r"^u: expected shape \[1, 2, 1, 6\]"):
        cpu_kernel.decode(k, u[..., :5], q, w, state)
    with pytest.raises(ValueError, match=r"^w: expected shape \[4, 15\]"):
        cpu_kernel.decode(k, u, q, w[:3], state)
    assert not cpu_kernel.decodes(state.transpose(2, 3).contiguous().transpose(2, 3))  # rows not contiguous
    assert not cpu_kernel.decodes(state.double())


@pytest.mark.parametrize("window,sinks,tokens", [(3, 2, 2), (1, 0, 4), (2, 4, 3)],
                         ids=["W3-S2", "W1-no-sinks", "sinks-fill-during-calls"])
@pytest.mark.parametrize("kernel", [True, False], ids=["oal-swa", "swa"])
@pytest.mark.parametrize("q_scale", [1.0, 1e10], ids=["plain", "rescaled"])
def test_window_decoding_in_c_matches_the_token_loop(monkeypatch, kernel, window, sinks, tokens, q_scale):
    """swa / oal-swa decoding on the CPU (`oal_window_decode_f32`: sinks, window rows, the evicted row into OAL's
    prefix (Eq. 5), its readout (Eq. 6) and the window under one normaliser, with the kernel's rescaling when
    the scores would overflow): the torch token loop's outputs and state, and the fp64 dense reference."""
    from oal.ops import checks
    from oal.ops.window import window_attention

    q, k, v, groups, factor = make(2, 6, 2, 14, 9, 7, seed=window + sinks)
    q = q * q_scale
    kw = dict(window=window, sinks=sinks, groups=groups if kernel else None,
              factor=factor.float() if kernel else None)
    seen = []
    real = cpu_kernel.window_decode
    monkeypatch.setattr(cpu_kernel, "window_decode", lambda *a, **k: seen.append(1) or real(*a, **k))

    def decode_all():
        _, state = window_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], output_final_state=True, **kw)
        outs = []
        with torch.no_grad():
            for t in range(2, 14, tokens):
                with checks.cache_owned(state):
                    out, state = window_attention(*(x[:, :, t : t + tokens] for x in (q, k, v)),
                                                  initial_state=state, output_final_state=True, **kw)
                outs.append(out)
        return torch.cat(outs, 2), state

    got, got_state = decode_all()
    assert len(seen) == len(range(2, 14, tokens))
    monkeypatch.setattr(cpu_kernel, "enabled", lambda: False)
    want, want_state = decode_all()
    assert len(seen) == len(range(2, 14, tokens))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    slots = (window + sinks) * (9 + 7 + 1)
    assert torch.equal(got_state[..., :slots], want_state[..., :slots])  # keys and values, copied
    assert _rel(got_state[..., slots:], want_state[..., slots:]) < 1e-6 if kernel else got_state.shape[-1] == slots
    ref = window_attention(q.double(), k.double(), v.double(), backend="reference", window=window, sinks=sinks,
                           groups=kw["groups"], factor=factor if kernel else None)
    assert _rel(got, ref[:, :, 2:]) < 1e-5


def test_window_decoding_in_c_leaves_a_callers_state_alone():
    from oal.ops.window import window_attention

    q, k, v, groups, factor = make(1, 4, 2, 9, 8, 8)
    kw = dict(window=3, sinks=1, groups=groups, factor=factor.float())
    _, state = window_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], output_final_state=True, **kw)
    before = state.clone()
    with torch.no_grad():
        _, final = window_attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], initial_state=state,
                                    output_final_state=True, **kw)
    assert torch.equal(state, before) and not torch.equal(final, before)
