"""A plan's kernel launched through the compiled kernel's own launcher (opt-in: OAL_TRITON_DIRECT_LAUNCH=1).

`kernel[grid](...)` binds and specialises every argument, builds a cache key and checks the kernel's globals on
every call: about 12 µs of Python per launch for a kernel of 19 arguments (tritonbench's launch-latency study,
2026, on a GB200), against about 3.4 µs for the compiled kernel's launcher. A decoding plan launches the same
kernel with the same scalars on every token, so that bookkeeping is repeated work, and at batch 1 on a GPU host
time is the step's time (docs/design/gpu-kernels.md).

`Launch` keeps the `CompiledKernel` that its first launch through Triton with every tensor aligned returns, and
then calls its launcher itself (`compiled[grid](*args, stream=...)`, CompiledKernel's own entry point, with every
parameter in order, constexprs included, as `JITFunction.run` passes them), while what Triton specialised the
kernel on still holds:

- the scalars are the plan's, fixed by its signature (the caller's contract: one `Launch` per plan);
- every tensor is 16-byte aligned, as at the launch the compiled kernel came from (Triton specialises pointers on
  that alignment: a launch with a misaligned tensor goes through Triton, and its kernel is not kept);
- the stream is that launch's: a plan is kept per stream (`oal.ops.plans.signature` holds it).

An autotuned kernel (`triton.autotune`, e.g. the prefill's `parallel._par_fwd`) is kept the same way: the config
its autotuner ran for the launch (`best_config`; the plan's signature fixes the autotuner's key, so it is the
config every later launch would run) supplies the tile constexprs, and a grid given as a function of them is
worked out once from it.

Under Triton's interpreter (no compiled kernel) and without the variable, every launch goes through Triton. The
variable is read when a launch site is made (with its plan): setting it later affects the plans made later. A
launcher that raises (a Triton release whose launcher takes other arguments: it checks them before launching) is
dropped with a warning, once, and the site launches through Triton from then on.
Not yet measured on a GPU, so off by default: `scripts/gpu_perf.sh` times it (`benchmarks.decode_host`).
"""

from __future__ import annotations

import logging

import torch

from oal.errors import env_flag

ENV = "OAL_TRITON_DIRECT_LAUNCH"
log = logging.getLogger("oal")
_WARNED: set[str] = set()


def enabled() -> bool:
    return env_flag(ENV, False)


def _stream():
    """The stream Triton's own launch uses: the current device's current stream."""
    return torch.cuda.current_stream().cuda_stream


class Launch:
    """One launch site of a plan: `launch(fn, *args)` runs `fn[grid](*args, **meta)`, where `args` are the kernel's
    leading parameters (tensors, whose addresses may change between calls, and the plan's fixed scalars) and
    `meta` names the others and the launch options. `grid`: a tuple, or for an autotuned `fn` a function of the
    chosen config's constexprs (as Triton takes it). `fn` is passed on each call (the module's kernel as it is
    then); the launcher kept is for the kernel it came from."""

    def __init__(self, grid, meta: dict):
        self.grid, self.meta = grid, meta
        self.fn = None  # the kernel whose launcher is kept
        self.runner = None  # the compiled kernel's launcher, after a first launch that allows it
        self.tail: tuple = ()  # the parameters after `args`, in order (constexprs included)
        self.tensors: tuple = ()  # positions of the tensors among `args`
        self.stream = None
        self.failed = not enabled()  # a kept launcher raised, or not asked for: this site launches through Triton

    def __call__(self, fn, *args) -> None:
        if self.runner is not None and fn is self.fn and self._same(args):
            try:
                self.runner(*args, *self.tail, stream=self.stream)
                return
            except Exception as err:  # the launcher checks its arguments before it launches: launch through Triton
                self._drop(err)
        compiled = fn[self.grid](*args, **self.meta)
        if self.runner is None and not self.failed:
            self._keep(fn, compiled, args)

    def _drop(self, err: Exception) -> None:
        name = getattr(self.fn, "__name__", str(self.fn))
        if name not in _WARNED:
            _WARNED.add(name)
            log.warning("%s=1: the direct launch of %s failed (%s); launching it through Triton", ENV, name, err)
        self.runner, self.failed = None, True

    def _same(self, args) -> bool:
        """Every tensor 16-byte aligned (the scalars and the stream are the plan's)."""
        for i in self.tensors:
            if args[i].data_ptr() & 15:
                return False
        return True

    def _keep(self, fn, compiled, args) -> None:
        """Keep `compiled`'s launcher when the launch it came from allows it (see the module docstring)."""
        if type(compiled).__name__ != "CompiledKernel":
            return  # the interpreter returns nothing
        names = getattr(fn, "arg_names", None)
        config = getattr(fn, "best_config", None)  # an autotuner's pick for this launch
        meta = {**self.meta, **config.kwargs} if config is not None else self.meta
        if names is None or any(name not in meta for name in names[len(args):]):
            return  # a parameter left to its default: not known here
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if any(args[i].data_ptr() & 15 for i in tensors):
            return  # specialised for this call's alignment only
        grid = tuple(self.grid(meta) if callable(self.grid) else self.grid)
        self.tail = tuple(meta[name] for name in names[len(args):])
        self.tensors, self.stream = tensors, _stream()
        # the compiled kernel's launcher reads grid[0], grid[1] and grid[2] (Triton 3.6); only `kernel[grid]` pads
        # a shorter grid with 1s
        self.fn, self.runner = fn, compiled[grid + (1,) * (3 - len(grid))]
