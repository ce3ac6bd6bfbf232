"""Settings of the chunked CPU operator, measured on the machine it runs on, and their cache.

The chunk size, the chunks per block and the worker layout were chosen by measurement on one CPU; on another the
best choice differs (issue 36). `tune()` times a pruned grid of them at the Qwen head shape and stores the best
per CPU model (with its SIMD flags), torch thread count, dtype and the path the calls ran (`kernel_mode`: the fused
CPU kernel, or the torch path under `OAL_CPU_KERNEL=0`, at another speed), in the user's cache folder
(`cpu_tuning.json` under `oal.rundir.user_cache.cache_root`: `$OAL_CACHE_DIR`, else `$XDG_CACHE_HOME/oal`, else
`~/.cache/oal`), written atomically. An entry measured under another torch version (or another
OPERATOR_REVISION), or on the other path, is stale: it is not used (one log line says why), and the next `tune()`
measures it again. So is an entry whose fields are not what `tune()` writes (`entry_problem`: a chunk of 0 or
"abc", a missing time), with one warning line; a file that is not JSON (or not a regular file) is reported once
and read as empty.

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
import logging
import math
import os
import tempfile
import threading
from pathlib import Path

import torch

from oal.errors import env_flag
from oal.rundir.user_cache import (
    SHARED_FILE,
    cache_root,
    cache_writes,
    clean_stale,
    entry_lock,
    make_folder,
    regular_problem,
)

__all__ = ["Settings", "cache_path", "cpu_info", "entry_problem", "forced", "kernel_mode", "lookup", "machine_key",
           "settings_for", "source", "stale_reason", "store_entry"]

log = logging.getLogger("oal")

CACHE_NAME = "cpu_tuning.json"
# SIMD flags that change which GEMM and elementwise kernels torch runs; two CPUs with one model name and different
# flags (a VM that hides AVX-512) are different machines
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
TUNE_SHAPE = dict(hq=14, hkv=2, d=64, g=5)  # the Qwen2.5-0.5B head shape, as in benchmarks.operator
# Bump when a change to the chunked path can move the best settings: entries of another revision are stale, like
# entries measured under another torch version.
OPERATOR_REVISION = 5  # 3: the fused CPU kernel (ops.cpu_kernel: readout and intra-chunk term); 4: bf16 on AMX tiles;
# 5: the kernel also writes the output, builds the chunk states (ops.cpu_chain) and gathers the queries
# What a Settings may hold: far beyond what the tuner tries (chunks up to 256 tokens, blocks up to 2048 tokens),
# small enough that a block's scratch memory stays bounded
MAX_CHUNK, MAX_BLOCK_CHUNKS, MAX_KV_GROUPS = 4096, 4096, 1024


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

    def __post_init__(self):  # an entry of the cache file is read back into this: bad values fail here, by name
        for name, top in (("chunk", MAX_CHUNK), ("block_chunks", MAX_BLOCK_CHUNKS), ("kv_groups", MAX_KV_GROUPS)):
            value, low = getattr(self, name), 0 if name == "kv_groups" else 1
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
                raise ValueError(f"{name}: expected an integer in [{low}, {top}], got {value!r}")
        if not isinstance(self.pipeline, bool):
            raise ValueError(f"pipeline: expected true or false, got {self.pipeline!r}")

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


def kernel_mode(dtype: torch.dtype) -> str:
    """The path the chunked operator's CPU calls in `dtype` run here, which moves their best settings: "torch path"
    (`OAL_CPU_KERNEL=0`, no compiler, a dtype the kernel does not serve) or "fused kernel" (bf16 on a CPU with AMX
    tiles under `OAL_CPU_AMX=0`: "fused kernel without AMX"). Never builds the kernel (`cpu_kernel.expected`)."""
    from oal.ops import cpu_kernel

    if dtype not in (torch.float32, torch.bfloat16) or not cpu_kernel.expected():
        return "torch path"
    amx_off = not (cpu_kernel.AMX and env_flag("OAL_CPU_AMX", True))
    return "fused kernel without AMX" if dtype == torch.bfloat16 and amx_off and \
        "amx_bf16" in cpu_info()["flags"] else "fused kernel"


def _base_key(dtype: torch.dtype, threads: int, info: dict | None = None) -> str:
    """The key without the kernel's path: what an oal before `kernel_mode` wrote (its entries say nothing of it)."""
    info = cpu_info() if info is None else info
    flags = hashlib.sha256(" ".join(info["flags"] + [info["capability"]]).encode()).hexdigest()[:8]
    return f"{info['model']} [{flags}] | {threads} threads | {_dtype_name(dtype)}"


def machine_key(dtype: torch.dtype, threads: int, info: dict | None = None, kernel: str | None = None) -> str:
    """The cache key of an entry: CPU (model, SIMD flags), threads, dtype and `kernel_mode` (`kernel`, else now's)."""
    return f"{_base_key(dtype, threads, info)} | {kernel_mode(dtype) if kernel is None else kernel}"


def _read(path: Path) -> dict:
    """The cache file's entries ({} when there is none; a damaged file is reported once and treated as empty)."""
    problem = regular_problem(path)
    if problem == "missing":
        return {}
    try:
        if problem is not None:  # a FIFO: its read would wait for ever
            raise OSError(problem)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        _warn_once(f"{path}: unreadable ({exc}); the operator runs its fixed settings (`oal tune-cpu` rewrites it)")
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        _warn_once(f"{path}: not a settings cache (damaged JSON); the operator runs its fixed settings (`oal "
                   "tune-cpu` rewrites it)")
        return {}
    return entries


def entry_problem(entry, times: bool = False) -> str | None:
    """None for a usable cache entry (its settings valid; with `times`, also the times `tune()` records, which `oal
    tune-cpu` prints), else what is wrong with it."""
    if not isinstance(entry, dict):
        return f"expected an object, got {type(entry).__name__}"
    if not isinstance(entry.get("settings"), dict):
        return "no settings"
    try:
        Settings(**entry["settings"])
    except (TypeError, ValueError) as exc:
        return f"settings: {exc}"
    measured = (("time_s", False), ("default_time_s", True), ("tuning_s", False), ("n", False))
    for name, optional in measured if times else ():
        value = entry.get(name)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"{name}: expected a number >= 0, got {value!r}"
    return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def store_entry(key: str, entry: dict) -> None:
    """Add `entry` under `key` to the cache file, merged with the entries other threads and processes wrote
    meanwhile (two tunings that finished together each kept only their own entry)."""
    path = cache_path()
    with _LOCK, cache_writes("the tuning entries", path.parent), entry_lock(path):
        entries = _read(path)
        entries[key] = entry
        _write(path, entries)


def _write(path: Path, entries: dict) -> None:
    """Atomically: a temporary file in the same folder, renamed over the cache file (and those a killed write left
    are removed)."""
    make_folder(path.parent)
    clean_stale(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
        os.chmod(tmp, SHARED_FILE)  # as every file of the cache (write_record); mkstemp makes it 0600
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
    """The cached settings of this machine, thread count, dtype and kernel path, or None (none measured, or measured
    under another torch version, operator revision or kernel path: `stale_reason`, said once)."""
    global _LOADED
    with _LOCK:
        if (dtype, threads) in _FOUND:
            return _FOUND[dtype, threads]
        if _LOADED is None:
            try:
                _LOADED = _read(cache_path())
            except OSError as exc:  # no cache folder at all (no home folder): the operator must run all the same
                _warn_once(f"{exc}; the operator runs its fixed settings")
                _LOADED = {}
        key = machine_key(dtype, threads)
        entry, found = _LOADED.get(key), None
        stale = _stale_here(key, entry)
        if stale is not None:
            _say_once(f"{cache_path()}: the tuned settings of {key!r} are not used: {stale}; the operator runs its "
                      "fixed settings (`oal tune-cpu` measures them)")
        if stale is None and isinstance(entry, dict):  # measured under this torch, revision and path
            problem = entry_problem(entry)
            if problem is None:
                found = Settings(**entry["settings"])
            else:
                _warn_once(f"{cache_path()}: the entry {key!r} is not usable ({problem}); dropped, the operator "
                           "runs its fixed settings (`oal tune-cpu` measures it again)")
        _FOUND[dtype, threads] = found
        return found


def stale_reason(entry: dict) -> str | None:
    """Why an entry (an object) was measured under other conditions than now's, or None."""
    if entry.get("torch") != torch.__version__:
        return f"measured under torch {entry.get('torch')}, this is {torch.__version__}"
    if entry.get("revision") != OPERATOR_REVISION:
        return f"measured with operator revision {entry.get('revision')}, this is {OPERATOR_REVISION}"
    return None


def _stale_here(key: str, entry) -> str | None:
    """Why this machine's entries cannot answer `key` (its dtype, threads and kernel path), or None: measured on the
    other path (`OAL_CPU_KERNEL`), by an oal that did not record the path, or under another torch or revision."""
    if entry is None:  # none for this path: this machine's entry of the other, or of an oal before the paths
        base, _, mode = key.rpartition(" | ")
        other = next((k.rpartition(" | ")[2] for k in _LOADED if k.startswith(f"{base} | ")), None)
        if other is not None:
            return f"measured with the {other}, this process runs the {mode}"
        if base in _LOADED:
            return "measured by an earlier oal, which did not record whether the fused CPU kernel ran"
        return None
    return stale_reason(entry) if isinstance(entry, dict) else None


def _say_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.info(message)


def settings_for(dtype: torch.dtype, threads: int | None = None) -> Settings | None:
    """The settings the operator runs with: forced ones, else the cached ones (unless OAL_NO_TUNE=1), else None
    (the caller's fixed defaults). Cheap after the first call: it never measures."""
    if _FORCED:
        return _FORCED[-1]
    if env_flag("OAL_NO_TUNE", False):
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
