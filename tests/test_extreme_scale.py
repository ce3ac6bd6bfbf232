"""float64 at extreme scale (q, k entries around 30): the exponent shifts of Performer's linear path and of Table 1's
hybrid kernel (Eq. 10) keep every query's visible weights from underflowing together, so that the outputs equal a
dense reference where the old shifts gave rows of 0 or NaN; at ordinary scale nothing changes beyond 1e-12.

Performer's linear path shifted each chunk of 64 keys by their common max, so a dominant key late in a chunk
underflowed every earlier key's feature for the queries before it (their rows came out 0, the denominator clamped).
The hybrid multiplied the method's factor and the exact one, each shifted by its own row max: where the two maxima
sit at different keys, every product could underflow (0/0)."""

import math

import pytest
import torch

from oal.diagnostics.retained_error import _as_mha, hybrid_output
from oal.methods import build_method, repeat_kv
from oal.methods.base import causal_mask
from oal.methods.features import feature_attention

B, HQ, HKV, N, D, DV = 2, 3, 1, 75, 7, 5  # N crosses a 64-token chunk; GQA
TOL = 1e-9


def _performer(**kw):
    return build_method("performer", HQ, HKV, D, n_features=37, layer_idx=1, seed=3, **kw)


def _inputs(scale, seed=0, n=N, b=B):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HQ, n, D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, HKV, n, D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, HKV, n, DV, generator=g, dtype=torch.float64)
    return q, k, v


def _late_dominant_key(seed=0):
    """Ordinary queries; keys with one long common coordinate (log-features about -R^2 / (2 sqrt(d)) ~ -1060) except
    a zero key (log-features 0) at position 44, late in its chunk (of 64 or 5): beyond exp's range above the others."""
    q, k, v = _inputs(1.0, seed)
    k[..., 0] = 75.0
    k[:, :, 44] = 0.0
    return q, k, v


def _chunk_shift_underflows(m, q, k, chunk):
    """Whether the old linear path's shift (for a query, the max over every key up to the end of its chunk) leaves
    some query with all its visible weights 0: the case is hard."""
    fq, lk = m._features(q, k)
    n = lk.shape[-2]
    ends = ((torch.arange(n) // chunk + 1) * chunk).clamp_max(n)  # one past the last key of each query's chunk
    shift = lk.amax(-1).cummax(-1).values[..., ends - 1]  # [B, H, N]
    fk = torch.exp(lk.unsqueeze(-3) - shift[..., :, None, None])  # [B, H, N (query), N (key), m]
    w = (fq.unsqueeze(-2) * fk).sum(-1).masked_fill(~causal_mask(n, n, "cpu"), 0.0)
    return bool((w.sum(-1) == 0).any())


def _grads(out, inputs):
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return torch.autograd.grad((out * cot).sum(), inputs, retain_graph=True)


def _close(got, want, atol_scale=None):
    assert torch.isfinite(got).all()
    scale = float(want.detach().abs().max()) if atol_scale is None else atol_scale
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * scale)


@pytest.mark.parametrize("case", ["random", "late_key"])
@pytest.mark.parametrize("chunk_size", [64, 5])
def test_performer_linear_path_matches_dense_reference(case, chunk_size):
    m = _performer(chunk_size=chunk_size)
    q, k, v = _inputs(30.0) if case == "random" else _late_dominant_key()
    assert _chunk_shift_underflows(m, q, k, chunk_size)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, want = m(q, k, v), m.reference(q, k, v)
    assert (want.abs().amax(-1) > 0.1).all()  # the reference has no zero row
    _close(out, want)
    got_g, want_g = _grads(out, (q, k, v)), _grads(want, (q, k, v))
    top = max(float(g.abs().max()) for g in want_g)  # saturated rows: exact q/k gradients ~0, tolerance overall
    for a, b in zip(got_g, want_g, strict=True):
        _close(a, b, top)


@pytest.mark.parametrize("case", ["random", "late_key"])
def test_performer_state_carries_at_extreme_scale(case):
    """Chunked evaluation with a carried state (odd split points) equals one call over the whole sequence."""
    m = _performer(chunk_size=8)
    q, k, v = _inputs(30.0, seed=1) if case == "random" else _late_dominant_key(seed=1)
    whole, state = m(q, k, v, output_final_state=True)
    outs, st = [], None
    for a, b in ((0, 23), (23, 52), (52, N)):
        o, st = m(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], initial_state=st, output_final_state=True)
        outs.append(o)
    _close(torch.cat(outs, dim=2), whole)
    _close(st, state)
    _close(whole, m.reference(q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_performer_linear_path_ordinary_scale_unchanged(causal):
    """At ordinary scale the log-key path equals plain features under one global shift (the old path's result, which
    no shift can change where nothing underflows): outputs and gradients to 1e-12."""
    m = _performer(chunk_size=16)
    q, k, v = (t.requires_grad_() for t in _inputs(1.0, seed=2))
    fq, lk = m._features(q, k)
    out = feature_attention(fq, lk, v, causal=causal, log_keys=True, chunk_size=16)
    old = feature_attention(fq, torch.exp(lk - lk.detach().amax()), v, causal=causal, chunk_size=16)
    torch.testing.assert_close(out, old, rtol=0, atol=1e-12)
    for a, b in zip(_grads(out, (q, k, v)), _grads(old, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------- Table 1's hybrid

HN = 19
POS = torch.tensor([0, 2, 5, 8, 11, 13, 18])
TABLE1 = ("performer", "spectraformer", "dijiang", "taylorshift", "softmax")


def _hybrid_inputs(scale, seed):
    q, k, v = _inputs(scale, seed, n=HN, b=1)
    masks = torch.rand(6, HQ, D, generator=torch.Generator().manual_seed(seed)) < 0.4  # partial subsets
    return q, k, v, masks


def _method(name):
    return build_method(name, HQ, HKV, D, layer_idx=1, seed=3).double()


def _parts(m, q, k, v, masks):
    n_keys = int(POS.max()) + 1
    qs, kr, vr = q[:, :, POS], repeat_kv(k[:, :, :n_keys], m.n_rep), repeat_kv(v[:, :, :n_keys], m.n_rep)
    mk = masks.double()[:, :, None, :]
    exact = (qs * (1 - mk)) @ (kr * (1 - mk)).transpose(-1, -2) / math.sqrt(D)  # log of the exact factor
    keep = torch.arange(n_keys)[None, :] <= POS[:, None]
    return qs * mk, kr * mk, vr, exact, keep


def _hybrid_truth(m, q, k, v, masks):
    """Eq. 10-11 from the log of each factor, no shift before the causal softmax: performer's kernel as a logsumexp
    over its features, softmax's as its scores, the others' (never below exp's range here) as the log of their
    dense kernel on the masked inputs."""
    qa, ka, vr, exact, keep = _parts(m, q, k, v, masks)
    mm = _as_mha(m)
    if m.name == "performer":
        s = D ** -0.25
        log_approx = torch.logsumexp(mm._log_features(qa * s, True).unsqueeze(-2)
                                     + mm._log_features(ka * s, True).unsqueeze(-3), -1)
    elif m.name == "softmax":
        log_approx = qa @ ka.transpose(-1, -2) / math.sqrt(D)
    else:
        log_approx = mm.dense_kernel(qa, ka).log()
    return torch.softmax((log_approx + exact).masked_fill(~keep, -torch.inf), -1) @ vr


def _old_hybrid(m, q, k, v, masks):
    """The old Eq. 10: the masked kernel times the exact factor shifted by its own row max."""
    qa, ka, vr, exact, keep = _parts(m, q, k, v, masks)
    exact = exact.masked_fill(~keep, -torch.inf)
    w = _as_mha(m).masked_kernel(qa, ka, keep) * torch.exp(exact - exact.amax(-1, keepdim=True))
    return (w @ vr) / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", TABLE1)
@pytest.mark.parametrize("seed", [0, 1])
def test_hybrid_matches_reference_at_extreme_scale(name, seed):
    m = _method(name)
    q, k, v, masks = _hybrid_inputs(30.0, seed)
    want = _hybrid_truth(m, q, k, v, masks)
    assert torch.isfinite(want).all()
    if name in ("performer", "softmax"):  # the methods whose factor is itself shifted per row: the case is hard
        assert not torch.isclose(_old_hybrid(m, q, k, v, masks), want).all()
    _close(hybrid_output(m, q, k, v, POS, masks), want)


@pytest.mark.parametrize("name", TABLE1)
def test_hybrid_ordinary_scale_unchanged(name):
    m = _method(name)
    q, k, v, masks = _hybrid_inputs(1.0, seed=3)
    masks[0], masks[1] = True, False  # the full head and exact softmax besides partial subsets
    out = hybrid_output(m, q, k, v, POS, masks)
    torch.testing.assert_close(out, _old_hybrid(m, q, k, v, masks), rtol=0, atol=1e-12)
    _close(out, _hybrid_truth(m, q, k, v, masks))
