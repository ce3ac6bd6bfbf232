"""A second device on the CPU that refuses to mix with the CPU, as CUDA does (design.md "Contract: devices").

CI has no GPU, so a tensor left on the CPU beside a model on CUDA is found only on a GPU machine. Inside
`fake_device()`, `FAKE` (`torch.device("cpu", 1)`) behaves like such a device:

- a `FakeDeviceTensor` wraps a real CPU tensor (`.elem`) and reports `device == FAKE`; every op on it runs on the
  CPU and its tensor results are wrapped again;
- an op that meets a fake tensor and a plain CPU tensor of dim > 0 raises CUDA's error ("Expected all tensors to be
  on the same device ..."); 0-dim CPU tensors mix, and so do the ops CUDA lets cross devices (`copy_`, indexing
  with CPU indices);
- `.to(FAKE)`, `model.to(FAKE)` and factories with `device=FAKE` (`torch.zeros`, `torch.tensor`, `torch.arange`,
  `torch.device(FAKE)` as a context) make fake tensors; `.cpu()` / `.to("cpu")` give the plain tensor back;
- as on CUDA, `.numpy()` of a fake tensor raises, `.item()`, `float()` and `.tolist()` work, a CPU generator refuses
  to draw on the fake device, and safetensors copies a fake tensor to the CPU before writing it.

Why `cpu:1` and not a renamed PrivateUse1 backend: the latter has no device guard and aborts the process on the
first linear layer. The price: `device.type == "cpu"`, so code that branches on the CPU (the fused C++ kernel,
which reads `data_ptr()`) takes its CPU path: `fake_device()` sets OAL_CPU_KERNEL=0. Every op on a fake tensor is
dispatched in Python (tens of microseconds): keep models and budgets tiny.
"""

from __future__ import annotations

import contextlib
import os

import safetensors.torch
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FAKE", "FakeDeviceTensor", "fake_device", "is_fake"]

FAKE = torch.device("cpu", 1)
_CPU = torch.device("cpu")
aten = torch.ops.aten

# ops that CUDA lets take CPU tensors of any size beside device tensors: copies between devices, and indexing
# with CPU index tensors (moved to the indexed tensor's device by the op itself)
_CROSS_DEVICE = {aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default,
                 aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                 aten._index_put_impl_.default, aten._unsafe_index.Tensor, aten._unsafe_index_put.default}


def is_fake(t) -> bool:
    """True for a tensor on the fake device."""
    return isinstance(t, FakeDeviceTensor)


def _is_fake_device(device) -> bool:
    return device is not None and torch.device(device) == FAKE


# aten arguments are tensors, scalars and (nested) lists of them: walked by hand, pytree costs more than the op
def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a, {})


def _map(fn, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, v) for v in x)
    return x


def _unwrap(t):
    return t.elem if isinstance(t, FakeDeviceTensor) else t


class FakeDeviceTensor(torch.Tensor):
    """A CPU tensor (`elem`) that says it lives on `FAKE` and refuses to meet plain CPU tensors."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=FAKE, requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self, *, tensor_contents=None):
        return f"FakeDeviceTensor({self.elem!r})"

    # what the host may do with a CUDA tensor
    def tolist(self):
        return self.elem.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(f"can't convert {FAKE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    def untyped_storage(self):  # a device tensor has a storage (identity and size), just not one the host reads
        return self.elem.untyped_storage()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = list(_tensors(args, kwargs))
        if func not in _CROSS_DEVICE:
            for t in given:
                if not isinstance(t, FakeDeviceTensor) and t.dim() > 0:
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                       f"devices, {FAKE} (fake) and cpu! (in {func}: a CPU tensor of shape "
                                       f"{tuple(t.shape)} met tensors on {FAKE})")
        target = kwargs.get("device")
        if target is not None:
            if func is aten._to_copy.default and not _is_fake_device(target):  # .cpu(), .to("cpu"): plain
                return func(*_map(_unwrap, args), **{k: _map(_unwrap, v) for k, v in kwargs.items()})
            if _is_fake_device(target):
                kwargs = {**kwargs, "device": _CPU}
        out = func(*_map(_unwrap, args), **{k: _map(_unwrap, v) for k, v in kwargs.items()})
        # in-place ops and out= return an argument: give back its wrapper, not a second one around the same tensor
        wrappers = {id(t.elem): t for t in given if isinstance(t, FakeDeviceTensor)}
        return _map(lambda t: wrappers.get(id(t)) if id(t) in wrappers else FakeDeviceTensor(t), out)


def _check_generator(func, kwargs) -> None:
    gen = kwargs.get("generator")
    if gen is not None and torch.device(gen.device) != FAKE:
        raise RuntimeError(f"Expected a '{FAKE}' device type for generator but found '{gen.device}' (in {func}: a "
                           "CPU generator drawing on the fake device, which CUDA refuses)")


class _Factories(TorchDispatchMode):
    """aten ops with `device=FAKE` and no fake input (factories, `_to_copy` of a CPU tensor to the fake device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_fake_device(kwargs.get("device")) and not any(is_fake(t) for t in _tensors(args, {})):
            _check_generator(func, kwargs)
            return _map(lambda t: t if is_fake(t) else FakeDeviceTensor(t),
                        func(*args, **{**kwargs, "device": _CPU}))
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


class _FromData(TorchFunctionMode):
    """`torch.tensor`-like factories build from Python data on the CPU without an aten op that names the device (the
    CPU ignores the index of `cpu:1`): their result goes to the fake device when `device=FAKE` was asked for, also
    by a `torch.device(FAKE)` context (that mode sits above this one and passes the device on). A mode rather than
    patched functions: torch caches the set of factory functions it knows the first time it needs it, and
    transformers reads the device context through `torch.tensor([]).device`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_DATA and _is_fake_device(kwargs.get("device")) and not is_fake(out):
            return out.to(FAKE)
        return out


def _safetensors_to_ndarray(original):
    """safetensors copies a device tensor to the CPU before reading its bytes (`device.type != "cpu"`); the fake
    device's type is "cpu", so it is told here."""

    def to_ndarray(tensor):
        return original(tensor.cpu() if is_fake(tensor) else tensor)

    return to_ndarray


def _same_tensor(a, b) -> bool:
    """Two fake tensors over the same memory with the same layout (what `module.to(FAKE)` of a module already on the
    fake device would swap)."""
    return (is_fake(a) and is_fake(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.elem.untyped_storage().data_ptr() == b.elem.untyped_storage().data_ptr()
            and a.elem.storage_offset() == b.elem.storage_offset())


def _swap_unless_same(original):
    """`torch.utils.swap_tensors`, skipped when nothing moves: `module.to(FAKE)` swaps every parameter (the swap is
    what puts a FakeDeviceTensor in place), and a swap refuses a tensor that something holds a weak reference to,
    while on CUDA a module already there is left as it is."""

    def swap_tensors(t1, t2):
        if not _same_tensor(t1, t2):
            original(t1, t2)

    return swap_tensors


@contextlib.contextmanager
def _patched(owner, name: str, wrap):
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def fake_device():
    """Inside: `FAKE` is a device of its own (see the module doc). Yields `FAKE`."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    old_kernel = os.environ.get("OAL_CPU_KERNEL")
    torch.__future__.set_swap_module_params_on_conversion(True)  # model.to(FAKE) swaps in FakeDeviceTensors
    os.environ["OAL_CPU_KERNEL"] = "0"  # the fused C++ kernel reads data_ptr(): a CPU-only path
    try:
        with (_patched(safetensors.torch, "_to_ndarray", _safetensors_to_ndarray),
              _patched(torch.utils, "swap_tensors", _swap_unless_same), _Factories(), _FromData()):
            yield FAKE
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        if old_kernel is None:
            os.environ.pop("OAL_CPU_KERNEL", None)
        else:
            os.environ["OAL_CPU_KERNEL"] = old_kernel
