"""Performer, SpectraFormer, DiJiang, TaylorShift: linear path == dense reference (forward and gradients, fp64,
odd sizes, GQA), causality, state continuation, determinism, positivity."""

import pytest
import torch

from oal.methods import build_method, method_names
from oal.methods.features import feature_attention
from oal.methods.spectraformer import hadamard

BASELINES = ("performer", "spectraformer", "dijiang", "taylorshift")
D = 16


def _make(name, hq, hkv, seed=0, **kw):
    if name == "performer":
        kw.setdefault("n_features", 37)
    m = build_method(name, hq, hkv, D, layer_idx=1, seed=seed, chunk_size=8, **kw).double()
    with torch.no_grad():  # move trainable parameters off their init so their gradients are generic
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    return m


def _qkv(hq, hkv, n, seed=0, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(2, hkv, n, D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(2, hkv, n, 5, generator=g, dtype=torch.float64)
    return q, k, v


def test_registered():
    assert set(BASELINES) <= set(method_names())


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("n", [1, 20, 63])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_matches_reference(name, n, hq, hkv, causal):
    m = _make(name, hq, hkv)
    q, k, v = _qkv(hq, hkv, n)
    out = m(q, k, v, causal=causal)
    ref = m.reference(q, k, v, causal=causal)
    assert out.shape == (2, hq, n, 5)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_reference(name, causal):
    m = _make(name, 4, 2)
    q, k, v = _qkv(4, 2, 19, seed=1)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    params = [p for p in m.parameters() if p.requires_grad]
    w = torch.randn(2, 4, 19, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    g_lin = torch.autograd.grad((m(q, k, v, causal=causal) * w).sum(), leaves + params)
    g_ref = torch.autograd.grad((m.reference(q, k, v, causal=causal) * w).sum(), leaves + params)
    assert len(params) == (0 if name == "performer" else (3 if name == "spectraformer" else 1))
    for a, b in zip(g_lin, g_ref, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", BASELINES)
def test_causal_no_future_leak(name):
    m = _make(name, 4, 2)
    q, k, v = _qkv(4, 2, 30, seed=2)
    out = m(q, k, v)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[:, :, 17:] *= 6.0  # large future keys would move a non-causal shared key shift
    v2[:, :, 17:] += 3.0
    q2[:, :, 17:] -= 2.0
    out2 = m(q2, k2, v2)
    torch.testing.assert_close(out[:, :, :17], out2[:, :, :17], rtol=1e-12, atol=1e-13)
    assert not torch.allclose(out[:, :, 17:], out2[:, :, 17:])


@pytest.mark.parametrize("name", BASELINES)
def test_state_continues_sequence(name):
    m = _make(name, 4, 2)
    q, k, v = _qkv(4, 2, 23, seed=4)
    full = m(q, k, v)
    out1, st = m(q[:, :, :10], k[:, :, :10], v[:, :, :10], output_final_state=True)
    parts, state = [out1], st
    for t in range(10, 23):  # token-by-token decoding
        o, state = m(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], initial_state=state,
                     output_final_state=True)
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts, dim=2), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", BASELINES)
def test_positive_weights_and_determinism(name):
    q, k, _ = _qkv(4, 2, 17, seed=5, scale=3.0)
    w = _make(name, 4, 2, seed=7).dense_kernel(q, k)
    assert w.shape == (2, 4, 17, 17) and bool((w > 0).all())
    torch.testing.assert_close(w, _make(name, 4, 2, seed=7).dense_kernel(q, k), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["performer", "spectraformer", "dijiang"])
def test_seed_and_layer_change_random_draw(name):
    q, k, _ = _qkv(2, 2, 9, seed=6)
    base = _make(name, 2, 2, seed=0).dense_kernel(q, k)
    assert not torch.allclose(base, _make(name, 2, 2, seed=1).dense_kernel(q, k))
    other = build_method(name, 2, 2, D, layer_idx=2, seed=0).double()
    assert not torch.allclose(build_method(name, 2, 2, D, layer_idx=1, seed=0).double().dense_kernel(q, k),
                              other.dense_kernel(q, k))


def test_performer_is_unbiased_softmax_estimate():
    # FAVOR+ with many features: the normalised output approaches softmax attention
    q, k, v = _qkv(1, 1, 12, seed=8, scale=0.7)
    m = build_method("performer", 1, 1, D, n_features=20000, seed=0).double()
    soft = build_method("softmax", 1, 1, D).double()
    err = (m(q, k, v) - soft(q, k, v)).pow(2).mean()
    small = build_method("performer", 1, 1, D, n_features=16, seed=0).double()
    # MSE of a ratio of Monte Carlo estimates shrinks roughly like 1/m (heavy-tailed at this |q|, so loosely)
    assert err < 0.1 * (small(q, k, v) - soft(q, k, v)).pow(2).mean()


def test_performer_orthogonal_blocks():
    m = build_method("performer", 1, 1, D, n_features=40)
    w = m.projection[0]
    dirs = w / w.norm(dim=-1, keepdim=True)
    gram = dirs[:D] @ dirs[:D].T
    torch.testing.assert_close(gram, torch.eye(D, dtype=gram.dtype), atol=1e-10, rtol=0)


def test_spectraformer_shapes_and_params():
    m = build_method("spectraformer", 14, 2, 64)
    assert m.n_features == 65 and sum(p.numel() for p in m.parameters()) == 192
    h = hadamard(8)
    torch.testing.assert_close(h @ h.T, 8 * torch.eye(8, dtype=h.dtype))
    # FastFood rows are marginally N(0, I): mean squared row norm close to d
    w = m.projection(torch.float64)[:64]
    assert 0.6 * 64 < w.pow(2).sum(-1).mean() < 1.4 * 64


def test_dijiang_and_taylorshift_params():
    dj = build_method("dijiang", 14, 2, 64)
    assert dj.theta.shape == (14, 64) and bool((dj.theta == 0).all())
    ts = build_method("taylorshift", 14, 2, 64)
    assert ts.tau.shape == (14,) and bool((ts.tau == 1).all())
    q, k, _ = _qkv(2, 2, 5, seed=3)
    ts2 = build_method("taylorshift", 2, 2, D).double()
    qn, kn = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    s = qn @ kn.transpose(-1, -2)
    torch.testing.assert_close(ts2.dense_kernel(q, k), 1 + s + s * s / 2)


def test_feature_attention_log_keys_matches_plain():
    g = torch.Generator().manual_seed(0)
    fq = torch.rand(1, 2, 11, 6, generator=g, dtype=torch.float64)
    lk = torch.randn(1, 2, 11, 6, generator=g, dtype=torch.float64) * 30
    v = torch.randn(1, 1, 11, 3, generator=g, dtype=torch.float64)
    a = feature_attention(fq, lk, v, log_keys=True, chunk_size=4)
    b = feature_attention(fq, torch.exp(lk - lk.max()), v, chunk_size=5)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", BASELINES)
def test_bad_input(name):
    m = build_method(name, 4, 2, D)
    with pytest.raises(ValueError, match="heads"):
        m(torch.randn(1, 3, 4, D), torch.randn(1, 2, 4, D), torch.randn(1, 2, 4, D))
    with pytest.raises(ValueError, match="head_dim"):
        m(torch.randn(1, 4, 4, D + 1), torch.randn(1, 2, 4, D + 1), torch.randn(1, 2, 4, D))


def test_fp32_default_runs_on_large_logits():
    # FP32 default: large-magnitude inputs (outlier dims) keep the fp64 result through the shifts (not inf/nan, and
    # not a finite but wrong output either)
    q, k, v = (t.float() for t in _qkv(4, 2, 40, seed=11, scale=1.0))
    q[..., 3] *= 40
    k[..., 3] *= 40
    for name in BASELINES:
        m = build_method(name, 4, 2, D)
        exact = build_method(name, 4, 2, D)
        exact.load_state_dict(m.state_dict())
        with torch.no_grad():
            out = m(q, k, v)
            ref = exact.double()(q.double(), k.double(), v.double())
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", BASELINES)
def test_dense_kernel_on_query_subset_and_prefix(name):
    # sampled query positions against a key prefix (Table 1, calibration): same normalised rows as the full matrix
    m = _make(name, 4, 2)
    q, k, _ = _qkv(4, 2, 21, seed=12)
    pos = torch.tensor([0, 5, 13])
    full = m.dense_kernel(q, k)[:, :, pos, :14]
    sub = m.dense_kernel(q[:, :, pos], k[:, :, :14])
    torch.testing.assert_close(sub / sub.sum(-1, keepdim=True), full / full.sum(-1, keepdim=True), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("name", ["performer", "spectraformer", "dijiang"])
def test_compute_dtype_configurable(name):
    # fp32 inputs with dtype=float64 (the paper's FP64 features/prefix sums) give the fp64 result in fp32
    q, k, v = _qkv(4, 2, 25, seed=13)
    exact = build_method(name, 4, 2, D, layer_idx=1).double()(q, k, v)
    m64 = build_method(name, 4, 2, D, layer_idx=1, dtype=torch.float64)
    with torch.no_grad():
        out = m64(q.float(), k.float(), v.float())
        low = build_method(name, 4, 2, D, layer_idx=1, dtype=torch.float32)(q.bfloat16(), k.bfloat16(),
                                                                            v.bfloat16())
    assert out.dtype == torch.float32 and low.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(low.double(), exact, rtol=0, atol=5e-2)  # bf16 inputs: ~1e-2 off, seen 0.014


def test_paper_compute_dtypes_by_default():
    # App. E / F.1: Performer and SpectraFormer features and prefix sums in FP64, DiJiang in FP32
    assert build_method("performer", 4, 2, D).dtype == torch.float64
    assert build_method("spectraformer", 4, 2, D).dtype == torch.float64
    assert build_method("dijiang", 4, 2, D).dtype == torch.float32
    q, k, v = (t.float() for t in _qkv(4, 2, 25, seed=14))
    exact = build_method("performer", 4, 2, D).double()(q.double(), k.double(), v.double())
    with torch.no_grad():
        out = build_method("performer", 4, 2, D)(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- DiJiang: App. F.1 / upstream construction


def _assert_matches_with_gradients(out, ref, inputs, ref_inputs, seed):
    """out == ref in fp64, and so are their gradients (none zero) into `inputs` / `ref_inputs` under one random
    cotangent drawn from `seed`."""
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    wt = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g_out = torch.autograd.grad((out * wt).sum(), inputs)
    g_ref = torch.autograd.grad((ref * wt).sum(), ref_inputs)
    for a, b in zip(g_out, g_ref, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _dct2_by_definition(d):
    """Orthonormal DCT-II from its definition: X_k = sum_n x_n a_k cos(pi k (2n + 1) / (2d)), a_0 = sqrt(1/d),
    a_k = sqrt(2/d); row k holds the coefficients of X_k (scipy's dct(eye(d), axis=0, norm='ortho'))."""
    c = torch.empty(d, d, dtype=torch.float64)
    for k in range(d):
        a = (1.0 / d) ** 0.5 if k == 0 else (2.0 / d) ** 0.5
        for n in range(d):
            c[k, n] = a * torch.cos(torch.tensor(torch.pi * k * (2 * n + 1) / (2 * d), dtype=torch.float64))
    return c


def _dijiang_upstream_features(q, k, theta, seed, layer):
    """z = x @ (C diag(g)) = diag(g) C^T x, x = d^-1/4 q, g = Phi^-1(U); phi = softmax(z); D = exp(theta) on both."""
    from oal.methods._common import generator_for

    d = q.shape[-1]
    c = _dct2_by_definition(d)
    u = torch.rand(d, generator=generator_for("dijiang", seed, layer), dtype=torch.float64)
    g = torch.distributions.Normal(0.0, 1.0).icdf(u)
    p = c @ torch.diag(g)
    dw = torch.exp(theta)[None, :, None, :]  # [1, Hq, 1, d]
    r = q.shape[1] // k.shape[1]
    fq = torch.softmax((q * d ** -0.25) @ p, dim=-1) * dw
    fk = torch.softmax((k.repeat_interleave(r, dim=1) * d ** -0.25) @ p, dim=-1) * dw
    return p, fq, fk


def test_dijiang_dct_is_orthonormal_dct2():
    for d in (1, 7, 16):
        from oal.methods.dijiang import dct_matrix

        c = dct_matrix(d)
        torch.testing.assert_close(c, _dct2_by_definition(d), rtol=0, atol=1e-13)
        torch.testing.assert_close(c @ c.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [7, 16])
def test_dijiang_projection_and_features_match_upstream_formula(d):
    m = build_method("dijiang", 6, 3, d, layer_idx=4, seed=11).double()
    with torch.no_grad():
        m.theta.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 9, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, 3, 9, d, generator=g, dtype=torch.float64) * 2
    p, fq_ref, fk_ref = _dijiang_upstream_features(q, k, m.theta.detach(), seed=11, layer=4)
    torch.testing.assert_close(m.projection, p, rtol=0, atol=1e-13)
    # z = diag(g) C^T x written out: the projection is C diag(g), not diag(1/g) C
    gdiag = torch.diagonal(_dct2_by_definition(d).T @ p)
    x = q[0, 0, 0] * d ** -0.25
    torch.testing.assert_close(x @ m.projection, gdiag * (_dct2_by_definition(d).T @ x), rtol=1e-12, atol=1e-13)
    fq, fk = m._features(q, k)
    kern = fq @ fk.repeat_interleave(2, dim=1).transpose(-1, -2)
    torch.testing.assert_close(kern, fq_ref @ fk_ref.transpose(-1, -2), rtol=1e-12, atol=1e-14)


def test_dijiang_outputs_and_gradients_match_upstream_formula():
    # causal normalised attention over the written-out features (App. F.1), fp64, odd sizes, GQA, trainable theta
    d, n = 13, 19
    m = build_method("dijiang", 6, 3, d, layer_idx=2, seed=3, chunk_size=5).double()
    with torch.no_grad():
        m.theta.normal_(0.0, 0.4, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(8)
    q = (torch.randn(2, 6, n, d, generator=g, dtype=torch.float64) * 1.7).requires_grad_()
    k = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64) * 1.7).requires_grad_()
    v = torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64).requires_grad_()
    theta = m.theta.detach().clone().requires_grad_()
    _, fq, fk = _dijiang_upstream_features(q, k, theta, seed=3, layer=2)
    w = (fq @ fk.transpose(-1, -2)).tril()
    ref = (w @ v.repeat_interleave(2, dim=1)) / w.sum(-1, keepdim=True)
    _assert_matches_with_gradients(m(q, k, v), ref, (q, k, v, m.theta), (q, k, v, theta), seed=4)


def test_dijiang_features_are_spread_not_one_hot():
    # Gaussian keys, d = 64: softmax(x C diag(g)) spreads over the coordinates; the inverted diag(1/g) C
    # construction (|1/g| up to hundreds) made the largest normalised key feature close to 1
    from oal.methods.dijiang import dct_matrix

    d = 64
    k = torch.randn(1, 2, 400, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for seed in range(3):
        m = build_method("dijiang", 2, 2, d, layer_idx=1, seed=seed).double()
        _, fk = m._features(k, k)
        fk = fk / fk.sum(-1, keepdim=True)
        spread = fk.amax(-1).median()
        assert spread < 0.1
        g = torch.diagonal(dct_matrix(d).T @ m.projection)  # the same draw, inverted as version 1 did
        inverted = torch.softmax((k * d ** -0.25) @ (dct_matrix(d) / g[:, None]).T, dim=-1)
        assert inverted.amax(-1).median() > max(0.3, 5 * spread)  # 0.42-1.00 for these three draws


def test_dijiang_draw_is_standard_normal():
    # g = Phi^-1(U): over many layers the diagonal is N(0, 1) (mean 0, variance 1), |g| rarely above 4
    from oal.methods.dijiang import dct_matrix

    gs = torch.cat([torch.diagonal(dct_matrix(32).T @ build_method("dijiang", 1, 1, 32, layer_idx=i).projection)
                    for i in range(200)])
    assert abs(gs.mean()) < 0.05 and abs(gs.var() - 1) < 0.05 and (gs.abs() > 4).float().mean() < 1e-3


# ---------------------------------------------------------------- SpectraFormer: upstream OPRF-FastFoodL


def _spectraformer_upstream_features(x, m):
    """Upstream's feature map written out step by step (FastFood with unnormalised H_ij = (-1)^popcount(i & j),
    input scaled by sqrt(softmax_temp) = d^-1/4 and zero-padded, smoothing column 1; OPRF log-features
    A |S*G*B|^2 + sqrt(1 - 4A) u - |x|^2 with A from the quadratic's root; row max; + 1e-4) for x = d^-1/4 q."""
    d, p = x.shape[-1], m.p
    idx = torch.arange(p)
    h = torch.tensor([[(-1.0) ** bin(int(i) & int(j)).count("1") for j in idx] for i in idx], dtype=x.dtype)
    xp = torch.nn.functional.pad(x * d ** -0.25, (0, p - d))
    hbx = (xp * m.B) @ h.T
    v = m.S * (((hbx[..., m.perm]) * m.G) @ h.T) / p ** 0.5
    u = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    z = 2 * x.pow(2).sum(-1, keepdim=True)  # per-token statistic (module doc); upstream: per position, batch mean
    qa, qb, qc = 2 * z, 2 * z + d, -d
    rho = (torch.sqrt(qb * qb - 4 * qa * qc) - qb) / (2 * qa)
    a = (1 - 1 / rho) / 8
    lf = a * (m.S * m.G * m.B).norm() ** 2 + torch.sqrt(1 - 4 * a) * u - x.pow(2).sum(-1, keepdim=True)
    return torch.exp(lf - lf.amax(-1, keepdim=True)) + 1e-4


def test_spectraformer_outputs_and_gradients_match_upstream_formula():
    # fp64, d = 13 (padded to p = 16), N = 19, GQA; gradients into q, k, v and the trainable B, G, S
    d, n = 13, 19
    m = build_method("spectraformer", 6, 3, d, layer_idx=2, seed=4, chunk_size=5).double()
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(2, 6, n, d, generator=g, dtype=torch.float64) * 2.5).requires_grad_()
    k = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64) * 2.5).requires_grad_()
    v = torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64).requires_grad_()
    s = d ** -0.25
    fq = _spectraformer_upstream_features(q * s, m)
    fk = _spectraformer_upstream_features(k * s, m).repeat_interleave(2, dim=1)
    assert fq.shape[-1] == 17
    w = (fq @ fk.transpose(-1, -2)).tril()
    ref = (w @ v.repeat_interleave(2, dim=1)) / w.sum(-1, keepdim=True)
    a, _ = m._features(q, k)
    torch.testing.assert_close(a, fq, rtol=1e-12, atol=1e-14)
    params = (q, k, v, m.B, m.G, m.S)
    _assert_matches_with_gradients(m(q, k, v), ref, params, params, seed=4)


def test_spectraformer_gradient_is_the_functions_gradient():
    # the +1e-4 offset makes the row-max shift part of the function: a detached shift would give another gradient
    m = build_method("spectraformer", 2, 1, 8, layer_idx=0, seed=1, chunk_size=3).double()
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64) * 3).requires_grad_()
    k = (torch.randn(1, 1, 7, 8, generator=g, dtype=torch.float64) * 3).requires_grad_()
    v = torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: m(a, b, v), (q, k), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------- Performer, TaylorShift: App. F.1 written out


def test_performer_matches_favor_plus_formula():
    # App. F.1: phi(x) = exp(w . x - |x|^2 / 2), x = d^-1/4 q, per query head's projection; the shifts cancel
    d, n = 13, 11
    m = build_method("performer", 4, 2, d, n_features=29, layer_idx=3, seed=2, chunk_size=4).double()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64)
    x, y = q * d ** -0.25, k.repeat_interleave(2, dim=1) * d ** -0.25
    w = m.projection  # [Hq, m, d]
    fx = torch.exp(torch.einsum("bhnd,hmd->bhnm", x, w) - x.pow(2).sum(-1, keepdim=True) / 2)
    fy = torch.exp(torch.einsum("bhnd,hmd->bhnm", y, w) - y.pow(2).sum(-1, keepdim=True) / 2)
    kern = (fx @ fy.transpose(-1, -2)).tril()
    ref = (kern @ v.repeat_interleave(2, dim=1)) / kern.sum(-1, keepdim=True)
    torch.testing.assert_close(m(q, k, v), ref, rtol=1e-10, atol=1e-12)


def test_taylorshift_outputs_and_gradients_match_formula():
    # App. F.1: kappa = 1 + s + s^2 / 2, s = tau_h q^ . k^ (unit vectors), tau per query head trainable
    d, n = 13, 17
    m = build_method("taylorshift", 6, 3, d).double()
    with torch.no_grad():
        m.tau.copy_(torch.tensor([0.5, 1.0, 1.7, 2.3, 0.9, 3.1], dtype=torch.float64))
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(2, 6, n, d, generator=g, dtype=torch.float64) * 3).requires_grad_()
    k = (torch.randn(2, 3, n, d, generator=g, dtype=torch.float64) * 3).requires_grad_()
    v = torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64).requires_grad_()
    tau = m.tau.detach().clone().requires_grad_()
    qh = q / q.norm(dim=-1, keepdim=True)
    kh = (k / k.norm(dim=-1, keepdim=True)).repeat_interleave(2, dim=1)
    s = tau[None, :, None, None] * (qh @ kh.transpose(-1, -2))
    kern = (1 + s + s * s / 2).tril()
    ref = (kern @ v.repeat_interleave(2, dim=1)) / kern.sum(-1, keepdim=True)
    _assert_matches_with_gradients(m(q, k, v), ref, (q, k, v, m.tau), (q, k, v, tau), seed=1)
