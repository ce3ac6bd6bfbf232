"""Sliding-window operators (issue 29): swa and oal-swa (with and without sinks), banded and recurrent paths
against the dense reference, outputs and gradients in float64; state continuation; stability at huge logit scales;
bad input."""

from __future__ import annotations

import math

import pytest
import torch

import oal.ops.chunked as chunked
import oal.ops.window.banded as banded
from oal.ops import oal_attention
from oal.ops.kernel import feature_dim, perturbed_factor, taylor_factor
from oal.ops.window import sequence_state, split_window_state, window_attention, window_state_size

F64 = torch.float64
KINDS = ("swa", "oal-swa", "oal-swa+sinks")  # the hybrid without and with sinks


def make(b=1, hq=4, hkv=2, n=40, d=16, dv=8, g=3, *, seed=0, dtype=F64, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, dd, generator=gen, dtype=F64).to(dtype) for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = perturbed_factor(taylor_factor(hq, g, dtype=F64), 0.3, generator=gen).to(dtype)  # near e^s in scale
    if requires_grad:
        for t in (q, k, v, factor):
            t.requires_grad_(True)
    return q, k, v, groups, factor


def kw_for(kind, groups, factor, sinks):
    if kind == "swa":
        return dict(sinks=sinks)
    return dict(groups=groups, factor=factor, sinks=sinks if kind == "oal-swa+sinks" else 0)


def grads(out, inputs):
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    got = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, inputs, strict=True)]  # None: not reached


CASES = [
    # b, hq, hkv, n, window, sinks, chunk
    (1, 1, 1, 1, 4, 2, None),
    (2, 4, 2, 7, 3, 2, 2),
    (1, 4, 2, 63, 5, 4, 16),  # W not a multiple of the chunk
    (1, 2, 2, 100, 1, 3, 7),  # W = 1: each query's window is itself
    (1, 4, 2, 100, 17, 0, 16),
    (1, 4, 2, 63, 128, 4, None),  # W >= N
    (1, 4, 1, 100, 33, 1, 32),
]


@pytest.mark.parametrize("case", CASES, ids=[f"n{c[3]}-W{c[4]}-S{c[5]}-hq{c[1]}hkv{c[2]}" for c in CASES])
@pytest.mark.parametrize("kind", KINDS)
def test_paths_match_reference_outputs_and_gradients(monkeypatch, case, kind):
    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)  # an unwritten scratch entry would show up as NaN
    b, hq, hkv, n, window, sinks, chunk = case
    q, k, v, groups, factor = make(b, hq, hkv, n, requires_grad=True)
    inputs = (q, k, v, factor) if kind != "swa" else (q, k, v)
    kw = dict(window=window, **kw_for(kind, groups, factor, sinks))
    ref = window_attention(q, k, v, backend="reference", **kw)
    ref_grads = grads(ref, inputs)
    for backend in ("banded", "recurrent"):
        out = window_attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=f"{backend} out")
        for name, got, want in zip("q k v factor".split(), grads(out, inputs), ref_grads, strict=False):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-11, msg=f"{backend} d{name}")
        with torch.no_grad():  # the inference path (scratch buffers) agrees too
            torch.testing.assert_close(window_attention(q, k, v, backend=backend, chunk_size=chunk, **kw), ref,
                                       rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_banded_blocks_match_reference(monkeypatch, kind):
    """Long sequences run the band a block of chunks at a time; block edges change nothing."""
    monkeypatch.setattr(banded, "BAND_BLOCK", 600)  # blocks of 16 queries with chunks of 8 and W = 29
    q, k, v, groups, factor = make(n=101, requires_grad=True)
    kw = dict(window=29, **kw_for(kind, groups, factor, 3))
    ref = window_attention(q, k, v, backend="reference", **kw)
    out = window_attention(q, k, v, backend="banded", chunk_size=8, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v, factor)), grads(ref, (q, k, v, factor)), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_reference_is_the_formula_by_hand():
    """oal-swa, one head: e^{s_ij} for i - W < j <= i, eps + |L^T s_bar_ij|^2 for j <= i - W, one normaliser."""
    q, k, v, groups, factor = make(1, 1, 1, 9, d=4, dv=3, g=2, seed=3)
    window, eps, scale = 3, 1e-3, 0.5
    out = window_attention(q, k, v, window=window, groups=groups, factor=factor, eps=eps, scale=scale,
                           backend="banded", chunk_size=2)
    lower = torch.tril(factor[0])
    for i in range(9):
        w = []
        for j in range(i + 1):
            s = [scale * sum(q[0, 0, i, r] * k[0, 0, j, r] for r in range(4) if groups[0, r] == g) for g in range(2)]
            s_bar = torch.stack([torch.ones((), dtype=F64)] + [torch.as_tensor(x, dtype=F64) for x in s])
            w.append(torch.exp(sum(s)) if j > i - window else eps + (lower.T @ s_bar).pow(2).sum())
        w = torch.stack(w)
        torch.testing.assert_close(out[0, 0, i], (w[:, None] * v[0, 0, : i + 1]).sum(0) / w.sum(), rtol=0,
                                   atol=1e-12)


def test_swa_by_hand_and_limits():
    """swa: softmax over the window and the sinks; W >= N is causal softmax (SDPA), W = 1 and S = 0 returns v."""
    q, k, v, _, _ = make(1, 2, 1, 12, d=8, dv=4)
    out = window_attention(q, k, v, window=3, sinks=2, backend="banded", chunk_size=5)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    for i in range(12):
        keys = sorted({j for j in range(i + 1) if j > i - 3 or j < 2})
        torch.testing.assert_close(out[:, :, i], torch.softmax(s[:, :, i, keys], -1) @ v[0, 0, keys], rtol=0,
                                   atol=1e-12)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(window_attention(q, k, v, window=12, sinks=3), sdpa, rtol=0, atol=1e-12)
    torch.testing.assert_close(window_attention(q, k, v, window=1), v.expand(1, 2, 12, 4), rtol=0, atol=1e-12)


def test_oal_swa_covering_window_is_softmax_and_global_factor_is_one_group():
    q, k, v, groups, factor = make(n=20)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(window_attention(q, k, v, window=20, groups=groups, factor=factor), sdpa, rtol=0,
                               atol=1e-12)
    # a global factor embedded into any grouping gives the same kernel as one group (App. D)
    from oal.ops.kernel import global_embedded_factor

    glob = torch.randn(4, 2, 2, dtype=F64)
    one = window_attention(q, k, v, window=4, groups=torch.zeros(4, 16, dtype=torch.long), factor=glob)
    many = window_attention(q, k, v, window=4, groups=groups, factor=global_embedded_factor(glob, 3))
    torch.testing.assert_close(one, many, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------- state


SPLITS = [0, 1, 2, 4, 5, 6, 23, 38]  # around S = 2, W = 5, and past them


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first,then", [("banded", "banded"), ("banded", "recurrent"), ("recurrent", "banded"),
                                        ("auto", "auto")])
def test_prefill_chunk_then_decode_equals_one_call(kind, first, then):
    """Prefill p tokens, a second chunk of 7, then one token at a time: the outputs of one reference call, and the
    state of the whole sequence built from its definition."""
    n, window, sinks = 40, 5, 2
    q, k, v, groups, factor = make(2, 4, 2, n, seed=4)
    kw = dict(window=window, **kw_for(kind, groups, factor, sinks))
    want = window_attention(q, k, v, backend="reference", **kw)
    want_state = sequence_state(k, v, window, kw["sinks"], kind != "swa")
    for p in SPLITS:
        outs, state = [], None
        for start, stop, backend in [(0, p, first), (p, p + 7, then)] + [(i, i + 1, then) for i in range(p + 7, n)]:
            sl = slice(start, stop)
            out, state = window_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], backend=backend,
                                          initial_state=state, output_final_state=True, chunk_size=3, **kw)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=0, atol=1e-12, msg=f"split {p}")
        torch.testing.assert_close(state, want_state, rtol=0, atol=1e-10, msg=f"state, split {p}")


@pytest.mark.parametrize("kind", KINDS)
def test_state_rows_with_different_histories(kind):
    """The cache concatenates states of rows prefilled separately (padding); each row continues its own history,
    here one row still filling its sinks and window and the other past both."""
    window, sinks = 6, 3
    q, k, v, groups, factor = make(2, 4, 2, 30, seed=5)
    kw = dict(window=window, **kw_for(kind, groups, factor, sinks))
    lengths = (2, 25)
    states = [window_attention(q[b : b + 1, :, :p], k[b : b + 1, :, :p], v[b : b + 1, :, :p], output_final_state=True,
                               **kw)[1] for b, p in enumerate(lengths)]
    state = torch.cat(states)
    new = [torch.stack([t[b, :, p : p + 4] for b, p in enumerate(lengths)]) for t in (q, k, v)]
    for backend in ("banded", "recurrent"):
        out = window_attention(*new, backend=backend, initial_state=state, **kw)
        for b, p in enumerate(lengths):
            whole = window_attention(q[b : b + 1, :, : p + 4], k[b : b + 1, :, : p + 4], v[b : b + 1, :, : p + 4],
                                     backend="reference", **kw)
            torch.testing.assert_close(out[b : b + 1], whole[:, :, p:], rtol=0, atol=1e-12, msg=f"{backend} row {b}")


@pytest.mark.parametrize("kind", KINDS)
def test_state_size_does_not_grow_with_length(kind):
    d, dv, window, sinks = 16, 8, 7, 2
    s, kernel = kw_for(kind, None, None, sinks)["sinks"], kind != "swa"
    size = (s + window) * (d + dv + 1) + (feature_dim(d) * (dv + 1) if kernel else 0)
    assert window_state_size(d, dv, window, s, kernel) == size
    for n in (1, 9, 300):
        q, k, v, groups, factor = make(1, 4, 2, n, d=d, dv=dv)
        _, state = window_attention(q, k, v, window=window, output_final_state=True, **kw_for(kind, groups, factor, s))
        assert state.shape == (1, 2, size)
        _, state = window_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], window=window, initial_state=state,
                                    output_final_state=True, **kw_for(kind, groups, factor, s))
        assert state.shape == (1, 2, size)


def test_state_layout():
    """Sinks hold the first S tokens, the window rows the last W after them, right-aligned; the prefix is OAL's
    state (`oal.ops`, Eq. 5) of every token older than the window."""
    d, dv, window, sinks = 16, 8, 5, 2
    q, k, v, groups, factor = make(1, 4, 2, 6, d=d, dv=dv)
    rows = torch.cat([k, v, torch.ones_like(v[..., :1])], -1)
    slots, _ = split_window_state(window_attention(q, k, v, window=window, sinks=sinks, output_final_state=True)[1],
                                  d, dv, window, sinks)
    torch.testing.assert_close(slots[:, :, :2], rows[:, :, :2], rtol=0, atol=0)
    assert bool((slots[:, :, 2:3] == 0).all())  # 6 tokens: 2 sinks, 4 of the 5 window rows filled
    torch.testing.assert_close(slots[:, :, 3:], rows[:, :, 2:], rtol=0, atol=0)
    q, k, v, groups, factor = make(1, 4, 2, 30, d=d, dv=dv)
    rows = torch.cat([k, v, torch.ones_like(v[..., :1])], -1)
    _, state = window_attention(q, k, v, window=window, groups=groups, factor=factor, output_final_state=True)
    slots, prefix = split_window_state(state, d, dv, window, 0, True)
    torch.testing.assert_close(slots, rows[:, :, -window:], rtol=0, atol=0)
    _, older = oal_attention(q[:, :, :25], k[:, :, :25], v[:, :, :25], groups, factor, output_final_state=True)
    torch.testing.assert_close(prefix, older, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_call_keeps_the_state(kind):
    q, k, v, groups, factor = make(n=9)
    kw = dict(window=4, **kw_for(kind, groups, factor, 2))
    _, state = window_attention(q, k, v, output_final_state=True, **kw)
    for backend in ("banded", "recurrent"):
        out, again = window_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], backend=backend, initial_state=state,
                                      output_final_state=True, **kw)
        assert out.shape == (1, 4, 0, 8) and torch.equal(again, state)


# --------------------------------------------------------------------------------------------- stability


def signed_scores(n, logit, *, dtype, seed=0):
    """q, k whose scores are about +-logit (random signs along one direction, unit noise elsewhere), so that some
    queries' windows hold only very negative scores (the kernel's older keys dominate) and others do not."""
    q, k, v, groups, factor = make(1, 2, 1, n, d=16, dv=4, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    alpha = math.sqrt(4 * logit)  # scale 1/4: s = alpha^2 / 4 * sign * sign + noise
    q[..., 0] = alpha * torch.randint(0, 2, q[..., 0].shape, generator=gen).to(F64).mul(2).sub(1)
    k[..., 0] = alpha * torch.randint(0, 2, k[..., 0].shape, generator=gen).to(F64).mul(2).sub(1)
    groups[:, 0] = 0
    return [t.to(dtype) for t in (q, k, v)] + [groups, factor.to(dtype)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,logit,tol", [(F64, 1000.0, 1e-9), (torch.float32, 80.0, 1e-4),
                                              (torch.float32, 1000.0, 2e-3)])
def test_huge_logits_are_exact_and_finite(kind, dtype, logit, tol):
    window, n = 3, 128
    q, k, v, groups, factor = signed_scores(n, logit, dtype=dtype)
    kw = dict(window=window, **kw_for(kind, groups, factor, 2))
    want = window_attention(q.double(), k.double(), v.double(), backend="reference",
                            **{**kw, **({"factor": factor.double()} if kind != "swa" else {})})
    if kind == "oal-swa":  # both regimes occur: some queries are dominated by the window, some by the kernel
        from oal.ops.window import window_log_weights

        logw = window_log_weights(q.double(), k.double(), torch.arange(n), window=window, scale=0.25,
                                  kernel=(groups, factor.double(), 1e-6))
        j, i = torch.arange(n), torch.arange(n)[:, None]
        win = logw.masked_fill(~((j <= i) & (j > i - window)), -torch.inf).amax(-1)
        old = logw.masked_fill(~(j <= i - window), -torch.inf).logsumexp(-1)
        assert int((old > win + 50).sum()) > 5 and int((win > old + 50).sum()) > 5
    for backend in ("banded", "recurrent"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = window_attention(qq, kk, vv, backend=backend, chunk_size=5, **kw)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol, msg=backend)
        assert all(bool(torch.isfinite(g).all()) for g in grads(out, (qq, kk, vv)))


def test_rescaled_kernel_keeps_its_weight_against_the_window():
    """fp32 scores beyond finfo.max^(1/4) make the operator evaluate kappa / lam (`oal.ops._rescaled`); lam must
    come back in the shared normaliser. W = 1: odd queries see their own key at s = 43 and even older keys at
    s = 2.5e9 (log kappa ~ 43), so both parts carry weight and a lost lam (1 / 1.6e21) would show."""
    q, k, v, groups, factor = make(1, 1, 1, 9, d=16, dv=4, seed=2)
    q, k = q * 0.1, k * 0.1
    q[..., 0] = 1e5
    k[..., 0] = torch.where(torch.arange(9) % 2 == 0, 1e5, 43 * 4 / 1e5)  # s = scale q_0 k_0 = 2.5e9 or 43
    kw = dict(window=1, groups=groups, eps=1e-6)
    want = window_attention(q, k, v, factor=factor, backend="reference", **kw)
    from oal.ops.window import window_log_weights

    logw = window_log_weights(q, k, torch.arange(9), window=1, scale=0.25, kernel=(groups, factor, 1e-6))
    share = torch.exp(logw.diagonal(dim1=-2, dim2=-1) - logw.logsumexp(-1))[0, 0, 3::2]  # window weight, odd i
    assert bool((share > 0.02).all() and (share < 0.98).all()), share
    for backend in ("banded", "recurrent"):
        out = window_attention(q.float(), k.float(), v.float(), factor=factor.float(), backend=backend, **kw)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4, msg=backend)


@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_inputs(kind):
    q, k, v, groups, factor = make(n=70, dtype=torch.bfloat16)
    kw = dict(window=9, **kw_for(kind, groups, factor.float(), 2))
    out, state = window_attention(q, k, v, output_final_state=True, **kw)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    want = window_attention(q.double(), k.double(), v.double(), backend="reference",
                            **{**kw, **({"factor": factor.double()} if kind != "swa" else {})})
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)


def test_training_memory_is_not_quadratic():
    """Autograd keeps the band (N x (W + C)) and OAL's block inputs, nothing of size N x N."""
    q, k, v, groups, factor = make(1, 2, 1, 512, dtype=torch.float32, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        out = window_attention(q, k, v, window=16, groups=groups, factor=factor)
    out.sum().backward()
    assert factor.grad is not None and bool(torch.isfinite(factor.grad).all())
    assert max(sizes) < 512 * 512 // 4


# --------------------------------------------------------------------------------------------- bad input


BAD = [
    ("window", dict(window=0)),
    ("window", dict(window=-3)),
    ("window", dict(window=2.5)),
    ("window", dict(window=True)),
    ("sinks", dict(sinks=-1)),
    ("sinks", dict(sinks=-2, kernel=True)),
    ("causal", dict(causal=False)),
    ("backend", dict(backend="chunked")),
    ("chunk_size", dict(chunk_size=0)),
    ("initial_state", dict(initial_state=torch.zeros(1, 1, 7))),
    ("initial_state", dict(initial_state="state")),
    ("initial_state", dict(initial_state=torch.zeros(1, 1, window_state_size(16, 4, 4, 0)), backend="reference")),
    ("groups/factor", dict(groups=torch.zeros(2, 16, dtype=torch.long))),
    ("groups", dict(kernel=True, groups=torch.full((2, 16), 5))),
    ("factor", dict(kernel=True, factor=torch.randn(2, 3, 4))),
    ("eps", dict(kernel=True, eps=-1.0)),
    ("q", dict(q=torch.randn(2, 8, 16))),
    ("k", dict(k=torch.randn(1, 1, 5, 16))),
    ("v", dict(v=torch.randn(1, 1, 9, 4))),
    ("q/k", dict(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 4))),
    ("q", dict(q=torch.full((1, 2, 8, 16), float("nan")))),
    ("v", dict(v=torch.full((1, 1, 8, 4), float("inf")))),
]


@pytest.mark.parametrize("arg,override", BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_names_argument(arg, override):
    kw = dict(q=torch.randn(1, 2, 8, 16), k=torch.randn(1, 1, 8, 16), v=torch.randn(1, 1, 8, 4), window=4)
    override = dict(override)
    if override.pop("kernel", False):
        kw.update(groups=torch.zeros(2, 16, dtype=torch.long), factor=torch.randn(2, 3, 3))
    kw.update(override)
    with pytest.raises(ValueError, match=rf"^{arg}"):
        window_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
