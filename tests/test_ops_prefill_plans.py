"""Fresh sequences on the parallel kernels that run an earlier call's plan (`oal.ops.plans.fresh`,
`oal.ops.triton.prefill`).

The CPU stands in for a deferred device (as in test_ops_deferred), with the kernels under Triton's interpreter. The
full path (`checks.start`, `triton_attention`, `parallel.attention`) is the reference: a planned call must give its
output bit for bit, notice anything that changes the plan (an in-place write to the kernel, another length, a
call that asks for more), and still report every bad input.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")

from test_ops_deferred import on_device  # noqa: E402, F401  (the fixture)
from test_ops_plans import kernel_edits  # noqa: E402
from test_triton import DEVICE, F64, make_inputs, rel_err  # noqa: E402

from oal.ops import checks, oal_attention, plans  # noqa: E402


def _prefills(q, k, v, groups, factor, lengths, edit=None) -> list:
    """No-gradient calls on the first `lengths[i]` tokens; `edit(i)` runs before call i."""
    outs = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            if edit is not None:
                edit(i)
            outs.append(oal_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], groups, factor, backend="triton"))
    checks.check_errors()
    return outs


def _full_path(monkeypatch):
    """No call finds or keeps a plan: every call takes the full path."""
    monkeypatch.setattr(plans, "fresh", lambda *a, **kw: (None, None))


def _plans_made(monkeypatch) -> list:
    made = []
    keep = plans.keep_fresh
    monkeypatch.setattr(plans, "keep_fresh", lambda *a: made.append(a[2]) or keep(*a))
    return made


def test_planned_prefills_give_the_full_paths_results(on_device, monkeypatch):  # noqa: F811
    """Lengths 20, 20, 20, 33, 33, 20, 17, 17: a plan by the second call in a row at a length (the last one's is
    kept per kernel), none for a length seen once; the outputs the full path's exactly."""
    q, k, v, groups, factor = make_inputs(2, 6, 2, 40, 12, 7, 3, seed=31)
    lengths = (20, 20, 20, 33, 33, 20, 17, 17)
    made = _plans_made(monkeypatch)
    got = _prefills(q, k, v, groups, factor, lengths)
    assert len(made) == 3
    with monkeypatch.context() as m:
        _full_path(m)
        want = _prefills(q, k, v, groups, factor, lengths)
    assert len(made) == 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_lengths_that_keep_changing_make_no_plan_and_no_signature(on_device, monkeypatch):  # noqa: F811
    """An evaluation's batches, each of another length: no plan is built, no signature worked out (one lookup a
    call), and the outputs are the full path's."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 30, 12, 7, 3, seed=38)
    lengths = (12, 13, 30, 29, 12)
    made, signatures = _plans_made(monkeypatch), []
    inputs = plans._inputs
    monkeypatch.setattr(plans, "_inputs", lambda *a: signatures.append(1) or inputs(*a))
    got = _prefills(q, k, v, groups, factor, lengths)
    assert made == [] and signatures == []
    with monkeypatch.context() as m:
        _full_path(m)
        want = _prefills(q, k, v, groups, factor, lengths)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_prefill_plan_follows_the_kernel_written_in_place(on_device, monkeypatch):  # noqa: F811
    """A training step between two calls (the factor, then the group ids, written in place): the next call makes
    a new plan with the new kernel, as the full path computes it."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 30, 12, 7, 3, seed=32)

    def run():
        g, f, edit = kernel_edits(groups, factor, 2, 4)
        return _prefills(q, k, v, g, f, [30] * 6, edit=edit)

    made = _plans_made(monkeypatch)
    got = run()
    assert len(made) == 3
    with monkeypatch.context() as m:
        _full_path(m)
        want = run()
    assert not torch.equal(want[1], want[2]) and not torch.equal(want[3], want[4])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_call_that_asks_for_more_takes_its_own_route(on_device, monkeypatch):  # noqa: F811
    """After a plan at a length: the same inputs asking for the final state, a chunk size or a gradient get what
    the full path gives them (the state, the chunked kernels, autograd), not the plan's output."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 24, 12, 7, 3, seed=33)
    _prefills(q, k, v, groups, factor, [24, 24])
    with torch.no_grad():
        got = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)
        chunked = oal_attention(q, k, v, groups, factor, backend="triton", chunk_size=16)
    leaf = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(oal_attention(leaf, k, v, groups, factor, backend="triton").sum(), leaf)
    with monkeypatch.context() as m:
        _full_path(m)
        with torch.no_grad():
            want = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)
            want_chunked = oal_attention(q, k, v, groups, factor, backend="triton", chunk_size=16)
    checks.check_errors()
    assert isinstance(got, tuple) and got[1].shape == want[1].shape
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(chunked, want_chunked, rtol=0, atol=0)
    leaf64 = q.to(F64).requires_grad_()
    ref = oal_attention(leaf64, k.to(F64), v.to(F64), groups, factor.to(F64), backend="reference")
    (dq64,) = torch.autograd.grad(ref.sum(), leaf64)
    assert rel_err(dq, dq64) < 1e-4


def test_a_length_past_the_parallel_route_takes_the_chunked_kernels(on_device, monkeypatch):  # noqa: F811
    """A plan at 24 tokens, then the crossover lowered below 24 (as `benchmarks.gpu` forces a route): the next call
    runs the chunked kernels, not the plan."""
    from oal.ops.triton import prefill, routes

    q, k, v, groups, factor = make_inputs(1, 4, 2, 24, 12, 7, 3, seed=37)
    runs = []
    call = prefill.Plan.__call__
    monkeypatch.setattr(prefill.Plan, "__call__", lambda self, *a: runs.append(1) or call(self, *a))
    _prefills(q, k, v, groups, factor, [24, 24, 24])
    assert len(runs) == 2  # the second call's (the one that made the plan) and the third's
    monkeypatch.setattr(routes, "PARALLEL_MAX", 16)
    got = _prefills(q, k, v, groups, factor, [24])[0]
    assert len(runs) == 2
    with torch.no_grad():
        want, _ = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)  # chunked
    checks.check_errors()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_input_on_a_planned_prefill_is_still_reported(on_device):  # noqa: F811
    """A NaN in q at a planned signature: reported late with the usual message. A wrong shape or group ids out of
    range: no plan matches, and the full path names the argument."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 16, 12, 7, 3, seed=34)
    _prefills(q, k, v, groups, factor, [16, 16])
    bad = q.clone()
    bad[0, 1, 3, 2] = float("nan")
    with torch.no_grad():
        oal_attention(bad, k, v, groups, factor, backend="triton")
        with pytest.raises(ValueError, match="^q: contains NaN or Inf values.*found on"):
            checks.check_errors()
        with pytest.raises(ValueError, match="^v: expected shape"):
            oal_attention(q, k, v[:, :1], groups, factor, backend="triton")
        with pytest.raises(ValueError, match="^q: expected a 4-D tensor"):
            oal_attention(q[0, 0], k, v, groups, factor, backend="triton")
        with pytest.raises(ValueError, match="^groups: ids must lie"):
            oal_attention(q, k, v, groups + 5, factor, backend="triton")
        with pytest.raises(ValueError, match="^eps: expected a finite number"):
            oal_attention(q, k, v, groups, factor, backend="triton", eps=torch.tensor(1e-6))


@pytest.mark.parametrize("q_scale,k_scale", [(1e10, 1.0), (1e15, 1e3)])
def test_a_planned_prefill_rescales_exactly(on_device, q_scale, k_scale):  # noqa: F811
    """Scores that would overflow, at a planned signature: the guard's multipliers reach the kernel through the
    plan's status, and the output matches fp64 (Eq. 7 with kappa / s_max^2)."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 21, 12, 7, 3, seed=35)
    _prefills(q, k, v, groups, factor, [21, 21])  # the plan, at ordinary scores
    q, k = q * q_scale, k * k_scale
    got = _prefills(q, k, v, groups, factor, [21])[0]
    want = oal_attention(q.to(F64), k.to(F64), v.to(F64), groups, factor.to(F64), backend="reference")
    assert rel_err(got, want) < 1e-4


@pytest.mark.skipif(DEVICE == "cuda", reason="collects the kernel on the CPU stand-in")
def test_a_prefill_plan_does_not_keep_its_kernel_alive(on_device):  # noqa: F811
    q, k, v, groups, factor = make_inputs(1, 4, 2, 16, 12, 7, 3, seed=36)
    _prefills(q, k, v, groups, factor, [16, 16])
    assert plans._FRESH[factor][2] is not None
    ref = weakref.ref(factor)
    del factor
    gc.collect()
    assert ref() is None
