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
    # FP32 default: large-magnitude inputs (outlier dims) still give finite outputs through the shifts
    q, k, v = (t.float() for t in _qkv(4, 2, 40, seed=11, scale=1.0))
    q[..., 3] *= 40
    k[..., 3] *= 40
    for name in BASELINES:
        with torch.no_grad():
            out = build_method(name, 4, 2, D)(q, k, v)
        assert torch.isfinite(out).all() and out.dtype == torch.float32


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
    assert torch.isfinite(low).all()


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
