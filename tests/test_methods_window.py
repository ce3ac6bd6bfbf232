"""The sliding-window methods swa, oal-swa and global-swa behind the AttentionMethod interface (issue 29)."""

from __future__ import annotations

import pytest
import torch

from oal.methods import build_method, method_names
from oal.methods.base import AttentionMethod

F64 = torch.float64
NAMES = ("swa", "oal-swa", "global-swa")


def make(hq=4, hkv=2, n=30, d=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, n, dd, generator=gen, dtype=F64) for h, dd in ((hq, d), (hkv, d), (hkv, dv))]


def build(name, hq=4, hkv=2, d=16, window=5, seed=0):
    kwargs = dict(window=window, sinks=2)
    if name == "oal-swa":
        kwargs["groups"] = torch.randint(0, 3, (hq, d), generator=torch.Generator().manual_seed(seed))
    m = build_method(name, hq, hkv, d, **kwargs).double()
    if m.trainable:  # move off the Taylor start so that every factor entry matters
        with torch.no_grad():
            m.factor.add_(0.2 * torch.randn(m.factor.shape, generator=torch.Generator().manual_seed(1), dtype=F64))
    return m


def test_registered_with_their_settings():
    assert set(NAMES) <= set(method_names())
    swa = build_method("swa", 4, 2, 16)
    assert (swa.window, swa.sinks) == (64, 4) and isinstance(swa.window, int) and isinstance(swa.sinks, int)
    assert build_method("oal-swa", 4, 2, 16, window=9).window == 9
    assert all(build_method(n, 4, 2, 16).sinks == 4 for n in ("oal-swa", "global-swa"))  # as swa
    assert build_method("global-swa", 4, 2, 16, groups=torch.ones(4, 16, dtype=torch.long)).n_groups == 1
    assert all(build_method(n, 4, 2, 16).supports_state for n in NAMES)


BAD_SETTINGS = [("swa", dict(window=0), "window"), ("swa", dict(sinks=-1), "sinks"),
                ("oal-swa", dict(window=1.5), "window"), ("oal-swa", dict(sinks=-1), "sinks"),
                ("global-swa", dict(window=False), "window"), ("global-swa", dict(sinks=1.0), "sinks")]


@pytest.mark.parametrize("name,kwargs,arg", BAD_SETTINGS)
def test_bad_settings_name_the_argument(name, kwargs, arg):
    with pytest.raises(ValueError, match=rf"^{arg}"):
        build_method(name, 4, 2, 16, **kwargs)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_forward_reference_and_dense_kernel_agree(name, hq, hkv):
    m = build(name, hq, hkv)
    q, k, v = make(hq, hkv, n=23)
    out = m(q, k, v)
    torch.testing.assert_close(out, m.reference(q, k, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(AttentionMethod.reference(m, q, k, v), out, rtol=0, atol=1e-12)  # via dense_kernel


@pytest.mark.parametrize("name", NAMES)
def test_dense_kernel_at_sampled_positions(name):
    """Queries at given positions against the causal prefix: the reference's rows at those positions."""
    m = build(name)
    q, k, v = make(n=30)
    pos = torch.tensor([0, 4, 5, 17, 22])
    w = m.dense_kernel(q[:, :, pos], k[:, :, :23], positions=pos)
    rows = (w @ v.repeat_interleave(2, dim=1)[:, :, :23]) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(rows, m.reference(q, k, v)[:, :, pos], rtol=0, atol=1e-12)
    torch.testing.assert_close(m.dense_kernel(q[:, :, 18:23], k[:, :, :23]),
                               m.dense_kernel(q[:, :, 18:23], k[:, :, :23], positions=torch.arange(18, 23)))
    with pytest.raises(ValueError, match="^positions"):
        m.dense_kernel(q[:, :, :2], k[:, :, :5], positions=torch.tensor([1, 5]))


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_equals_one_call(name):
    m = build(name)
    q, k, v = make(n=30)
    want = m(q, k, v)
    out, state = m(q[:, :, :13], k[:, :, :13], v[:, :, :13], output_final_state=True)
    outs = [out]
    for i in range(13, 30):
        out, state = m(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], initial_state=state,
                       output_final_state=True)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=0, atol=1e-12)


def test_kernel_parameters_and_gradients():
    swa = build("swa")
    assert swa.n_kernel_params == 0 and not swa.trainable and not list(swa.parameters())
    hybrid, glob = build("oal-swa"), build("global-swa")
    oal = build_method("oal", 4, 2, 16, groups=hybrid.groups, n_groups=hybrid.n_groups)
    assert hybrid.n_kernel_params == oal.n_kernel_params  # (G_h + 1)(G_h + 2) / 2 per head (App. D)
    assert glob.n_kernel_params == 4 * 3
    q, k, v = make(n=30)
    for m in (hybrid, glob):
        m(q, k, v).pow(2).sum().backward()
        assert m.factor.grad is not None and float(m.factor.grad.abs().max()) > 0


def test_covering_window_is_softmax():
    """With the window over the whole sequence the kernel never enters: exact causal softmax."""
    q, k, v = make(n=20)
    softmax = build_method("softmax", 4, 2, 16)(q, k, v)
    for name in NAMES:
        torch.testing.assert_close(build(name, window=20)(q, k, v), softmax, rtol=0, atol=1e-12)
