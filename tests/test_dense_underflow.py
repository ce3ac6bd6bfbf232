"""The dense (O(N^2)) paths of softmax and performer mask before their shift over keys: a masked (future or padded)
key scoring far above every kept one no longer underflows the kept weights (0/0 = NaN, or 0 rows where a caller
clamps the denominator). Checked against a float64 reference that masks in log space, before any exponential:
the base `reference`, a converted model's stateless fallback, calibration's sampled outputs and the Table 1 hybrid
(outputs and gradients, odd sizes, GQA); and at ordinary scales against the old formula (shift over all keys,
mask after), unchanged to 1e-12 in float64."""

import math

import pytest
import torch

from oal.calibration.loss import sampled_dense_output
from oal.diagnostics.retained_error import hybrid_output
from oal.methods import build_method
from oal.methods.base import causal_mask
from oal.models.attention import _dense_with_mask

B, HQ, HKV, N, D, DV = 2, 3, 1, 19, 7, 5
NAMES = ("softmax", "performer")
DTYPES = (torch.float32, torch.float64)
FUTURE = torch.arange(N) >= N - 4  # the keys most queries of a causal row cannot see


def _method(name):
    return build_method(name, HQ, HKV, D, layer_idx=1, seed=3, **({"n_features": 37} if name == "performer" else {}))


def _leaves(dtype, *ts):
    return [t.to(dtype).requires_grad_() for t in ts]


def _fuzz(dtype, scale, seed=0):
    """The fuzz's inputs: everything at one large scale (attention saturated, so q/k gradients are ~0)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64) * scale for h in (HQ, HKV))
    return _leaves(dtype, q, k, torch.randn(B, HKV, N, DV, generator=g, dtype=torch.float64))


def _qkv(name, dtype, hidden, seed=0):
    """Ordinary, unsaturated attention among the kept keys; the `hidden` keys [B, N] (those a mask will drop) are
    made to dominate every kept one by far more than exp can span. softmax: a huge score. performer: a zero key
    (log-features 0) among keys with one long common coordinate, k = R e_1 + e with e orthogonal to e_1: their
    log-features are shifted by about -R^2 / (2 sqrt(d)), while R e_1 only multiplies each query's weights by
    a constant, so that the kept keys' relative weights stay those of the moderate e."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, h, N, D, generator=g, dtype=torch.float64) for h in (HQ, HKV))
    v = torch.randn(B, HKV, N, DV, generator=g, dtype=torch.float64)
    if name == "softmax":
        q, big = q + 2.0, 200.0  # every query scores a key of all-`big` coordinates at about 14 * big / sqrt(d)
    else:
        k[..., 0], big = 75.0, 0.0  # |y|^2 / 2 ~ 1060: beyond exp's range (745) against the zero key
    k = torch.where(hidden[:, None, :, None], big, k)
    return _leaves(dtype, q, k, v)


def _log_weights(m, q, k):
    """float64 log kernel [B, Hq, n, M]: softmax's scores, or performer's log(phi(q) . phi(k)) without any shift."""
    q, k = q.double(), k.double()
    if m.name == "softmax":
        return q @ k.repeat_interleave(m.n_rep, 1).transpose(-1, -2) / math.sqrt(D)
    s = D ** -0.25
    lq, lk = m._log_features(q * s, True), m._log_features(k * s, False)
    return torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), -1)


def _truth(m, q, k, v, allowed):
    """Normalised output, masked before exponentiating (float64); a row that keeps no key attends every key here
    (callers zero those rows)."""
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    p = torch.softmax(_log_weights(m, q, k).masked_fill(~allowed, -torch.inf), -1)
    return p @ v.double().repeat_interleave(m.n_rep, 1)


def _old_weights(m, q, k):
    """The old dense kernels: one shift over all keys (tokens and features for performer)."""
    if m.name == "softmax":
        s = q @ k.repeat_interleave(m.n_rep, 1).transpose(-1, -2) / math.sqrt(D)
        return torch.exp(s - s.amax(-1, keepdim=True))
    fq, lk = m._features(q, k)
    return fq @ torch.exp(lk - lk.detach().amax(dim=(-2, -1), keepdim=True)).transpose(-1, -2)


def _old_output(m, q, k, v, allowed, clamp=False):
    """The old dense paths: the old kernel masked afterwards (`clamp`: the fallback's denominator floor)."""
    w = _old_weights(m, q, k).masked_fill(~allowed, 0.0).to(v.dtype)
    den = w.sum(-1, keepdim=True)
    return (w @ v.repeat_interleave(m.n_rep, 1)) / (den.clamp_min(torch.finfo(v.dtype).tiny) if clamp else den)


def _grads(out, inputs, rows=None):
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
    if rows is not None:
        cot = cot * rows
    return torch.autograd.grad((out * cot).sum(), inputs)


def _close(got, want, dtype, overall=False):
    """`overall`: absolute tolerance from the largest of all the tensors (saturated rows: exact q/k gradients are ~0,
    and any evaluation's are rounding noise of order eps times the scores' scale); otherwise each tensor's own."""
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    top = max(float(w.detach().abs().max()) for w in want)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        scale = top if overall else float(w.detach().abs().max())
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol * scale)


def _padding(left: int):
    """allowed [B, 1, N, N]: causal, row 0 left-padded by `left` tokens (its padded query rows see nothing)."""
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, :left] = False
    return causal_mask(N, N, "cpu") & valid[:, None, None, :] & valid[:, None, :, None], valid


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 10.0), (torch.float32, 30.0), (torch.float64, 30.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_at_the_fuzz_scales(name, dtype, scale, causal):
    """fp32 at 30: performer's fp64 weights must also be rescaled per row before the cast to the values' dtype
    (the only one of these cases the old formula fails without a mask)."""
    m = _method(name)
    q, k, v = _fuzz(dtype, scale)
    allowed = causal_mask(N, N, "cpu") if causal else torch.ones(N, N, dtype=torch.bool)
    if causal or (name == "performer" and dtype == torch.float32 and scale == 30.0):
        assert _old_output(m, q, k, v, allowed).isnan().any()  # the case is hard: the old formula fails on it
    out, want = m.reference(q, k, v, causal=causal), _truth(m, q, k, v, allowed)
    _close([out], [want], dtype)
    _close(_grads(out, (q, k, v)), _grads(want, (q, k, v)), dtype, overall=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_with_dominant_future_keys(name, dtype):
    m = _method(name)
    q, k, v = _qkv(name, dtype, FUTURE.expand(B, N))
    allowed = causal_mask(N, N, "cpu")
    assert _old_output(m, q, k, v, allowed).isnan().any()
    out, want = m.reference(q, k, v), _truth(m, q, k, v, allowed)
    _close([out], [want], dtype)
    _close(_grads(out, (q, k, v)), _grads(want, (q, k, v)), dtype)
    if name == "softmax":  # the linear path agrees
        _close([m(q, k, v)], [want], dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_converted_fallback_with_padding(name, dtype):
    m = _method(name)
    allowed, valid = _padding(left=4)
    q, k, v = _qkv(name, dtype, ~valid | FUTURE, seed=1)
    real = valid[:, None, :, None]
    bad = (_old_output(m, q, k, v, allowed, clamp=True) - _truth(m, q, k, v, allowed)).abs().masked_fill(~real, 0)
    assert not (bad < 0.1).all()  # the old fallback lost the kept weights of some rows on these inputs
    out = _dense_with_mask(m, q, k, v, allowed)
    want = _truth(m, q, k, v, allowed).masked_fill(~real, 0)  # a padded query row sees nothing: output 0
    _close([out], [want], dtype)
    _close(_grads(out, (q, k, v), real), _grads(want, (q, k, v), real), dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_calibration_sampled_output(name, dtype, causal):
    m = _method(name)
    pos = torch.tensor([0, 3, 7, 11, 16])
    if causal:  # keys 0..16 of the prefix, the last four dominant
        key_mask, allowed, hidden = None, causal_mask(N, N, "cpu")[pos][:, :17], (torch.arange(N) >= 13).expand(B, N)
    else:  # padded encoder batch: row 1 right-padded, its padded keys dominant
        key_mask = torch.ones(B, N, dtype=torch.bool)
        key_mask[1, 12:] = False
        allowed, hidden = key_mask[:, None, None, :], ~key_mask
    q, k, v = _qkv(name, dtype, hidden, seed=2)
    ks, vs = (k[:, :, :17], v[:, :, :17]) if causal else (k, v)
    want = _truth(m, q[:, :, pos], ks, vs, allowed)
    assert _old_output(m, q[:, :, pos], ks, vs, allowed).isnan().any()
    out = sampled_dense_output(m, q, k, v, pos, causal=causal, key_mask=key_mask)
    _close([out], [want], dtype)
    _close(_grads(out, (q, k, v)), _grads(want, (q, k, v)), dtype)


@pytest.mark.parametrize("name", NAMES)
def test_table1_hybrid_full_head(name):
    """masks all True: Eq. 10-11 is the method on the whole head, causal at the query positions."""
    m = _method(name)
    q, k, v = _qkv(name, torch.float64, FUTURE.expand(B, N), seed=4)
    pos = torch.tensor([1, 5, 8, 13, 17])
    allowed = causal_mask(N, N, "cpu")[pos][:, :18]
    want = _truth(m, q[:, :, pos], k[:, :, :18], v[:, :, :18], allowed)
    assert _old_output(m, q[:, :, pos], k[:, :, :18], v[:, :, :18], allowed).isnan().any()
    for b in range(B):  # the hybrid takes one sequence
        sl = slice(b, b + 1)
        out = hybrid_output(m, q[sl], k[sl], v[sl], pos, torch.ones(1, HQ, D, dtype=torch.bool))
        _close([out[0]], [want[b]], torch.float64)


@pytest.mark.parametrize("name", NAMES)
def test_reference_without_keys(name):
    m = _method(name)
    q, k, v = (torch.randn(B, h, 0, w, dtype=torch.float64) for h, w in ((HQ, D), (HKV, D), (HKV, DV)))
    for causal in (True, False):
        out = m.reference(q, k, v, causal=causal)
        assert out.shape == m(q, k, v, causal=causal).shape == (B, HQ, 0, DV)


@pytest.mark.parametrize("name", NAMES)
def test_ordinary_scale_unchanged(name):
    """Where nothing underflowed the masked shift changes nothing beyond rounding (float64, outputs and gradients)."""
    m = _method(name)
    q, k, v = _fuzz(torch.float64, 1.0, seed=5)
    allowed, valid = _padding(left=4)
    real = valid[:, None, :, None]
    causal = causal_mask(N, N, "cpu")
    pos = torch.tensor([2, 9, 17])
    cases = [
        (m.reference(q, k, v), _old_output(m, q, k, v, causal), None),
        (_dense_with_mask(m, q, k, v, allowed), _old_output(m, q, k, v, allowed, clamp=True), real),
        (sampled_dense_output(m, q, k, v, pos), _old_output(m, q[:, :, pos], k[:, :, :18], v[:, :, :18],
                                                           causal[pos][:, :18]), None),
    ]
    for new, old, rows in cases:
        torch.testing.assert_close(new, old, rtol=0, atol=1e-12)
        for a, b in zip(_grads(new, (q, k, v), rows), _grads(old, (q, k, v), rows), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(m.dense_kernel(q, k), _old_weights(m, q, k), rtol=0, atol=0)  # unmasked: as before


@pytest.mark.parametrize("name", ["swa", "oal-swa", "global-swa"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_fallback_ignores_what_padded_keys_hold(name, dtype):
    """swa, oal-swa and global-swa: a left-padded key inside the sinks or the window at a large score took the row
    max, and the real rows' weights underflowed to 0 (43 of 45 rows with padded keys at 200). Whatever the padded
    keys hold, the real rows' outputs are those with ordinary padded keys."""
    m = build_method(name, HQ, HKV, D, window=6, sinks=2, layer_idx=1, seed=3)
    allowed, valid = _padding(left=4)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, N, e, generator=g, dtype=torch.float64).to(dtype) for h, e in
               ((HQ, D), (HKV, D), (HKV, DV)))
    u = torch.nn.functional.normalize(torch.randn(D, generator=g, dtype=torch.float64), dim=0).to(dtype)
    q = q + 3.0 * u  # the real queries share a direction that the padded keys below take, at a score of ~1100
    loud = k.clone()
    loud[0, :, :4] = 1000.0 * u
    real = valid[:, None, :, None]
    want = _dense_with_mask(m, q, k, v, allowed).masked_fill(~real, 0)
    got = _dense_with_mask(m, q, loud, v, allowed).masked_fill(~real, 0)
    assert torch.isfinite(want).all() and want.abs().amax() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)
