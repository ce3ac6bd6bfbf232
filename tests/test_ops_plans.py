"""Decoding calls on the cache's own state that run an earlier call's plan (`oal.ops.plans`), and the status buffer
they share (`checks.decode_check`).

The CPU stands in for a deferred device (as in test_ops_deferred), with the kernels under Triton's interpreter. A
planned call must give what the full path gives, bit for bit, and must notice anything that changes its plan: an
in-place write to the kernel (a training step), a new shape. Its value checks still report every bad input, at most
`checks.DECODE_SHARED` calls late, and at once through `check_errors()`.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")

from test_ops_deferred import on_device  # noqa: E402, F401  (the fixture)
from test_triton import DEVICE, make_inputs  # noqa: E402

from oal.ops import checks, oal_attention, plans  # noqa: E402
from oal.ops.window import window_attention  # noqa: E402

METHODS = ["oal", "oal-swa", "swa"]


def _call(method, q, k, v, groups, factor, **kw):
    if method == "oal":
        return oal_attention(q, k, v, groups, factor, backend="triton", **kw)
    if method == "swa":
        groups = factor = None
    return window_attention(q, k, v, window=4, sinks=2, groups=groups, factor=factor, **kw)


def _decode(method, q, k, v, groups, factor, *, owned: bool, tokens=(1,), edit=None):
    """Prefill 6 tokens, then calls of `tokens[i % len(tokens)]` tokens each on the state: the cache's own when
    `owned` (planned after the first call), else a caller's (the full path every call). `edit(i)` runs before call
    i. Returns the outputs of every decoding call and the final state."""
    _, state = _call(method, q[:, :, :6], k[:, :, :6], v[:, :, :6], groups, factor, output_final_state=True)
    outs, t, i = [], 6, 0
    with torch.no_grad():
        while t < q.shape[2]:
            if edit is not None:
                edit(i)
            sl = slice(t, t + tokens[i % len(tokens)])
            with checks.cache_owned(state) if owned else torch.no_grad():
                out, state = _call(method, q[:, :, sl], k[:, :, sl], v[:, :, sl], groups, factor,
                                   initial_state=state, output_final_state=True)
            outs.append(out)
            t, i = sl.stop, i + 1
    checks.check_errors()
    return torch.cat(outs, dim=2), state


def kernel_edits(groups, factor, factor_at: int, groups_at: int):
    """Copies (g, f) of the kernel and `edit(i)`, a training step's in-place writes: f scaled before call
    `factor_at`, g's ids rolled before call `groups_at`."""
    g, f = groups.clone(), factor.clone()

    def edit(i):
        if i == factor_at:
            f.mul_(1.5)
        if i == groups_at:
            g.copy_(g.roll(1, dims=-1))

    return g, f, edit


def _plans_made(monkeypatch) -> list:
    """Counts the plans kept (each by a call that took the full path)."""
    made = []
    keep = plans.keep
    monkeypatch.setattr(plans, "keep", lambda *a: made.append(1) or keep(*a))
    return made


@pytest.mark.parametrize("method", METHODS)
def test_planned_calls_give_the_full_paths_results(on_device, monkeypatch, method):  # noqa: F811
    """Ten tokens one by one: the planned calls (the cache's own state) equal the full path's calls (a caller's state,
    copied and checked each call) exactly, and only the first decoding call takes the full path."""
    q, k, v, groups, factor = make_inputs(2, 6, 2, 16, 12, 7, 3, seed=21)
    want, want_state = _decode(method, q, k, v, groups, factor, owned=False)
    made = _plans_made(monkeypatch)
    got, state = _decode(method, q, k, v, groups, factor, owned=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    assert made == [1]


@pytest.mark.parametrize("method", ["oal", "oal-swa"])
def test_a_plan_follows_the_kernel_written_in_place(on_device, method):  # noqa: F811
    """A training step between two decoding calls (the factor, then the group ids, written in place): the next call
    makes a new plan with the new kernel, as the full path does."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 14, 12, 7, 3, seed=22)

    def run(owned):
        g, f, edit = kernel_edits(groups, factor, 3, 6)
        return _decode(method, q, k, v, g, f, owned=owned, edit=edit)

    got, state = run(True)
    want, want_state = run(False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_a_new_number_of_tokens_makes_a_new_plan(on_device, method):  # noqa: F811
    """Calls of 1, 3 and 2 tokens in turn: each signature its own plan, the results the full path's."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 24, 12, 7, 3, seed=23)
    got, _ = _decode(method, q, k, v, groups, factor, owned=True, tokens=(1, 3, 2))
    want, _ = _decode(method, q, k, v, groups, factor, owned=False, tokens=(1, 3, 2))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_shared_checks_report_a_bad_call_within_decode_shared_calls(on_device, monkeypatch, method):  # noqa: F811
    """A NaN in one token's q: the calls sharing its status buffer go on; the call after the buffer's last reports
    it with the usual message, and `check_errors()` reports it at once."""
    checks.check_errors()  # no shared status left open by an earlier test: this one counts its calls from 1
    monkeypatch.setattr(checks, "DECODE_SHARED", 3)
    q, k, v, groups, factor = make_inputs(1, 4, 2, 12, 12, 7, 3, seed=24)
    _, state = _call(method, q[:, :, :6], k[:, :, :6], v[:, :, :6], groups, factor, output_final_state=True)
    step = [t[:, :, 6:7].clone() for t in (q, k, v)]
    bad = [step[0].clone().index_fill_(-1, torch.tensor([2], device=q.device), float("nan")), *step[1:]]
    message = "^q: contains NaN or Inf values.*found on"
    with torch.no_grad(), checks.cache_owned(state):
        _call(method, *step, groups, factor, initial_state=state)  # opens a shared status: 1 call of 3
        _call(method, *bad, groups, factor, initial_state=state)  # 2 of 3
        _call(method, *step, groups, factor, initial_state=state)  # 3 of 3: the status goes to the host
        with pytest.raises(ValueError, match=message):
            _call(method, *step, groups, factor, initial_state=state)
        _call(method, *bad, groups, factor, initial_state=state)
    with pytest.raises(ValueError, match=message):
        checks.check_errors()


@pytest.mark.skipif(DEVICE == "cuda", reason="collects the state on the CPU stand-in")
def test_a_plan_does_not_keep_its_state_alive(on_device):  # noqa: F811
    q, k, v, groups, factor = make_inputs(1, 4, 2, 9, 12, 7, 3, seed=25)
    _, state = oal_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], groups, factor, output_final_state=True)
    with torch.no_grad(), checks.cache_owned(state):
        oal_attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], groups, factor, backend="triton", initial_state=state)
    assert len(plans._PLANS) >= 1
    ref = weakref.ref(state)
    del state
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("method", METHODS)
def test_bad_input_on_the_caches_state_is_still_named(on_device, method):  # noqa: F811
    """A planned layer given bad input: no plan matches it, and the full path names the argument."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 9, 12, 7, 3, seed=26)
    _, state = _call(method, q[:, :, :7], k[:, :, :7], v[:, :, :7], groups, factor, output_final_state=True)
    step = [t[:, :, 7:8] for t in (q, k, v)]
    with torch.no_grad(), checks.cache_owned(state):
        _call(method, *step, groups, factor, initial_state=state)  # keeps a plan
        with pytest.raises(ValueError, match="^k: expected a 4-D tensor"):
            _call(method, step[0], step[1].tolist(), step[2], groups, factor, initial_state=state)
        with pytest.raises(ValueError, match="^v: expected shape"):
            _call(method, step[0], step[1], step[2][:, :1], groups, factor, initial_state=state)
        if method == "oal":
            with pytest.raises(ValueError, match="^eps: expected a finite number"):
                _call(method, *step, groups, factor, initial_state=state, eps=torch.tensor(1e-6))
        if method != "swa":
            with pytest.raises(ValueError, match="^groups: expected an integer tensor"):
                _call(method, *step, groups.tolist(), factor, initial_state=state)


def launch_sites(obj, depth: int = 2) -> list:
    """The `launch.Launch` sites a plan holds (in its attributes, and theirs: `decode.Step`, `guard.Site`, ...)."""
    from oal.ops.triton import launch

    found = []
    for value in vars(obj).values():
        if isinstance(value, launch.Launch):
            found.append(value)
        elif depth and type(value).__module__.startswith("oal.") and hasattr(value, "__dict__"):
            found += launch_sites(value, depth - 1)
    return found


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels exist on a GPU (test_triton_launch stands them in)")
@pytest.mark.parametrize("method", [*METHODS, "prefill"])
def test_plans_keep_their_compiled_launchers_on_a_gpu(on_device, monkeypatch, method):  # noqa: F811
    """With OAL_TRITON_DIRECT_LAUNCH=1, every launch site of a plan keeps the compiled kernel's launcher after its
    first call (dv 11: oal-swa's prefix state is 16-byte aligned): Triton's launch returns the kernel, an
    autotuner names its pick. A release where it does not would leave the variable without effect, silently."""
    from oal.ops.triton import launch

    monkeypatch.setenv(launch.ENV, "1")
    q, k, v, groups, factor = make_inputs(1, 4, 2, 14, 16, 11, 3, seed=27)
    if method == "prefill":
        with torch.no_grad():
            for _ in range(3):
                oal_attention(q, k, v, groups, factor, backend="triton")
        plan = plans._FRESH[factor][2]
    else:
        _, state = _decode(method, q, k, v, groups, factor, owned=True)
        plan = plans._PLANS[state][1]
    checks.check_errors()
    sites = launch_sites(plan)
    assert len(sites) >= {"oal": 2, "oal-swa": 3, "swa": 1, "prefill": 2}[method], sites
    assert all(site.runner is not None and not site.failed for site in sites), [vars(s) for s in sites]
