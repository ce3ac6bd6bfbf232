"""The Triton decoding step of swa and oal-swa (`oal.ops.triton.window_decode`) against the torch token loop
(`window.recurrent`) and the fp64 dense reference.

Window attention with sinks and, for oal-swa, OAL's kernel on the keys that left the window (the prefix state of
Eq. 5 read out by Eq. 6, kappa of Eq. 7), under one normaliser. The kernels run where the value checks are
deferred (CUDA); CI runs them on CPU tensors under Triton's interpreter, the CPU added to
`checks.DEFERRED_DEVICES`. The decoding kernels have no backward: a call that needs a gradient runs the torch loop.
Odd sizes (d = 12, dv = 7, three query heads per KV head) leave padded columns in every tile.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_ops_deferred import _window_steps, count_kernels  # noqa: E402
from test_triton import DEVICE, F64, make_inputs, rel_err  # noqa: E402

from oal.ops import checks  # noqa: E402
from oal.ops.triton import routes  # noqa: E402
from oal.ops.window import window_attention  # noqa: E402


@pytest.fixture
def on_device(monkeypatch):
    """The CPU stands in for a device whose value checks are deferred; counts the window kernels' launches."""
    from oal.ops.triton import window_decode

    monkeypatch.setattr(checks, "DEFERRED_DEVICES", {"cpu", "cuda"})
    monkeypatch.delenv("OAL_SYNC_CHECKS", raising=False)
    calls = []  # per decoding call on the kernels: whether it ran oal-swa's (True) or swa's (False)
    run = window_decode.Plan.__call__

    def counted(plan, *args, **kwargs):
        calls.append(plan.step is not None)
        return run(plan, *args, **kwargs)

    monkeypatch.setattr(window_decode.Plan, "__call__", counted)
    yield calls
    checks.check_errors()


CASES = [  # (window, sinks, prefill, new tokens per call): sinks still filling, a window shorter than a call, ...
    pytest.param(5, 2, 1, 1, id="W5-S2-one-token"),
    pytest.param(5, 2, 9, 3, id="W5-S2-three-tokens"),
    pytest.param(3, 4, 1, 4, id="sinks-fill-during-a-call"),
    pytest.param(2, 1, 1, 4, id="window-shorter-than-the-call"),
    pytest.param(1, 0, 2, 4, id="W1-no-sinks"),
]


@pytest.mark.parametrize("window,sinks,prefill,tokens", CASES)
@pytest.mark.parametrize("kernel", [True, False], ids=["oal-swa", "swa"])
def test_the_kernels_give_the_token_loop_and_the_reference(on_device, monkeypatch, kernel, window, sinks, prefill,
                                                          tokens):
    q, k, v, groups, factor = make_inputs(2, 6, 2, 15, 12, 7, 3, seed=window * 10 + sinks)
    groups, factor = (groups, factor) if kernel else (None, None)
    kw = dict(window=window, sinks=sinks, prefill=prefill, tokens=tokens)
    got, got_state = _window_steps(q, k, v, groups, factor, **kw)
    checks.check_errors()
    assert on_device and all(c == kernel for c in on_device)  # every decoding call ran the kernels
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", set())
    want, want_state = _window_steps(q, k, v, groups, factor, **kw)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-6, atol=1e-6)  # slots copied; the prefix, Eq. 5
    ref = window_attention(q.to(F64), k.to(F64), v.to(F64), groups=groups, backend="reference",
                           factor=None if factor is None else factor.to(F64), window=window, sinks=sinks)
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("kernel", [True, False], ids=["oal-swa", "swa"])
def test_fp64_matches_the_dense_reference_to_rounding(on_device, kernel):
    """fp64 inputs keep an fp64 state and fp64 sums in the kernels."""
    q, k, v, groups, factor = make_inputs(1, 3, 1, 13, 12, 7, 3, seed=4, dtype=F64)
    groups, factor = (groups, factor) if kernel else (None, None)
    got, state = _window_steps(q, k, v, groups, factor, window=4, sinks=2, prefill=3, tokens=2)
    ref = window_attention(q, k, v, groups=groups, factor=factor, backend="reference", window=4, sinks=2)
    assert on_device and state.dtype == F64
    assert rel_err(got, ref) < 1e-12


def test_a_callers_state_is_left_alone(on_device):
    """A state the cache does not own is copied, not updated; the cache's own is updated in place."""
    q, k, v, groups, factor = make_inputs(1, 3, 1, 8, 12, 7, 3, seed=2)
    kw = dict(window=3, sinks=1, groups=groups, factor=factor)
    _, state = window_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], output_final_state=True, **kw)
    before = state.clone()
    step = [x[:, :, 7:] for x in (q, k, v)]
    with torch.no_grad():
        _, new = window_attention(*step, initial_state=state, output_final_state=True, **kw)
        assert torch.equal(state, before) and not torch.equal(new, before)
        with checks.cache_owned(state):
            _, own = window_attention(*step, initial_state=state, output_final_state=True, **kw)
    assert own is state and torch.equal(state, new)
    assert len(on_device) == 2


def test_a_nan_in_a_callers_state_is_reported(on_device):
    q, k, v, _, _ = make_inputs(1, 3, 1, 8, 12, 7, 3, seed=2)
    _, state = window_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], output_final_state=True, window=3, sinks=1)
    state[0, 0, 5] = float("nan")
    with torch.no_grad():
        window_attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], initial_state=state, window=3, sinks=1)
    with pytest.raises(ValueError, match="^initial_state: contains NaN"):
        checks.check_errors()


def test_a_gradient_or_a_large_window_runs_the_token_loop(on_device, monkeypatch):
    """The kernels have no backward and hold the window in one program: both cases take the torch loop, whose
    gradients equal the host path's."""
    q, k, v, groups, factor = make_inputs(1, 3, 1, 6, 12, 7, 3, seed=8)
    kw = dict(window=3, sinks=1, groups=groups, factor=factor)
    _, state = window_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], output_final_state=True, **kw)
    step = [x[:, :, 5:].clone().requires_grad_() for x in (q, k, v)]

    def grads():
        out = window_attention(*step, initial_state=state, **kw)
        return torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum(), step)

    got = grads()
    assert on_device == []
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", set())
    for g, w in zip(got, grads(), strict=True):
        torch.testing.assert_close(g, w)
    assert not routes.window_decodes(q[:, :, :1], k[:, :, :1], v[:, :, :1], None, state, 4000, 4)
    assert routes.window_decodes(q[:, :, :1], k[:, :, :1], v[:, :, :1], None, state, 64, 4)


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the torch side of a call; the GPU run measures time")
@pytest.mark.parametrize("kernel", [True, False], ids=["oal-swa", "swa"])
def test_a_decoding_step_is_one_launch_for_swa_and_three_for_oal_swa(on_device, monkeypatch, kernel):
    """No torch operator: the status buffer is shared by `checks.DECODE_SHARED` calls, the scratch by every plan of
    its shape, and the call runs the plan the first one kept (`oal.ops.plans`); nothing per head or per token."""
    from test_ops_deferred import Launches

    from oal.ops.triton import decode, window_decode

    q, k, v, groups, factor = make_inputs(1, 4, 2, 9, 16, 8, 3, seed=7)
    groups, factor = (groups, factor) if kernel else (None, None)
    kw = dict(window=4, sinks=2, groups=groups, factor=factor)
    _, state = window_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], output_final_state=True, **kw)
    step = [t[:, :, 8:].contiguous() for t in (q, k, v)]
    kernels = count_kernels(monkeypatch, window_decode, "_win_step", "_win_out")
    kernels_dec = count_kernels(monkeypatch, decode, "_dec_step")
    with torch.no_grad(), checks.cache_owned(state):
        window_attention(*step, initial_state=state, **kw)  # the cached coefficients, the plan
        kernels.clear()
        kernels_dec.clear()
        with Launches() as mode:
            window_attention(*step, initial_state=state, **kw)
    print("window decoding step: torch operators", mode.ops, "+ triton kernels", len(kernels) + len(kernels_dec))
    assert (len(kernels), len(kernels_dec)) == ((2, 1) if kernel else (1, 0)) and mode.ops == [], mode.ops


@pytest.mark.skipif(DEVICE == "cuda", reason="the tiny models of test_window_models are built on the CPU")
@pytest.mark.parametrize("name", ["oal-swa", "swa"])
def test_a_converted_model_decodes_on_the_kernels(on_device, name):
    """A tiny converted Qwen2 (fp64), prefill then one token at a time far past its window through the generation
    cache: every decoding step runs the kernels on the cache's own state and the logits are one forward's."""
    from test_window_models import _ids, _in_chunks, _model

    model = _model(name)
    ids = _ids(2, 15)
    with torch.no_grad():
        full = model(ids).logits
    got, _ = _in_chunks(model, ids, [3] + [1] * 12)
    checks.check_errors()
    assert len(on_device) == 2 * 12  # two converted layers, twelve steps
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-10)
