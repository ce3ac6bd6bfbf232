"""The OAL operator: every backend against the dense reference (Eq. 7), outputs and gradients, in float64."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oal.ops import empty_state, feature_dim, oal_attention, split_state
from oal.ops.kernel import (
    coefficients,
    global_embedded_factor,
    key_features,
    perturbed_factor,
    query_features,
    taylor_factor,
)
from oal.ops.reference import dense_kernel

F64 = torch.float64


def make_inputs(b, hq, hkv, n, d, dv, g, *, seed=0, unused=False, dtype=F64, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=F64)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=F64)
    hi = max(g - 1, 1) if unused else g  # leave the last id unused in every head
    groups = torch.randint(0, hi, (hq, d), generator=gen)
    factor = torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64) * 0.5
    out = [t.to(dtype) for t in (q, k, v)] + [groups, factor.to(dtype if dtype == F64 else torch.float32)]
    if requires_grad:
        for t in (out[0], out[1], out[2], out[4]):
            t.requires_grad_(True)
    return out


CASES = [
    # b, hq, hkv, n, d, dv, g, chunk
    (1, 1, 1, 1, 16, 16, 1, 64),
    (2, 2, 1, 63, 16, 16, 3, 16),
    (1, 7, 1, 63, 16, 8, 6, 10),
    (1, 2, 2, 1000, 16, 16, 2, 64),
    (1, 4, 2, 130, 64, 64, 5, 33),
    (2, 7, 1, 37, 64, 24, 4, 64),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_backends_match_reference(case, causal):
    b, hq, hkv, n, d, dv, g, chunk = case
    q, k, v, groups, factor = make_inputs(b, hq, hkv, n, d, dv, g, unused=True)
    ref = oal_attention(q, k, v, groups, factor, backend="reference", causal=causal)
    assert ref.shape == (b, hq, n, dv) and ref.dtype == F64
    backends = ["chunked", "auto"] + (["recurrent"] if n <= 200 else [])
    for backend in backends:
        size = None if backend == "auto" else chunk  # auto: default chunking, dense single chunk when short
        out = oal_attention(q, k, v, groups, factor, backend=backend, causal=causal, chunk_size=size)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10, msg=f"{backend} causal={causal}")


def test_reference_is_eq7_by_hand():
    """One query, two keys, brute force over the definition kappa = eps + |L^T s_bar|^2."""
    q, k, v, groups, factor = make_inputs(1, 1, 1, 2, 4, 3, 2, seed=3)
    eps, scale = 1e-3, 0.5
    out = oal_attention(q, k, v, groups, factor, eps=eps, scale=scale, backend="reference")
    lower = torch.tril(factor[0])
    kap = []
    for j in range(2):
        s = [scale * sum(q[0, 0, 1, r] * k[0, 0, j, r] for r in range(4) if groups[0, r] == gg) for gg in range(2)]
        s_bar = torch.stack([torch.ones((), dtype=F64), torch.as_tensor(s[0]), torch.as_tensor(s[1])])
        kap.append(eps + (lower.T @ s_bar).pow(2).sum())
    want = (kap[0] * v[0, 0, 0] + kap[1] * v[0, 0, 1]) / (kap[0] + kap[1])
    torch.testing.assert_close(out[0, 0, 1], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "case", [(1, 2, 1, 63, 16, 16, 3, 16), (2, 4, 2, 41, 16, 8, 2, 7), (1, 7, 1, 20, 64, 16, 5, 8)]
)
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_reference(case, causal):
    b, hq, hkv, n, d, dv, g, chunk = case
    grads = {}
    for backend in ("reference", "chunked", "recurrent"):
        q, k, v, groups, factor = make_inputs(b, hq, hkv, n, d, dv, g, unused=True, requires_grad=True)
        out = oal_attention(q, k, v, groups, factor, backend=backend, causal=causal, chunk_size=chunk)
        weight = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
        (out * weight).sum().backward()
        grads[backend] = [t.grad for t in (q, k, v, factor)]
    for backend in ("chunked", "recurrent"):
        for name, got, want in zip("q k v factor".split(), grads[backend], grads["reference"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"{backend} d{name}")


def test_gradcheck_chunked_tiny():
    q, k, v, groups, factor = make_inputs(1, 2, 1, 5, 4, 3, 2, requires_grad=True)
    fn = lambda q, k, v, f: oal_attention(q, k, v, groups, f, backend="chunked", chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, factor))


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 70),
    d=st.sampled_from([16, 64]),
    rep=st.sampled_from([1, 2, 7]),
    g=st.integers(1, 6),
    chunk=st.integers(1, 40),
    causal=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_random_shapes(n, d, rep, g, chunk, causal, seed):
    q, k, v, groups, factor = make_inputs(1, rep, 1, n, d, 8, g, seed=seed, unused=seed % 2 == 0)
    ref = oal_attention(q, k, v, groups, factor, backend="reference", causal=causal)
    out = oal_attention(q, k, v, groups, factor, backend="chunked", causal=causal, chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_then_decode_equals_one_call(causal):
    q, k, v, groups, factor = make_inputs(2, 4, 2, 50, 16, 8, 3)
    full, full_state = oal_attention(q, k, v, groups, factor, causal=causal, output_final_state=True)
    p = 31
    out, state = oal_attention(
        q[:, :, :p], k[:, :, :p], v[:, :, :p], groups, factor, causal=causal, output_final_state=True
    )
    if causal:
        torch.testing.assert_close(out, full[:, :, :p], rtol=0, atol=1e-10)
        steps = []
        for i in range(p, 50):
            sl = slice(i, i + 1)
            o, state = oal_attention(
                q[:, :, sl],
                k[:, :, sl],
                v[:, :, sl],
                groups,
                factor,
                causal=True,
                initial_state=state,
                output_final_state=True,
                backend="recurrent",
            )
            steps.append(o)
        torch.testing.assert_close(torch.cat(steps, dim=2), full[:, :, p:], rtol=0, atol=1e-10)
    else:  # non-causal continuation: the second call sees the first call's keys through the state
        _, state = oal_attention(
            q[:, :, p:],
            k[:, :, p:],
            v[:, :, p:],
            groups,
            factor,
            causal=False,
            initial_state=state,
            output_final_state=True,
        )
    torch.testing.assert_close(state, full_state, rtol=0, atol=1e-9)


@pytest.mark.parametrize("n_new", [1, 3, 5])
def test_auto_continuation_matches_chunked(n_new):
    """`auto` runs short continuations (decoding) with the token loop: same outputs and state as chunked."""
    q, k, v, groups, factor = make_inputs(2, 6, 2, 30, 16, 5, 3, seed=9)
    pre = 30 - n_new
    _, state = oal_attention(q[:, :, :pre], k[:, :, :pre], v[:, :, :pre], groups, factor, output_final_state=True)
    new = [t[:, :, pre:] for t in (q, k, v)]
    got, got_state = oal_attention(*new, groups, factor, initial_state=state, output_final_state=True)
    want, want_state = oal_attention(*new, groups, factor, initial_state=state, output_final_state=True,
                                     backend="chunked")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_state, want_state, rtol=0, atol=1e-9)


def test_reference_state_matches_chunked():
    q, k, v, groups, factor = make_inputs(1, 2, 1, 20, 16, 4, 2)
    init = oal_attention(q, k, v, groups, factor, output_final_state=True)[1]
    outs = [
        oal_attention(q, k, v, groups, factor, backend=be, initial_state=init, output_final_state=True)
        for be in ("reference", "chunked", "recurrent")
    ]
    for out, state in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=0, atol=1e-10)
        torch.testing.assert_close(state, outs[0][1], rtol=0, atol=1e-9)


def test_state_layout_and_size():
    d, dv = 16, 8
    q, k, v, groups, factor = make_inputs(1, 4, 2, 9, d, dv, 2)
    _, state = oal_attention(q, k, v, groups, factor, output_final_state=True)
    assert state.shape == (1, 2, feature_dim(d), dv + 1)
    assert state[0, 0].numel() == (1 + d + d * (d + 1) // 2) * (dv + 1)
    h0, h1, h2 = split_state(state, d)
    u = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    torch.testing.assert_close(h0, u.sum(2))  # Eq. 5, H0 = sum_j u_j
    torch.testing.assert_close(h1, torch.einsum("bhjr,bhjl->bhrl", k, u))  # H1_r = sum_j k_jr u_j
    r, t = torch.triu_indices(d, d)
    torch.testing.assert_close(h2, torch.einsum("bhjp,bhjl->bhpl", k[..., r] * k[..., t], u))  # packed H2
    assert empty_state(1, 2, d, dv).shape == state.shape


def test_dense_kernel_is_eq7_entry_by_entry():
    """The oracle against Eq. 7 written out for one (head, query, key) at a time, with GQA and a key count other
    than the query count: s_g = sum over the dims r of group g of q_r k_r * scale, s_bar = [1, s_1..s_G],
    kappa = eps + |L^T s_bar|^2."""
    q, k, _, groups, factor = make_inputs(2, 4, 2, 5, 5, 2, 3)
    q = q[:, :, :3]  # 3 queries for 5 keys
    got = dense_kernel(q, k, groups, factor, eps=0.01, scale=0.3)
    lower = torch.tril(factor)
    for b, h, i, j in itertools.product(range(2), range(4), range(3), range(5)):
        s_bar = torch.zeros(4, dtype=F64)
        s_bar[0] = 1.0
        for r in range(5):
            s_bar[1 + groups[h, r]] += 0.3 * q[b, h, i, r] * k[b, h // 2, j, r]
        assert got[b, h, i, j].item() == pytest.approx(0.01 + float((lower[h].T @ s_bar).square().sum()), rel=1e-12)


def test_positive_denominator():
    """kappa >= eps for every pair, so the denominator is >= eps times the number of visible keys."""
    eps = 1e-3
    q, k, v, groups, factor = make_inputs(1, 2, 1, 40, 16, 4, 3)
    q, k = q * 5, k * 5
    kappa = dense_kernel(q, k, groups, factor, eps=eps, scale=0.25)
    assert bool((kappa >= eps - 1e-12).all())
    a, b, c = coefficients(factor, groups, eps)
    phi = query_features(q, a, b, c, 0.25)
    u = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    den = (phi @ (key_features(k).transpose(-1, -2) @ u))[..., -1]  # all 40 keys
    assert bool((den >= eps * 40 * (1 - 1e-9)).all())


def test_coefficients_match_definition():
    groups = torch.tensor([[0, 1, 1, 2], [2, 2, 0, 0]])
    factor = torch.randn(2, 4, 4, dtype=F64)
    a, b, c = coefficients(factor, groups, 0.1)
    m = torch.tril(factor) @ torch.tril(factor).transpose(-1, -2)
    for h in range(2):
        assert a[h] == pytest.approx(0.1 + m[h, 0, 0].item())
        for r in range(4):
            assert b[h, r] == pytest.approx(2 * m[h, 0, groups[h, r] + 1].item())
            for t in range(4):
                assert c[h, r, t] == pytest.approx(m[h, groups[h, r] + 1, groups[h, t] + 1].item())


def test_learned_global_equals_scalar_quadratic():
    """A global factor embedded into any grouping gives the scalar a + b s + c s^2 (App. D, Eq. 23)."""
    q, k, v, groups, _ = make_inputs(1, 3, 1, 30, 16, 8, 4)
    glob = torch.randn(3, 2, 2, dtype=F64)
    out = oal_attention(q, k, v, groups, global_embedded_factor(glob, 4), eps=1e-6)
    m = torch.tril(glob) @ torch.tril(glob).transpose(-1, -2)
    a, bb, cc = 1e-6 + m[:, 0, 0], 2 * m[:, 0, 1], m[:, 1, 1]
    s = q @ k.transpose(-1, -2) / math.sqrt(16)
    w = (a[:, None, None] + bb[:, None, None] * s + cc[:, None, None] * s * s).tril()
    want = (w @ v) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)


def test_taylor_factor_is_taylor():
    q, k, v, groups, _ = make_inputs(1, 2, 2, 12, 16, 8, 3)
    out = oal_attention(q, k, v, groups, taylor_factor(2, 3, dtype=F64), eps=0.0)
    s = q @ k.transpose(-1, -2) / 4.0
    w = (1 + s + s * s / 2).tril()
    torch.testing.assert_close(out, (w @ v) / w.sum(-1, keepdim=True), rtol=0, atol=1e-10)


@pytest.mark.parametrize("a, b, c", [(1.0, 1.0, 1.0), (2.0, -1.5, 0.5), (0.05, 0.0, 0.3), (1.55, 2.0, 2.0 / 3)])
def test_learned_global_factor_gives_its_quadratic(a, b, c):
    """Eq. 7 with one group and L = learned_global_from_coefficients(a, b, c): kappa = a + b s + c s^2 (the
    learned global quadratic's coefficients), including the edges a = eps and b^2 = 4 (a - eps) c."""
    from oal.ops.kernel import learned_global_from_coefficients

    eps = 0.05  # large enough that a - eps and a + eps differ beyond fp32's rounding
    q, k, v, _, _ = make_inputs(1, 2, 2, 13, 16, 8, 1)
    factor = learned_global_from_coefficients(a, b, c, eps).to(F64).expand(2, 2, 2)
    out = oal_attention(q, k, v, torch.zeros(2, 16, dtype=torch.long), factor, eps=eps)
    s = q @ k.transpose(-1, -2) / 4.0
    w = (a + b * s + c * s * s).tril()
    # L is built in fp32 (torch's default dtype): agreement to fp32's rounding, not fp64's
    torch.testing.assert_close(out, (w @ v) / w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


def test_perturbed_factor_is_lower_and_seeded():
    """Gaussian noise of std `std` times each head's largest lower-triangle entry (1e-3 for an all-zero head), drawn
    from the generator, on the lower triangle only: heads of scale 3, 0.5 and 0, and an upper entry it must drop."""
    base = taylor_factor(3, 3) * torch.tensor([3.0, 0.5, 0.0])[:, None, None]
    base[0, 0, 3] = 100.0  # upper triangle: neither a size nor kept
    one = perturbed_factor(base, 0.1, generator=torch.Generator().manual_seed(1))
    two = perturbed_factor(base, 0.1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(one, two) and torch.equal(one, torch.tril(one)) and not torch.equal(one, torch.tril(base))
    noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(1))
    size = torch.stack([torch.tril(h).abs().max() for h in base]).clamp_min(1e-3)  # 3 * 1.0, 0.5 * 1.0, 1e-3
    torch.testing.assert_close(one, torch.tril(base + 0.1 * size[:, None, None] * noise), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs(dtype):
    q, k, v, groups, factor = make_inputs(1, 4, 2, 70, 16, 16, 3, dtype=dtype)
    out, state = oal_attention(q, k, v, groups, factor, output_final_state=True, chunk_size=32)
    assert out.dtype == dtype and state.dtype == torch.float32
    want = oal_attention(*(t.double() for t in (q, k, v)), groups, factor.double(), backend="reference")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_chunked_training_memory_is_not_quadratic():
    """Autograd saves only chunk inputs and the running state: nothing of size N x N is kept for backward."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 256, 16, 8, 2, dtype=torch.float32, requires_grad=True)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = oal_attention(q, k, v, groups, factor, chunk_size=32)
    out.sum().backward()
    assert q.grad is not None and factor.grad is not None
    assert max(sizes) < 256 * 256  # an N x N kernel per head would be 65536 entries


BAD = [
    ("q", dict(q=torch.randn(2, 3, 4))),
    ("k", dict(k=torch.randn(1, 1, 5, 16))),
    ("v", dict(v=torch.randn(1, 1, 9, 4))),
    ("q/k", dict(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 4))),
    ("groups", dict(groups=torch.zeros(2, 15, dtype=torch.long))),
    ("groups", dict(groups=torch.full((2, 16), 3))),
    ("groups", dict(groups=torch.full((2, 16), -1))),
    ("groups", dict(groups=torch.zeros(2, 16))),
    ("factor", dict(factor=torch.randn(2, 3, 4))),
    ("factor", dict(factor=torch.randn(3, 3, 3))),
    ("eps", dict(eps=-1.0)),
    ("eps", dict(eps=float("nan"))),
    ("q", dict(q=torch.full((1, 2, 8, 16), float("nan")))),
    ("k", dict(k=torch.full((1, 1, 8, 16), float("inf")))),
    ("v", dict(v=torch.full((1, 1, 8, 4), float("nan")))),
    ("backend", dict(backend="fast")),
    ("initial_state", dict(initial_state=torch.zeros(1, 1, 3, 5))),
]


@pytest.mark.parametrize("arg,override", BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_names_argument(arg, override):
    kw = dict(
        q=torch.randn(1, 2, 8, 16),
        k=torch.randn(1, 1, 8, 16),
        v=torch.randn(1, 1, 8, 4),
        groups=torch.zeros(2, 16, dtype=torch.long),
        factor=torch.randn(2, 3, 3),
    )
    kw.update(override)
    extra = {key: kw.pop(key) for key in ("eps", "backend", "initial_state") if key in kw}
    with pytest.raises(ValueError, match=rf"^{arg}"):
        oal_attention(kw["q"], kw["k"], kw["v"], kw["groups"], kw["factor"], **extra)


def test_scratch_buffers_are_fully_written(monkeypatch):
    """Scratch buffers start as NaN: any entry read before it is written would poison the output (fla habit)."""
    import oal.ops.chunked as chunked

    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)
    q, k, v, groups, factor = make_inputs(1, 4, 2, 700, 16, 8, 3, seed=5)  # two blocks, the last one partial
    for causal in (True, False):
        ref = oal_attention(q, k, v, groups, factor, backend="reference", causal=causal)
        out = oal_attention(q, k, v, groups, factor, backend="chunked", causal=causal, chunk_size=48)
        assert bool(torch.isfinite(out).all())
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
