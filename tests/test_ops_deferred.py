"""The operator's value checks on the device (`oal.ops.checks`, CUDA by default): no host read on the kernels' path,
the same errors reported late, and few launches per call.

CI has no GPU, so these run the device path on CPU tensors (the CPU is added to `checks.DEFERRED_DEVICES`) with
the Triton kernels under the interpreter. A host read of a tensor value is what stalls a GPU: the tests count
every `item`, `float`, `int`, `bool`, `tolist` and `torch.equal` that oal's own code calls on a tensor.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from test_triton import DEVICE, F64, make_inputs, rel_err  # noqa: E402

from oal.ops import oal_attention  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src" / "oal")
ops = importlib.import_module("oal.ops")
checks = getattr(ops, "checks", None)  # absent before the device checks existed: the sync count then fails


@pytest.fixture
def on_device(monkeypatch):
    """The CPU stands in for a device whose value checks are deferred."""
    if checks is not None:
        monkeypatch.setattr(checks, "DEFERRED_DEVICES", {"cpu", "cuda"})
        monkeypatch.delenv("OAL_SYNC_CHECKS", raising=False)
        yield
        checks.check_errors()  # nothing left pending for the next test
    else:
        yield


class HostReads:
    """Counts the reads of tensor values into Python made by oal's code (the calls that stall a GPU)."""

    NAMES = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        monkeypatch.setattr(torch, "equal", self._wrap(torch.equal, "equal"))

    def _wrap(self, fn, name):
        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(SRC):
                self.calls.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return fn(*args, **kwargs)

        return counted


def _calls(q, k, v, groups, factor):
    """The kernels' paths: a short prefill (parallel), a prefill with its state (chunked), training, decoding."""
    out = oal_attention(q, k, v, groups, factor, backend="triton")
    _, state = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)
    leaf = q.clone().requires_grad_()
    torch.autograd.grad(oal_attention(leaf, k, v, groups, factor, backend="triton").sum(), leaf)
    step = [t[:, :, -1:] for t in (q, k, v)]
    with torch.no_grad(), checks.cache_owned(state) if checks else torch.no_grad():
        oal_attention(*step, groups, factor, backend="triton", initial_state=state, output_final_state=True)
    return out


def test_no_host_reads_on_the_kernels_path(on_device, monkeypatch):
    """After one call per kernel (group ids and the factor are read once and cached), no call reads a value."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 40, 16, 8, 3)
    _calls(q, k, v, groups, factor)  # first calls: the per-kernel reads
    reads = HostReads(monkeypatch)
    _calls(q, k, v, groups, factor)
    assert reads.calls == [], reads.calls


def test_device_path_gives_the_host_path_results(on_device, monkeypatch):
    q, k, v, groups, factor = make_inputs(2, 4, 2, 30, 20, 12, 4, seed=2)
    got = oal_attention(q, k, v, groups, factor, backend="triton")
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", set())
    want = oal_attention(q, k, v, groups, factor, backend="triton")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


BAD = [
    pytest.param(dict(q=float("nan")), "^q: contains NaN or Inf values", id="q-nan"),
    pytest.param(dict(v=float("inf")), "^v: contains NaN or Inf values", id="v-inf"),
    pytest.param(dict(k=1e19), r"^k: values up to .* overflow the torch.float32 state", id="k-overflow"),
]


@pytest.mark.parametrize("bad,message", BAD)
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_bad_values_are_reported_late_with_the_same_message(on_device, bad, message, path):
    """The call itself does not stop; the error names the argument, raised by `check_errors()` or the next call."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 12, 16, 8, 3, seed=3)
    _, state = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)
    inputs = dict(q=q[:, :, -1:].clone(), k=k[:, :, -1:].clone(), v=v[:, :, -1:].clone())
    name, value = next(iter(bad.items()))
    inputs[name][..., 0] = value
    kw = dict(initial_state=state) if path == "decode" else {}
    with torch.no_grad():
        oal_attention(inputs["q"], inputs["k"], inputs["v"], groups, factor, backend="triton", **kw)
    with pytest.raises(ValueError, match=message + r".*found on (cpu|cuda:\d+) after an earlier call"):
        checks.check_errors()
    oal_attention(q, k, v, groups, factor, backend="triton")  # reported once: the next call runs
    with pytest.raises(ValueError, match=message):  # or the next call raises it
        oal_attention(inputs["q"], inputs["k"], inputs["v"], groups, factor, backend="triton", **kw)
        oal_attention(q, k, v, groups, factor, backend="triton")


def test_a_state_given_by_the_caller_is_still_checked(on_device):
    q, k, v, groups, factor = make_inputs(1, 2, 1, 5, 16, 8, 3)
    _, state = oal_attention(q, k, v, groups, factor, backend="triton", output_final_state=True)
    state[0, 0, 0, -1] = -1.0  # a negative token count
    with torch.no_grad():
        oal_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], groups, factor, backend="triton", initial_state=state)
    with pytest.raises(ValueError, match="^initial_state: its denominator column"):
        checks.check_errors()


def test_group_ids_are_read_once_per_tensor(on_device):
    """Ids out of range are refused in the call itself (read once per groups tensor, and again after a write)."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 5, 16, 8, 3)
    oal_attention(q, k, v, groups, factor, backend="triton")
    groups[0, 0] = 7
    with pytest.raises(ValueError, match=r"^groups: ids must lie in \[0, G=3\)"):
        oal_attention(q, k, v, groups, factor, backend="triton")


@pytest.mark.parametrize("q_scale,k_scale", [(1e10, 1.0), (1e15, 1e3)])
@pytest.mark.parametrize("path", ["prefill", "chunked", "chunked with a gradient", "decode"])
def test_huge_scores_are_rescaled_exactly_on_the_device(on_device, q_scale, k_scale, path):
    """The overflow rescaling from device maxima (`checks.device_rescale`): in the parallel kernels, in the chunked
    output kernel (no gradient), through torch (a gradient), and in the decoding kernels."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 20, 16, 8, 3, seed=5)
    q, k = q * q_scale, k * k_scale
    want = oal_attention(q.to(F64), k.to(F64), v.to(F64), groups, factor.to(F64), backend="reference")
    if path == "prefill":
        got = oal_attention(q, k, v, groups, factor, backend="triton")
    elif path.startswith("chunked"):  # the chunked kernels, 16-token chunks: the readout of a state too
        with torch.set_grad_enabled(path.endswith("gradient")):
            leaf = q.clone().requires_grad_(path.endswith("gradient"))
            got = oal_attention(leaf, k, v, groups, factor, backend="triton", chunk_size=16)
    else:
        _, state = oal_attention(q[:, :, :19], k[:, :, :19], v[:, :, :19], groups, factor, backend="triton",
                                 output_final_state=True)
        with torch.no_grad():
            got = torch.cat([oal_attention(q[:, :, :19], k[:, :, :19], v[:, :, :19], groups, factor),
                             oal_attention(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:], groups, factor,
                                           backend="triton", initial_state=state)], dim=2)
    checks.check_errors()
    assert rel_err(got, want) < 1e-4


class Launches(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch operators that launch work on a device (not views, not allocations)."""

    FREE = {"view", "_unsafe_view", "as_strided", "t", "transpose", "unsqueeze", "squeeze", "expand", "detach",
            "alias", "empty", "empty_strided", "new_empty", "slice", "select", "unbind", "permute", "lift_fresh",
            "_to_copy_noop", "split", "unflatten", "reshape"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in self.FREE:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Grid:
    """A jitted kernel whose launches (`kernel[grid](...)`) go through `wrap`."""

    def __init__(self, wrap, kernel):
        self.kernel, self.wrap = kernel, wrap

    def __getitem__(self, grid):
        return self.wrap(self.kernel[grid])


def count_kernels(monkeypatch, module, *names) -> list:
    """Replace the jitted kernels `names` of `module` by counted ones; returns the list each launch appends to (what
    the interpreter does to run them is not counted as torch operators)."""
    kernels = []

    def counted(fn):
        def run(*args, **kwargs):
            kernels.append(fn)
            with torch.utils._python_dispatch._disable_current_modes():
                return fn(*args, **kwargs)
        return run

    for name in names:
        monkeypatch.setattr(module, name, _Grid(counted, getattr(module, name)))
    return kernels


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the torch side of a call; the GPU run measures time")
def test_a_decoding_step_is_a_few_launches(on_device, monkeypatch):
    """A decoding step on the cache's state: two kernels and no torch operator. The coefficients are cached, the
    state is updated in place, the status buffer is shared by `checks.DECODE_SHARED` calls (one zeroing launch and,
    on a GPU, one copy to the host for all of them) and the call runs the plan the first one kept
    (`oal.ops.plans`)."""
    from oal.ops.triton import decode

    q, k, v, groups, factor = make_inputs(1, 4, 2, 9, 16, 8, 3, seed=7)
    _, state = oal_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], groups, factor, backend="triton",
                             output_final_state=True)
    step = [t[:, :, 8:].contiguous() for t in (q, k, v)]  # one token, laid out as a model's projections give it
    kernels = count_kernels(monkeypatch, decode, "_dec_step", "_dec_out")
    with torch.no_grad(), checks.cache_owned(state):
        oal_attention(*step, groups, factor, backend="triton", initial_state=state)  # the coefficients, the plan
        kernels.clear()
        with Launches() as mode:
            oal_attention(*step, groups, factor, backend="triton", initial_state=state)
    print("decoding step: torch operators", mode.ops, "+ triton kernels", len(kernels))
    assert mode.ops == [] and len(kernels) == 2


@pytest.mark.parametrize("q_scale,k_scale", [(1.0, 1.0), (1e10, 1.0), (1e15, 1e3), (1e-30, 1e30)])
def test_the_guard_kernel_matches_its_reference(q_scale, k_scale):
    """`triton.guard` (one launch: maxima, non-finite flags, overflow multipliers) against torch and
    `checks.device_rescale`; a NaN is flagged, not taken for a maximum."""
    from oal.ops.triton import guard

    q, k, v, groups, factor = make_inputs(1, 2, 1, 5000, 16, 8, 3, seed=11)  # q spans several blocks
    q, k = q * q_scale, k * k_scale
    v[0, 0, 7, 3] = float("nan")
    status = torch.zeros(guard.SLOTS, device=q.device)
    guard.launch(status, [q, k, v, factor], first=0, scale=0.25, d=16,
                 s_limit=checks.rescale_bound(torch.float32)[1], mults=True)
    qmax, kmax = q.abs().amax(), k.abs().amax()
    assert status[0] == qmax and status[2] == kmax and status[6] == factor.abs().amax()
    assert status[1] == status[3] == status[7] == 0 and status[5] == 1
    want = checks.device_rescale(qmax, kmax, 0.25, 16, torch.float32)
    torch.testing.assert_close(status[guard.MULT : guard.MULT + 6], want, rtol=1e-6, atol=0)


def test_a_stage_does_not_outlive_a_late_error(on_device, tmp_path):
    """A stage whose last operator call had bad input fails, and is not recorded as done (pipeline.base.stage drains
    the device checks before it marks the stage), so no late error can let a number be published."""
    from rich.console import Console

    from oal.launch import ranks
    from oal.pipeline.base import StagedRun
    from oal.rundir.stages import StageLog

    run = object.__new__(StagedRun)  # the stage mechanism alone, without a model
    run.ranks, run.log, run.console = ranks("cpu"), StageLog(tmp_path), Console(quiet=True)
    run.keys, run.ran, run.skipped, run.stop_after = {}, [], [], None
    q, k, v, groups, factor = make_inputs(1, 2, 1, 12, 16, 8, 3, seed=3)
    q[..., 0, 0] = float("nan")

    def fn():
        (tmp_path / "out.txt").write_text("a number computed from NaN")
        oal_attention(q, k, v, groups, factor, backend="triton")  # reports late on the device path

    with pytest.raises(ValueError, match="q: contains NaN"):
        run.stage("probe", {}, ["out.txt"], fn)
    assert not run.log.done("probe", run.keys["probe"]) and run.ran == []
    assert run.stage("clean", {}, ["out.txt"], lambda: oal_attention(q.nan_to_num(), k, v, groups, factor,
                                                                      backend="triton"))


# ------------------------------------------------------------------------------ sliding windows: the decode step

WINDOW = dict(window=5, sinks=2)


def _window_steps(q, k, v, groups, factor, *, prefill: int, owned: bool = True, tokens: int = 1, **window):
    """`window_attention` over q[:prefill] (banded, with its state), then recurrent calls of `tokens` new tokens each
    on the state (the generation cache's own when `owned`); returns (outputs of every token, final state).
    `window`: window and sinks, WINDOW's by default."""
    from oal.ops.window import window_attention

    kw = dict(WINDOW, groups=groups, factor=factor) | window
    out, state = window_attention(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], output_final_state=True,
                                  **kw)
    outs = [out]
    with torch.no_grad():
        for t in range(prefill, q.shape[2], tokens):
            step = [x[:, :, t : t + tokens] for x in (q, k, v)]
            with checks.cache_owned(state) if owned else torch.no_grad():
                out, state = window_attention(*step, initial_state=state, output_final_state=True, **kw)
            outs.append(out)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("kernel", [True, False], ids=["oal-swa", "swa"])
def test_a_window_decode_step_reads_no_value(on_device, monkeypatch, kernel):
    """The oal-swa / swa decode step on a deferred device: its checks on the device, no host read."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 14, 16, 8, 3, seed=6)
    groups, factor = (groups, factor) if kernel else (None, None)
    _window_steps(q, k, v, groups, factor, prefill=10)  # first calls: group ids and coefficients, once per tensor
    reads = HostReads(monkeypatch)
    _, state = _window_steps(q, k, v, groups, factor, prefill=10)
    prefill_reads = len(reads.calls)  # the banded prefill keeps the host checks
    reads.calls.clear()
    from oal.ops.window import window_attention

    with torch.no_grad(), checks.cache_owned(state):
        window_attention(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], groups=groups, factor=factor,
                         initial_state=state, **WINDOW)
    assert prefill_reads > 0 and reads.calls == [], reads.calls


@pytest.mark.parametrize("q_scale,k_scale", [(1.0, 1.0), (1e10, 1.0), (1e15, 1e3)])
@pytest.mark.parametrize("owned", [True, False], ids=["cache-state", "caller-state"])
def test_the_window_decode_step_on_the_device_gives_the_host_results(on_device, monkeypatch, q_scale, k_scale, owned):
    """Outputs and state of the device path equal the host path's, including scores large enough to rescale
    (the kernel evaluated as kappa / lam, Eq. 7); both against the fp64 dense reference."""
    from oal.ops.window import window_attention

    q, k, v, groups, factor = make_inputs(2, 4, 2, 13, 16, 8, 3, seed=7)
    q, k = q * q_scale, k * k_scale
    got, got_state = _window_steps(q, k, v, groups, factor, prefill=9, owned=owned)
    checks.check_errors()
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", set())
    want, want_state = _window_steps(q, k, v, groups, factor, prefill=9, owned=owned)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    slots = (WINDOW["window"] + WINDOW["sinks"]) * (q.shape[-1] + v.shape[-1] + 1)
    assert torch.equal(got_state[..., :slots], want_state[..., :slots])  # keys and values, copied
    assert rel_err(got_state[..., slots:], want_state[..., slots:]) < 1e-6  # OAL's prefix: sums in another order
    ref = window_attention(q.to(F64), k.to(F64), v.to(F64), groups=groups, factor=factor.to(F64), backend="reference",
                           **WINDOW)
    assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("bad,message", [
    pytest.param(dict(q=float("nan")), "^q: contains NaN or Inf values", id="q-nan"),
    pytest.param(dict(v=float("inf")), "^v: contains NaN or Inf values", id="v-inf"),
    pytest.param(dict(k=1e19), r"^k: values up to .* overflow the torch.float32 state", id="k-overflow"),
])
def test_a_bad_window_decode_input_is_reported_late_with_the_host_message(on_device, bad, message):
    from oal.ops.window import window_attention

    q, k, v, groups, factor = make_inputs(1, 2, 1, 12, 16, 8, 3, seed=3)
    kw = dict(WINDOW, groups=groups, factor=factor)
    _, state = window_attention(q, k, v, output_final_state=True, **kw)
    inputs = dict(q=q[:, :, -1:].clone(), k=k[:, :, -1:].clone(), v=v[:, :, -1:].clone())
    name, value = next(iter(bad.items()))
    inputs[name][..., 0] = value
    with torch.no_grad():
        window_attention(inputs["q"], inputs["k"], inputs["v"], initial_state=state, **kw)
    with pytest.raises(ValueError, match=message + r".*found on (cpu|cuda:\d+) after an earlier call"):
        checks.check_errors()
    monkeypatch_free = pytest.MonkeyPatch()
    with monkeypatch_free.context() as m:  # the host path says the same, in the call itself
        m.setattr(checks, "DEFERRED_DEVICES", set())
        with pytest.raises(ValueError, match=message), torch.no_grad():
            window_attention(inputs["q"], inputs["k"], inputs["v"], initial_state=state, **kw)


def test_a_plain_window_refuses_no_large_keys_on_the_device(on_device):
    """swa keeps no state of the keys' products, so keys the OAL state could not hold are fine there, as on the
    host path."""
    from oal.ops.window import window_attention

    q, k, v, _, _ = make_inputs(1, 2, 1, 12, 16, 8, 3, seed=3)
    _, state = window_attention(q, k, v, output_final_state=True, **WINDOW)
    with torch.no_grad():
        out = window_attention(q[:, :, -1:], k[:, :, -1:] * 1e17, v[:, :, -1:], initial_state=state, **WINDOW)
    checks.check_errors()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("route", ["parallel", "chunked"])
def test_the_forward_kernels_report_a_vanished_kernel_late(on_device, route):
    """The forward kernels check their own output into the call's status (no output pass of the guard): eps = 0
    with L = 0 makes every output 0/0, reported with the host path's message."""
    q, k, v, groups, factor = make_inputs(1, 2, 1, 20, 16, 8, 3, seed=9)
    oal_attention(q, k, v, groups, torch.zeros_like(factor), eps=0.0, backend="triton",
                  output_final_state=route == "chunked")
    late = r".*found on (cpu|cuda:\d+) after an earlier call"
    with pytest.raises(ValueError, match=r"^eps: with eps=0 the kernel vanished" + late):
        checks.check_errors()


def _rel(got, want):
    got, want = got.detach().to(F64), want.detach().to(F64)
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("q_scale,k_scale", [(1e10, 1.0), (1e15, 1e3)])
def test_the_parallel_kernels_rescale_exactly_with_gradients(on_device, q_scale, k_scale):
    """Scores that would overflow: the parallel kernels multiply z by the guard's 1 / s_max themselves (q, L[0, m],
    eps by its square: kappa / s_max^2, Eq. 7), so the output and every gradient match fp64 (without a floor: dq is
    about 1 / q_scale here)."""
    from oal.ops.triton import parallel

    calls = []
    monkeypatch = pytest.MonkeyPatch()
    fn = parallel.attention
    monkeypatch.setattr(parallel, "attention", lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    try:
        q, k, v, groups, factor = make_inputs(1, 2, 1, 30, 16, 8, 3, seed=6)
        q, k = q * q_scale, k * k_scale
        got, want = [], []
        for dtype, backend, out in ((torch.float32, "triton", got), (F64, "reference", want)):
            leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, factor)]
            o = oal_attention(*leaves[:3], groups, leaves[3], backend=backend)
            proj = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(o.device)
            out += [o, *torch.autograd.grad((o.to(F64) * proj).sum(), leaves)]
        checks.check_errors()
    finally:
        monkeypatch.undo()
    assert calls == [1], "the fresh sequence did not run the parallel kernels"
    errs = {name: _rel(x, y) for name, x, y in zip(("out", "dq", "dk", "dv", "dfactor"), got, want, strict=True)}
    assert all(err < 1e-4 for err in errs.values()), errs


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the torch side of a call; the GPU run measures time")
def test_a_long_prefill_is_a_few_launches(on_device, monkeypatch):
    """A fresh sequence on the chunked kernels, no gradient: the guard, the state scan and the output kernel, which
    applies the overflow multipliers itself (no torch operator rescales q and the coefficients), and no packed
    final state when none is asked for."""
    from oal.ops.triton import function, guard, routes
    from oal.ops.triton import kernels as K

    monkeypatch.setattr(routes, "PARALLEL_MAX", 16)
    q, k, v, groups, factor = make_inputs(1, 4, 2, 50, 16, 8, 3, seed=8)
    with torch.no_grad():
        oal_attention(q, k, v, groups, factor, backend="triton")  # the coefficients, cached per kernel
        kernels = count_kernels(monkeypatch, guard, "_guard")
        monkeypatch.setattr(function, "interpreted", lambda: True)  # it reads the type of _fwd_out, wrapped below
        launched = count_kernels(monkeypatch, K, "_state_scan", "_fwd_out")
        with Launches() as mode:
            oal_attention(q, k, v, groups, factor, backend="triton")
    print("long prefill: torch operators", mode.ops, "+ triton kernels", len(kernels) + len(launched))
    assert mode.ops == ["zeros.default"] and len(kernels) == 1 and len(launched) == 2


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the torch side of a call; the GPU run measures time")
def test_a_short_prefill_is_a_few_launches(on_device, monkeypatch):
    """A fresh sequence on the parallel kernels, no gradient: the guard (the inputs' checks and the overflow
    multipliers) and the forward kernel, which checks its own output and applies the rescaling itself."""
    from oal.ops.triton import guard, parallel

    q, k, v, groups, factor = make_inputs(1, 4, 2, 50, 16, 8, 3, seed=8)
    with torch.no_grad():
        oal_attention(q, k, v, groups, factor, backend="triton")  # the coefficients, cached per kernel
        kernels = count_kernels(monkeypatch, guard, "_guard")
        launched = count_kernels(monkeypatch, parallel, "_par_fwd")
        with Launches() as mode:
            oal_attention(q, k, v, groups, factor, backend="triton")
    print("short prefill: torch operators", mode.ops, "+ triton kernels", len(kernels) + len(launched))
    assert mode.ops == ["zeros.default"] and len(kernels) == 1 and len(launched) == 1


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's host path (CUDA defers its checks)")
def test_the_host_path_reads_the_kernel_once_per_version(monkeypatch):
    """The CPU's checks (on the host) of a decoding call on the cache's state read q, k, v and the output (max |x|,
    NaN), not the group ids or the factor again: those are read once per tensor and version (`groups_checked`,
    `factor_checked`); the coefficients' cache compares them by value (`kernel.cached_coefficients`)."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 9, 16, 8, 3, seed=7)
    _, state = oal_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], groups, factor, output_final_state=True)
    step = [t[:, :, 8:].contiguous() for t in (q, k, v)]
    with torch.no_grad(), checks.cache_owned(state):
        oal_attention(*step, groups, factor, initial_state=state)
        reads = HostReads(monkeypatch)
        oal_attention(*step, groups, factor, initial_state=state)
    values = [c for c in reads.calls if c.startswith("__float__")]
    assert len(values) == 8 and len(reads.calls) == 10, reads.calls  # 4 tensors x (min, max); 2 comparisons
    groups[0, 0] = 7  # an in-place write: read again
    with torch.no_grad(), checks.cache_owned(state), pytest.raises(ValueError, match=r"^groups: ids must lie"):
        oal_attention(*step, groups, factor, initial_state=state)
