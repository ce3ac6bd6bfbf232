"""Attention sinks in the hybrids (oal-swa, global-swa): e^{s_ij} on the first S keys and the last W keys, OAL's
kappa_ij on every other older key, one normaliser. Every backend against the reference in float64 (outputs and
gradients), GQA, the prefix state, the methods, calibration and kernels files of version 1. test_window.py runs
its state, decode and stability tests on the hybrid with sinks too (kind "oal-swa+sinks")."""

from __future__ import annotations

import inspect

import pytest
import torch
from test_io import _base
from test_window import grads, make
from test_window_calibration import _layer_data

import oal
import oal.ops.chunked as chunked
from oal.calibration.data import CalibConfig
from oal.calibration.fit import calibrate_methods, sampled_dense_output
from oal.calibration.kernels import load_kernels, method_from_record, method_record, save_kernels
from oal.methods import build_method
from oal.methods.base import newer_versions
from oal.models.pretrained import build_methods, conversion_spec
from oal.ops import oal_attention
from oal.ops.window import split_window_state, window_attention
from oal.pipeline.config import SINKS

F64 = torch.float64
HYBRIDS = ("oal-swa", "global-swa")

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


# --------------------------------------------------------------------------------------------- methods


def _hybrid(name, sinks, window=9, hq=4, hkv=2, d=16):
    """A float64 hybrid; oal-swa with fixed 3-group groups."""
    kw = dict(window=window, sinks=sinks)
    if name == "oal-swa":
        kw.update(groups=torch.randint(0, 3, (hq, d), generator=torch.Generator().manual_seed(9)), n_groups=3)
    return build_method(name, hq, hkv, d, **kw).double()


@pytest.mark.parametrize("name", HYBRIDS)
def test_methods_take_sinks(name):
    m = _hybrid(name, 3)
    assert inspect.signature(type(m)).parameters["sinks"].default == SINKS  # the run's --sinks default, as swa
    assert m.settings == ("window", "sinks")
    q, k, v, _, _ = make(n=40)
    want = window_attention(q, k, v, window=9, sinks=3, groups=m.groups, factor=m.factor, backend="reference")
    torch.testing.assert_close(m.reference(q, k, v), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(m(q, k, v), want, rtol=0, atol=1e-12)
    w = m.dense_kernel(q, k)  # the weights of the definition: softmax rows give the same output
    w = w.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), 0.0)
    torch.testing.assert_close((w / w.sum(-1, keepdim=True)) @ v.repeat_interleave(2, dim=1), want, rtol=0,
                               atol=1e-12)
    pos = torch.tensor([0, 2, 3, 11, 12, 30])  # sampled calibration queries: sinks at their own positions
    torch.testing.assert_close(sampled_dense_output(m, q, k, v, pos), want[:, :, pos], rtol=0, atol=1e-12)


def test_calibrate_methods_carries_sinks():
    train, val = _layer_data(3, 1), _layer_data(2, 2)
    groups = torch.randint(0, 3, (4, 16), generator=torch.Generator().manual_seed(5))
    cfg = CalibConfig(max_steps=12, val_every=6, patience=12, seed=0)
    done = calibrate_methods(["oal-swa", "global-swa"], train, val, layer=0, groups=groups, cfg=cfg,
                             options={"window": 7, "sinks": 3})
    for name in HYBRIDS:
        m, res = done[name]
        assert (m.window, m.sinks) == (7, 3)
        with torch.no_grad():  # the recorded validation MSE is this method's own output, sinks included
            mse = (m(val.q, val.k, val.v) - val.out).square().mean(dim=(0, 2, 3))
        torch.testing.assert_close(mse, torch.tensor([h.val_mse for h in res.heads]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", HYBRIDS)
def test_kernels_record_sinks_and_version_one_loads_as_no_sinks(tmp_path, name):
    m = _hybrid(name, 2).float()
    info, state = method_record(m)
    assert info["version"] == 2 and info["init"]["sinks"] == 2
    save_kernels({0: m}, tmp_path / "new", fingerprint={})
    assert load_kernels(tmp_path / "new")[0][0].sinks == 2
    old = {**info, "version": 1, "init": {a: b for a, b in info["init"].items() if a != "sinks"}}  # before sinks
    loaded = method_from_record(0, old, state)
    assert loaded.sinks == 0  # the function version 1 computed
    q, k, v, _, _ = make(n=30, dtype=torch.float32)
    kw = dict(window=9, groups=m.groups, factor=m.factor, backend="reference")
    torch.testing.assert_close(loaded(q, k, v), window_attention(q, k, v, **kw), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="construction version 3"):
        method_from_record(0, {**info, "version": 3}, state)
    assert newer_versions([name, "swa"]) == {name: 2}  # a run's stage keys change: it recalibrates
    # an exported model's config.oal of version 1 rebuilds the same way
    spec = conversion_spec(oal.convert(_base(), [1], {1: _hybrid(name, 2, hkv=2, d=8).float()}))
    assert spec["layers"]["1"]["version"] == 2 and build_methods(spec)[1].sinks == 2
    spec["layers"]["1"]["version"] = 1
    del spec["layers"]["1"]["init"]["sinks"]
    assert build_methods(spec)[1].sinks == 0

