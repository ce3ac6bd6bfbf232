"""Device and dtype choice for every command that runs a model (design.md "Scale and devices", "Contract: devices").

`resolve_device("auto")` is CUDA when this torch build sees a GPU, else the CPU; an explicit device that this
torch build lacks (`cuda` on a CPU-only wheel, `cuda:3` on a one-GPU machine, `mps` off Apple) is a one-line
ValueError, never a traceback from deep inside a model load.

Where tensors live (docs/design/devices.md; tests/test_device_discipline.py checks it on the CPU with a fake second
device that refuses to mix, as CUDA does):
- a method's tensors (kernel factors, group ids, random features, projections) are parameters or registered buffers
  of its module, so they move with the model (`oal.convert` moves each method to the model's device); a method
  never moves its own tensors in `forward`;
- what a stage loads from disk or builds from data (token blocks, masks, groups, kernels, captures) goes to the
  model's device once, where the stage begins: `to_device(obj, module_device(model))`; the functions below take
  their inputs where the model is. Random draws come from CPU generators (the same numbers on every device) and
  are moved once;
- bookkeeping that ends in a Python number accumulates on the device and comes back once, at the end; no host
  synchronisation inside an operator call; times on CUDA wait for the device (`oal.rundir.stages.Timer`).

Mixed precision (how `--dtype` is applied): the base model's weights and activations are in `--dtype`; everything
the method owns stays in float32, by explicit casts rather than autocast:
- kernel parameters (OAL factors, baselines' parameters) are built in float32 and `convert` moves them to the
  model's device without changing their dtype; the operator (`oal.ops.oal_attention`) accumulates its prefix
  states in float32 and returns the model's dtype (bf16 inputs run bf16 features and dots with fp32 accumulation
  where the hardware has them, float32 where the factor is trained: `docs/design/backends.md`);
- calibration captures q/k/v/outputs in the model's dtype and `oal.calibration.fit` upcasts them to float32 before
  fitting (`CalibConfig.dtype`);
- LoRA adapters are float32: peft's `autocast_adapter_dtype` (on by default) keeps adapter weights in float32 on a
  bfloat16/float16 base and casts their input to float32;
- losses and perplexities are computed from float32 logits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

import torch

__all__ = ["DTYPES", "checkpoint_layers", "enable_layer_checkpointing", "module_device", "release_memory",
           "resolve_device", "resolve_dtype", "to_device"]

# --dtype choices for the base model (float64 is accepted by the library for exactness tests)
DTYPES = ("float32", "bfloat16", "float16")
_LIBRARY_DTYPES = (*DTYPES, "float64")


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1', 'mps' -> a torch.device this build can use;
    an explicit 'cuda:N' also becomes this process's current CUDA device."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = "auto" if spec is None else str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {spec!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU"
            raise ValueError(f"device: {spec!r} requested but this torch ({torch.__version__}) is {build}; "
                             "use 'cpu' or 'auto' (on the command line: --device cpu)")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device: {spec!r} requested but only {n} CUDA device(s) are visible")
        if dev.index is not None:
            # the process's current CUDA device too: Triton launches, torch.cuda.synchronize() and CUDA events use
            # the current device, not the tensors' (cuda:1 with the default current device 0 would launch on 0)
            torch.cuda.set_device(dev)
        return dev
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device: {spec!r} requested but MPS is not available in this torch build/machine")
        return dev
    raise ValueError(f"device: expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {spec!r}")


def module_device(module: torch.nn.Module) -> torch.device:
    """Where `module`'s tensors live: its first parameter's device (else its first buffer's, else the CPU). The
    device a stage moves its inputs to (see the module doc)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def to_device(obj, device: torch.device | str):
    """`obj` on `device`: a tensor (moved), a module (moved in place and returned), None, or a dict / list / tuple of
    those (rebuilt). The one move a stage makes at its boundary (see the module doc)."""
    if obj is None:
        return None
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    raise TypeError(f"to_device: expected tensors, modules, or dicts / lists / tuples of them, got "
                    f"{type(obj).__name__}")


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (| 'float64', library only) -> torch.dtype."""
    if isinstance(name, torch.dtype):
        name = str(name).replace("torch.", "")
    if name not in _LIBRARY_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


# Training blocks at least this long recompute each decoder layer in the backward pass (activation checkpointing)
# on the CPU, where memory is the limit: at N=4096 the stored activations of a 24-layer model are several GB.
CHECKPOINT_MIN_TOKENS = 2048


def checkpoint_layers(device: torch.device | str, block_len: int) -> bool:
    """Whether adaptation should checkpoint the decoder layers: long blocks on a CPU (not CUDA, whose memory the
    paper's presets fit without it, and where recomputation would cost a third more time)."""
    return torch.device(device).type == "cpu" and block_len >= CHECKPOINT_MIN_TOKENS


def enable_layer_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward pass (transformers' activation checkpointing, non-reentrant,
    so frozen inputs need no grad and dropout masks are replayed exactly)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


_LIBC: object = None  # ctypes handle of glibc (False where there is none: macOS, musl, Windows)


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _LIBC = libc if hasattr(libc, "malloc_trim") else False
            except OSError:
                pass
    return _LIBC


def release_memory(*, collect: bool = True) -> bool:
    """Give freed memory back: CUDA's cached blocks, and the heap pages glibc keeps after frees (`malloc_trim(0)`,
    every arena); True where glibc trimmed. It changes no tensor, only what the process holds: the attention
    regime's fp64 query chunks left SmolLM2-135M's process at 7.7 GB for ~10 MB of statistics, and every later
    stage of `oal run` started from there (1.6 GB with a trim per captured layer). `collect`: run the garbage
    collector first (a stage's reference cycles, e.g. a model copy's, go now)."""
    if collect:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc = _libc()
    if not libc:
        return False
    libc.malloc_trim(0)
    return True
