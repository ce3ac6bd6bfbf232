"""Attention sinks in the hybrid operator: e^{s_ij} on the first S keys and the last W keys, OAL's kappa_ij on every
other older key, one normaliser. Every backend against the reference in float64 (outputs and gradients), GQA, the
prefix state. test_window.py runs its state, decode and stability tests on the hybrid with sinks too (kind
"oal-swa+sinks")."""

from __future__ import annotations

import pytest
import torch
from test_window import grads, make

import oal.ops.chunked as chunked
from oal.ops import oal_attention
from oal.ops.window import split_window_state, window_attention

F64 = torch.float64

MATRIX = [(n, w, s) for n in (1, 7, 63, 200) for w in (1, 5, 64) for s in (0, 1, 4, n + 3)]


@pytest.mark.parametrize("n,window,sinks", MATRIX, ids=[f"n{n}-W{w}-S{s}" for n, w, s in MATRIX])
def test_backends_match_reference_with_sinks(monkeypatch, n, window, sinks):
    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)  # an unwritten scratch entry would show up as NaN
    hkv = 2 if n % 2 else 3  # GQA: 3 or 2 query heads per KV head
    q, k, v, groups, factor = make(1, 6, hkv, n, d=8, dv=4, seed=n + window, requires_grad=True)
    inputs = (q, k, v, factor)
    kw = dict(window=window, sinks=sinks, groups=groups, factor=factor)
    ref = window_attention(q, k, v, backend="reference", **kw)
    ref_grads = grads(ref, inputs)
    for backend, chunk in (("banded", 3), ("banded", None), ("recurrent", None)):
        out = window_attention(q, k, v, backend=backend, chunk_size=chunk, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=f"{backend} out")
        for name, got, want in zip("q k v factor".split(), grads(out, inputs), ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-11, msg=f"{backend} d{name}")
        with torch.no_grad():
            torch.testing.assert_close(window_attention(q, k, v, backend=backend, chunk_size=chunk, **kw), ref,
                                       rtol=0, atol=1e-12, msg=f"{backend} no grad")


def test_reference_is_the_definition_by_hand():
    """e^{s_ij} for j < S or i - W < j <= i, eps + |L^T s_bar_ij|^2 for S <= j <= i - W, each key once."""
    n, window, sinks, eps, scale = 12, 3, 2, 1e-3, 0.5
    q, k, v, groups, factor = make(1, 1, 1, n, d=4, dv=3, g=2, seed=3)
    out = window_attention(q, k, v, window=window, sinks=sinks, groups=groups, factor=factor, eps=eps, scale=scale,
                           backend="reference")
    lower = torch.tril(factor[0])
    for i in range(n):
        w = []
        for j in range(i + 1):
            s = [scale * sum(q[0, 0, i, r] * k[0, 0, j, r] for r in range(4) if groups[0, r] == g) for g in range(2)]
            s_bar = torch.tensor([1.0] + [float(x) for x in s], dtype=F64)
            exact = j < sinks or j > i - window
            w.append(torch.exp(sum(s)) if exact else eps + (lower.T @ s_bar).pow(2).sum())
        w = torch.stack(w)
        torch.testing.assert_close(out[0, 0, i], (w[:, None] * v[0, 0, : i + 1]).sum(0) / w.sum(), rtol=0,
                                   atol=1e-12)


def test_sinks_zero_is_the_hybrid_without_sinks_and_all_sinks_is_softmax():
    q, k, v, groups, factor = make(n=30)
    kw = dict(window=4, groups=groups, factor=factor)
    for backend in ("reference", "banded", "recurrent"):
        assert torch.equal(window_attention(q, k, v, sinks=0, backend=backend, **kw),
                           window_attention(q, k, v, backend=backend, **kw))
    # S >= N - W: every key is exact, so it is causal softmax
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(window_attention(q, k, v, sinks=26, **kw), sdpa, rtol=0, atol=1e-12)
    assert not torch.allclose(window_attention(q, k, v, sinks=2, **kw), window_attention(q, k, v, **kw))


def test_prefix_state_holds_no_sink():
    """The prefix is OAL's state (Eq. 5) of keys S..N-W-1 only; the sinks stay exact rows."""
    d, dv, window, sinks = 16, 8, 5, 3
    q, k, v, groups, factor = make(1, 4, 2, 30, d=d, dv=dv)
    _, state = window_attention(q, k, v, window=window, sinks=sinks, groups=groups, factor=factor,
                                output_final_state=True)
    slots, prefix = split_window_state(state, d, dv, window, sinks, True)
    rows = torch.cat([k, v, torch.ones_like(v[..., :1])], -1)
    torch.testing.assert_close(slots[:, :, :sinks], rows[:, :, :sinks], rtol=0, atol=0)
    torch.testing.assert_close(slots[:, :, sinks:], rows[:, :, -window:], rtol=0, atol=0)
    old = slice(sinks, 30 - window)
    _, want = oal_attention(q[:, :, old], k[:, :, old], v[:, :, old], groups, factor, output_final_state=True)
    torch.testing.assert_close(prefix, want, rtol=0, atol=1e-10)
