"""The operator's coefficient cache (`kernel.cached_coefficients`): built once per kernel for decoding, exact, and
rebuilt whenever factor, groups, eps or scale change; never used where gradients must reach the factor."""

from __future__ import annotations

import torch

from oal.methods.oal import OALMethod
from oal.ops import oal_attention
from oal.ops.kernel import cached_coefficients

F64 = torch.float64


def _inputs(n=9, hq=6, hkv=2, d=12, dv=5, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=gen, dtype=F64)
    k = torch.randn(1, hkv, n, d, generator=gen, dtype=F64)
    v = torch.randn(1, hkv, n, dv, generator=gen, dtype=F64)
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64) * 0.5
    return q, k, v, groups, factor


def _decode(q, k, v, groups, factor_of_step):
    """Prefill 3 tokens, then one token per call on the returned state (the `auto` token loop)."""
    out, state = oal_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], groups, factor_of_step(), output_final_state=True)
    outs = [out]
    for t in range(3, q.shape[2]):
        sl = slice(t, t + 1)
        out, state = oal_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], groups, factor_of_step(),
                                   initial_state=state, output_final_state=True)
        outs.append(out)
    return torch.cat(outs, dim=2)


def test_decoding_with_the_cache_is_bit_identical_and_matches_the_reference():
    q, k, v, groups, factor = _inputs()
    with torch.no_grad():
        cached = _decode(q, k, v, groups, lambda: factor)  # one tensor: every step after the first is a hit
        fresh = _decode(q, k, v, groups, lambda: factor.clone())  # a new tensor every step: always rebuilt
    assert torch.equal(cached, fresh)
    ref = oal_attention(q, k, v, groups, factor, backend="reference")
    torch.testing.assert_close(cached, ref, rtol=1e-10, atol=1e-12)
    first = cached_coefficients(factor, groups, 1e-6, 12**-0.5)
    assert cached_coefficients(factor, groups, 1e-6, 12**-0.5)[1] is first[1]  # reused, not rebuilt


def test_changing_the_kernel_invalidates_the_cache():
    q, k, v, groups, factor = _inputs(seed=1)
    _, state = oal_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], groups.clone(), factor.clone(),
                             output_final_state=True)
    step = (q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5])

    def fresh(**kw):  # the same values in new tensors: nothing cached for them
        return oal_attention(*step, groups.clone(), factor.clone(), initial_state=state, **kw)

    with torch.no_grad():
        before = oal_attention(*step, groups, factor, initial_state=state)
        factor.data.mul_(1.5)  # a write that bypasses the version counter
        after = oal_attention(*step, groups, factor, initial_state=state)
        assert not torch.allclose(before, after) and torch.equal(after, fresh())
        groups.data[0, 0] = (groups[0, 0] + 1) % 3
        regrouped = oal_attention(*step, groups, factor, initial_state=state)
        assert not torch.equal(regrouped, after) and torch.equal(regrouped, fresh())
        other_eps = oal_attention(*step, groups, factor, initial_state=state, eps=0.5)
        assert not torch.equal(other_eps, regrouped) and torch.equal(other_eps, fresh(eps=0.5))
        other_scale = oal_attention(*step, groups, factor, initial_state=state, scale=0.1)
        assert not torch.equal(other_scale, regrouped) and torch.equal(other_scale, fresh(scale=0.1))


def test_method_after_an_optimiser_step_and_training_gradients():
    """A trained factor (optimiser step between decoded tokens) is picked up; in grad mode the gradients reach the
    factor exactly as without a cache (against the dense reference, float64)."""
    q, k, v, groups, factor = _inputs(seed=2)
    method = OALMethod(6, 2, 12, groups=groups, factor=factor).double()
    _, state = oal_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], groups, factor.clone(), output_final_state=True)
    step = (q[:, :, 4:5], k[:, :, 4:5], v[:, :, 4:5])
    with torch.no_grad():
        before = method(*step, initial_state=state)
    opt = torch.optim.SGD(method.parameters(), lr=0.1)
    loss = method(q, k, v).square().sum()
    loss.backward()
    ref_factor = method.factor.detach().clone().requires_grad_(True)
    oal_attention(q, k, v, groups, ref_factor, backend="reference").square().sum().backward()
    torch.testing.assert_close(method.factor.grad, ref_factor.grad, rtol=1e-9, atol=1e-12)
    opt.step()
    with torch.no_grad():
        after = method(*step, initial_state=state)
        want = oal_attention(*step, groups, method.factor.detach().clone(), initial_state=state)
    assert not torch.allclose(before, after)
    assert torch.equal(after, want)


def test_pair_indices_first_built_in_inference_mode_serve_autograd():
    """Evaluating a model, then training it in the same process: the cached pair indices are normal tensors."""
    from oal.ops import kernel

    kernel._PAIR_CACHE.pop((5, "cpu"), None)
    with torch.inference_mode():
        kernel.packed_pairs(5)
    c = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = kernel.query_coefficients(torch.ones(2, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64), c, 0.5)
    w.sum().backward()
    assert c.grad is not None and c.grad.abs().sum() > 0
