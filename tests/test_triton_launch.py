"""Plans' kernels launched through the compiled kernel's own launcher (`oal.ops.triton.launch`, opt-in).

CI has no GPU and Triton's interpreter compiles nothing, so a stand-in of Triton's `CompiledKernel` (same class
name) wraps each interpreted kernel: its launcher receives every parameter in order, as Triton's does, and runs the
interpreted kernel by parameter name. A wrong order of the parameters, or a constexpr missing, gives wrong
results or an error. The real launcher is run by scripts/gpu_perf.sh on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from test_ops_deferred import on_device  # noqa: E402, F401  (the fixture)
from test_ops_plans import METHODS, _decode  # noqa: E402
from test_triton import DEVICE, F64, make_inputs, rel_err  # noqa: E402

from oal.ops import oal_attention, plans  # noqa: E402
from oal.ops.triton import decode, guard, launch, parallel, window_decode  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="the stand-in of the compiled kernel wraps the interpreter")


class CompiledKernel:
    """Triton's compiled kernel as `launch.Launch` uses it: `compiled[grid](*every_parameter, stream=...)`."""

    def __init__(self, jit, log):
        self.jit, self.log = jit, log

    def __getitem__(self, grid):
        def runner(*params, stream=None):
            assert len(params) == len(self.jit.arg_names), "every parameter, constexprs included"
            self.log.append(("direct", stream))
            # as Triton 3.6's CompiledKernel runs it: the three grid sizes read by index, no padding of its own
            self.jit[grid[0], grid[1], grid[2]](**dict(zip(self.jit.arg_names, params, strict=True)))

        return runner


class Jit:
    """An interpreted kernel whose launches return a `CompiledKernel` stand-in and are logged."""

    def __init__(self, jit, log):
        self.jit, self.log, self.arg_names = jit, log, jit.arg_names

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("triton", None))
            meta.pop("num_warps", None)  # a launch option, not a parameter
            self.jit[grid](*args, **meta)
            return CompiledKernel(self.jit, self.log)

        return run


class Tuned(Jit):
    """An autotuned kernel: each launch runs the config its autotuner picked (`best_config`), and the grid is a
    function of that config's constexprs, as `triton.autotune` does."""

    def __init__(self, jit, log, config: dict):
        super().__init__(jit, log)
        self.best_config = SimpleNamespace(kwargs=config)

    def __getitem__(self, grid):
        def run(*args, **meta):
            meta = {**meta, **self.best_config.kwargs}
            return Jit.__getitem__(self, grid(meta))(*args, **meta)

        return run


KERNELS = {decode: ("_dec_step", "_dec_out"), window_decode: ("_win_step", "_win_out"), guard: ("_guard",),
           parallel: ("_par_fwd",)}


@pytest.fixture
def compiled(monkeypatch):
    """The decoding kernels wrapped (see the module docstring), the stream stubbed; returns the launch log."""
    log = []
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, Jit(getattr(module, name), log))
    monkeypatch.setattr(launch, "_stream", lambda: 7)
    monkeypatch.delenv(launch.ENV, raising=False)  # the tests set it where they want it
    return log


@pytest.mark.parametrize("dv", [11, 8])
@pytest.mark.parametrize("method", METHODS)
def test_direct_launches_give_the_planned_results_bit_for_bit(on_device, compiled, monkeypatch, method, dv):  # noqa: F811
    """dv 8: oal-swa's prefix state starts 600 bytes into the state (2 sinks + 4 window slots of 25 floats), not
    16-byte aligned, so its `_dec_step` launches through Triton every call; dv 11: every launch after the first
    call's is direct."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 14, 16, dv, 3, seed=3)
    want, want_state = _decode(method, q, k, v, groups, factor, owned=True)
    assert {how for how, _ in compiled} == {"triton"}, "without the variable every launch goes through Triton"
    compiled.clear()
    monkeypatch.setenv(launch.ENV, "1")
    got, state = _decode(method, q, k, v, groups, factor, owned=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    direct = [stream for how, stream in compiled if how == "direct"]
    assert direct and set(direct) == {7}, compiled  # the later calls, on the first launch's stream
    first_call = {"oal": 2, "oal-swa": 3, "swa": 1}[method]
    misaligned = 1 if method == "oal-swa" and dv == 8 else 0
    calls = 8  # tokens 6 .. 13, one per call
    prefill = 1 if method == "oal" else 0  # oal's 6-token prefill: its guard (the windows' prefill checks on the host)
    assert len(compiled) - len(direct) == prefill + first_call + (calls - 1) * misaligned, compiled


class Tensor16(torch.Tensor):
    """A tensor whose address reads as misaligned (Triton specialises pointers on 16-byte alignment)."""

    def data_ptr(self):
        return super().data_ptr() + 4


def _one_launch(monkeypatch):
    """`_dec_out` (wrapped by the fixture) at one launch site, with the variable set."""
    monkeypatch.setenv(launch.ENV, "1")
    part, partn, status = torch.rand(2, 3, 16), torch.rand(2, 3) + 1, torch.zeros(22)
    site = launch.Launch((3,), dict(NBLK=2, BV=16))
    return lambda fn, out: site(fn, part, partn, out, status, 3, 8), site


def test_a_misaligned_tensor_launches_through_triton(compiled, monkeypatch):
    call, _ = _one_launch(monkeypatch)
    for out in (torch.empty(3, 8), torch.empty(3, 8), torch.empty(3, 8).as_subclass(Tensor16), torch.empty(3, 8)):
        call(decode._dec_out, out)
    assert [how for how, _ in compiled] == ["triton", "direct", "triton", "direct"]


def test_the_launcher_kept_is_from_an_aligned_launch(compiled, monkeypatch):
    """A launch with a misaligned tensor returns a kernel specialised for that alignment: not kept. The next aligned
    launch through Triton returns the aligned specialisation, which is kept."""
    call, site = _one_launch(monkeypatch)
    for out in (torch.empty(3, 8).as_subclass(Tensor16), torch.empty(3, 8), torch.empty(3, 8)):
        call(decode._dec_out, out)
    assert [how for how, _ in compiled] == ["triton", "triton", "direct"] and site.runner is not None


def test_another_kernel_or_an_unknown_parameter_launches_through_triton(compiled, monkeypatch):
    call, _ = _one_launch(monkeypatch)
    call(decode._dec_out, torch.empty(3, 8))
    call(Jit(decode._dec_out.jit, compiled), torch.empty(3, 8))  # e.g. a test's replacement of the kernel
    assert [how for how, _ in compiled] == ["triton", "triton"]
    compiled.clear()
    call, site = _one_launch(monkeypatch)
    extra = Jit(decode._dec_out.jit, compiled)
    extra.arg_names = [*extra.arg_names, "LEFT_TO_ITS_DEFAULT"]  # a parameter the site does not name
    for _ in range(2):
        call(extra, torch.empty(3, 8))
    assert [how for how, _ in compiled] == ["triton", "triton"] and site.runner is None


def test_a_launcher_that_raises_is_dropped_with_a_warning(compiled, monkeypatch, caplog):
    """A launcher that refuses its arguments (another Triton release's) raises before launching: the call launches
    through Triton instead, the site keeps no launcher again, and the log says so once."""
    call, site = _one_launch(monkeypatch)
    call(decode._dec_out, torch.empty(3, 8))

    def refuses(*args, stream=None):
        raise TypeError("function takes exactly 30 arguments")

    site.runner = refuses
    with caplog.at_level("WARNING", logger="oal"):
        for _ in range(3):
            call(decode._dec_out, torch.empty(3, 8))
    assert [how for how, _ in compiled] == ["triton"] * 4 and site.runner is None and site.failed
    assert sum("direct launch of" in r.message for r in caplog.records) == 1


def _prefills(q, k, v, groups, factor, calls=4):
    with torch.no_grad():
        outs = [oal_attention(q, k, v, groups, factor, backend="triton") for _ in range(calls)]
    return torch.stack(outs)


@pytest.mark.parametrize("dv", [11, 8])
def test_a_prefill_plans_launches_are_direct_bit_for_bit(on_device, compiled, monkeypatch, dv):  # noqa: F811
    """A fresh sequence's plan (`triton.prefill`): the guard and the forward kernel launch directly after the first
    call, with the same outputs as launches through Triton."""
    q, k, v, groups, factor = make_inputs(1, 4, 2, 19, 16, dv, 3, seed=4)
    want = _prefills(q, k, v, groups, factor)
    assert {how for how, _ in compiled} == {"triton"}
    compiled.clear()
    monkeypatch.setenv(launch.ENV, "1")
    got = _prefills(q.clone(), k.clone(), v.clone(), groups, factor.clone())  # a new kernel tensor: a new plan
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the full path (the first call at a length), the plan's first launches, then direct launches
    assert [how for how, _ in compiled] == ["triton"] * 4 + ["direct"] * 4, compiled


def test_an_autotuned_kernel_is_kept_with_its_configs_tiles(on_device, compiled, monkeypatch):  # noqa: F811
    """The prefill's `_par_fwd` is autotuned on a GPU: the launcher kept runs the autotuner's pick (its BM, BN among
    the parameters, the grid worked out from BM), with the outputs of launches through the autotuner."""
    standin = Tuned(parallel._par_fwd.jit, compiled, dict(BM=32, BN=16))
    monkeypatch.setattr(parallel, "tuned", lambda kernel, half, big: standin)
    site = parallel._site

    def tuned_site(device, grid, consts):  # the GPU's branch, with the interpreter's loops
        is_tuned, grid, meta = site(torch.device("cuda"), grid, consts)
        return is_tuned, grid, dict(meta, LOOP_FOR=False)

    monkeypatch.setattr(parallel, "_site", tuned_site)
    q, k, v, groups, factor = make_inputs(1, 4, 2, 45, 16, 8, 3, seed=5)
    want = _prefills(q, k, v, groups, factor, calls=2)
    compiled.clear()
    monkeypatch.setenv(launch.ENV, "1")
    factor = factor.clone()
    got = _prefills(q, k, v, groups, factor, calls=3)
    torch.testing.assert_close(got, torch.cat([want, want[:1]]), rtol=0, atol=0)
    assert [how for how, _ in compiled] == ["triton"] * 4 + ["direct"] * 2, compiled
    runner = plans._FRESH[factor][2].forward.launch
    assert runner.fn is standin and runner.tail[-2:] == (32, 16)  # BM, BN: the last parameters
    want64 = oal_attention(*(t.to(F64) for t in (q, k, v)), groups, factor.to(F64), backend="reference")
    assert rel_err(got[-1], want64) < 1e-5  # every row written: the grid has the config's 2 query blocks
