"""Settings of the chunked CPU operator, measured on the machine it runs on, and their cache.

The chunk size, the chunks per block and the worker layout were chosen by measurement on one CPU; on another the
best choice differs (issue 36). `tune()` times a pruned grid of them at the Qwen head shape and stores the best
per CPU model (with its SIMD flags), torch thread count and dtype, in the user's cache folder
(`cpu_tuning.json` under `oal.rundir.user_cache.cache_root`: `$OAL_CACHE_DIR`, else `$XDG_CACHE_HOME/oal`, else
`~/.cache/oal`), written atomically. An entry measured under another torch version (or another
OPERATOR_REVISION) is stale: it is not used, and the next `tune()` measures it again.

The operator never measures on a user's call: it reads the cache (once per process) and, without an entry, runs
the fixed defaults. Tuning runs when asked: `oal tune-cpu` or `oal.ops.autotune.tune()`, and
`benchmarks.operator` before it times (`--no-tune` there keeps the defaults). `OAL_NO_TUNE=1` makes the operator
ignore the cache, for reproducible fixed settings; `forced(settings)` pins settings for a block of code (the tuner
and the benchmark use it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import torch

from oal.rundir.user_cache import cache_root

__all__ = ["Settings", "cache_path", "cpu_info", "forced", "lookup", "machine_key", "settings_for", "source"]

CACHE_NAME = "cpu_tuning.json"
# SIMD flags that change which GEMM and elementwise kernels torch runs; two CPUs with one model name and different
# flags (a VM that hides AVX-512) are different machines
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
TUNE_SHAPE = dict(hq=14, hkv=2, d=64, g=5)  # the Qwen2.5-0.5B head shape, as in benchmarks.operator
# Bump when a change to the chunked path can move the best settings: entries of another revision are stale, like
# entries measured under another torch version.
OPERATOR_REVISION = 3  # 3: the fused CPU kernel (ops.cpu_kernel: readout and intra-chunk term)


@dataclasses.dataclass(frozen=True)
class Settings:
    """chunk: tokens per chunk; block_chunks: chunks per block (the unit of work and of scratch memory);
    pipeline: blocks on single-threaded workers (`ops.workers`) when torch has more than one thread;
    kv_groups: KV-head groups that run as separate state chains on the workers (0: as many as keep every worker
    busy, the automatic choice)."""

    chunk: int
    block_chunks: int
    pipeline: bool = True
    kv_groups: int = 0

    def label(self) -> str:
        layout = f"pipeline, kv groups {self.kv_groups or 'auto'}" if self.pipeline else "serial"
        return f"chunk {self.chunk}, block {self.chunk * self.block_chunks} ({self.block_chunks} chunks), {layout}"


_LOCK = threading.Lock()
_LOADED: dict | None = None  # the cache file's entries, read once per process (`reload()` forgets them)
_FOUND: dict = {}  # (dtype, threads) -> Settings or None, from _LOADED
_FORCED: list[Settings] = []


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_path() -> Path:
    return cache_root(CACHE_NAME)


def cpu_info() -> dict:
    """The CPU model, its SIMD flags that matter here (of KEY_FLAGS), and torch's CPU capability."""
    return dict(_cpu_info())


@functools.cache
def _cpu_info() -> dict:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    return {"model": model or "unknown", "flags": [f for f in KEY_FLAGS if f in flags],
            "capability": torch.backends.cpu.get_cpu_capability()}


def machine_key(dtype: torch.dtype, threads: int, info: dict | None = None) -> str:
    info = cpu_info() if info is None else info
    flags = hashlib.sha256(" ".join(info["flags"] + [info["capability"]]).encode()).hexdigest()[:8]
    return f"{info['model']} [{flags}] | {threads} threads | {_dtype_name(dtype)}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict) -> None:
    """Atomically: a temporary file in the same folder, renamed over the cache file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def reload() -> None:
    """Forget the cache file's entries read so far (the next lookup reads the file again)."""
    global _LOADED
    with _LOCK:
        _LOADED = None
        _FOUND.clear()


def lookup(dtype: torch.dtype, threads: int) -> Settings | None:
    """The cached settings of this machine, thread count and dtype, or None (none measured, or measured under
    another torch version)."""
    global _LOADED
    with _LOCK:
        if (dtype, threads) in _FOUND:
            return _FOUND[dtype, threads]
        if _LOADED is None:
            _LOADED = _read(cache_path())
        entry = _LOADED.get(machine_key(dtype, threads))
        found = None
        if _current(entry):
            with contextlib.suppress(KeyError, TypeError):
                found = Settings(**entry["settings"])
        _FOUND[dtype, threads] = found
        return found


def _current(entry) -> bool:
    return bool(entry) and entry.get("torch") == torch.__version__ and entry.get("revision") == OPERATOR_REVISION


def settings_for(dtype: torch.dtype, threads: int | None = None) -> Settings | None:
    """The settings the operator runs with: forced ones, else the cached ones (unless OAL_NO_TUNE=1), else None
    (the caller's fixed defaults). Cheap after the first call: it never measures."""
    if _FORCED:
        return _FORCED[-1]
    if os.environ.get("OAL_NO_TUNE", "0") not in ("", "0"):
        return None
    return lookup(dtype, torch.get_num_threads() if threads is None else threads)


def source(dtype: torch.dtype, threads: int | None = None) -> str:
    """Where `settings_for` takes its answer from: "forced", "tuned" (the cache) or "fixed" (the defaults)."""
    if _FORCED:
        return "forced"
    return "fixed" if settings_for(dtype, threads) is None else "tuned"


@contextlib.contextmanager
def forced(settings: Settings | None):
    """Run the operator with `settings` inside the block (None: no change)."""
    if settings is None:
        yield
        return
    _FORCED.append(settings)
    try:
        yield
    finally:
        _FORCED.pop()
