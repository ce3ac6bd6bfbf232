"""Settings of the chunked CPU operator, measured on the machine it runs on, and their cache.

The chunk size, the chunks per block and the worker layout were chosen by measurement on one CPU; on another the
best choice differs (issue 36). `tune()` times a pruned grid of them at the Qwen head shape and stores the best
per CPU model (with its SIMD flags), torch thread count and dtype, in the user's cache folder
(`cpu_tuning.json` under `oal.user_cache.cache_root`: `$OAL_CACHE_DIR`, else `$XDG_CACHE_HOME/oal`, else
`~/.cache/oal`), written atomically. An entry measured under another torch version (or another
OPERATOR_REVISION) is stale: it is not used, and the next `tune()` measures it again.

The operator never measures on a user's call: it reads the cache (once per process) and, without an entry, runs
the fixed defaults. Tuning runs when asked: `oal tune-cpu` or `tune()`, and `benchmarks.operator` before it
times (`--no-tune` there keeps the defaults). `OAL_NO_TUNE=1` makes the operator ignore the cache, for
reproducible fixed settings; `forced(settings)` pins settings for a block of code (the tuner and the benchmark
use it).
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
import time
from pathlib import Path

import torch

from oal.user_cache import cache_root

__all__ = ["Settings", "cache_path", "cpu_info", "forced", "lookup", "machine_key", "settings_for", "source",
           "tune"]

CACHE_NAME = "cpu_tuning.json"
# SIMD flags that change which GEMM and elementwise kernels torch runs; two CPUs with one model name and different
# flags (a VM that hides AVX-512) are different machines
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
TUNE_SHAPE = dict(hq=14, hkv=2, d=64, g=5)  # the Qwen2.5-0.5B head shape, as in benchmarks.operator
# Bump when a change to the chunked path can move the best settings: entries of another revision are stale, like
# entries measured under another torch version.
OPERATOR_REVISION = 1


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


def _inputs(n: int, dtype: torch.dtype, shape: dict):
    from oal.ops.kernel import perturbed_factor, taylor_factor

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, shape["hq"], n, shape["d"], generator=gen).to(dtype)
    k = torch.randn(1, shape["hkv"], n, shape["d"], generator=gen).to(dtype)
    v = torch.randn(1, shape["hkv"], n, shape["d"], generator=gen).to(dtype)
    groups = torch.randint(0, shape["g"], (shape["hq"], shape["d"]), generator=gen)
    factor = perturbed_factor(taylor_factor(shape["hq"], shape["g"]), 0.1, generator=gen)
    return q, k, v, groups, factor


def _fixed(dtype: torch.dtype) -> Settings:
    from oal.ops import chunked  # the fixed defaults live with the operator (which imports this module)

    return chunked.fixed_settings(dtype)


def _time(settings: Settings, inputs, repeats: int) -> float:
    from oal.ops import oal_attention

    best = float("inf")
    with forced(settings), torch.no_grad():
        oal_attention(*inputs, backend="chunked")  # warm-up: scratch buffers
        for _ in range(repeats):
            t0 = time.perf_counter()
            oal_attention(*inputs, backend="chunked")
            best = min(best, time.perf_counter() - t0)
    return best


CHUNKS, BLOCK_TOKENS = (32, 64, 128), (128, 256, 512, 1024)


def candidates(default: Settings, threads: int, n_kv: int, best: Settings | None = None, stage: int = 0):
    """The pruned grid, one coordinate at a time: (0) the chunk size at the default block length, (1) the block
    length at the best chunk, (2) the worker layout at the best chunk and block (only with several threads)."""
    block_tokens = default.chunk * default.block_chunks
    if stage == 0:
        return [dataclasses.replace(default, chunk=c, block_chunks=max(block_tokens // c, 1)) for c in CHUNKS]
    if stage == 1:
        return [dataclasses.replace(best, block_chunks=max(t // best.chunk, 1)) for t in BLOCK_TOKENS]
    if threads <= 1:
        return []
    layouts = [dataclasses.replace(best, pipeline=True, kv_groups=0), dataclasses.replace(best, pipeline=False)]
    if n_kv > 1:
        layouts.append(dataclasses.replace(best, pipeline=True, kv_groups=n_kv))
    return layouts


def _beyond(best: Settings, stage: int) -> Settings | None:
    """One step past the edge of the grid when the best lies on it (a CPU that wants longer chunks or blocks)."""
    if stage == 0 and best.chunk == CHUNKS[-1]:
        tokens = best.chunk * best.block_chunks
        return dataclasses.replace(best, chunk=2 * best.chunk, block_chunks=max(tokens // (2 * best.chunk), 1))
    if stage == 1 and best.chunk * best.block_chunks == BLOCK_TOKENS[-1]:
        return dataclasses.replace(best, block_chunks=2 * best.block_chunks)
    return None


def tune(dtypes=(torch.float32, torch.bfloat16), threads: int | None = None, n: int = 8192, repeats: int = 2,
         force: bool = False, shape: dict | None = None, log=None) -> dict:
    """Measure and cache the best settings for each dtype (wall clock, `threads` torch threads, causal forward of
    length n at `shape`, best of `repeats` calls per candidate). Entries already cached for this torch version are
    kept unless `force`. Returns {dtype name: entry}; an entry holds the settings, every candidate's time, the
    load average before and after, and how long the tuning took."""
    shape = TUNE_SHAPE if shape is None else shape
    saved = torch.get_num_threads()
    threads = saved if threads is None else threads
    info = cpu_info()
    results = {}
    torch.set_num_threads(threads)
    try:
        for dtype in dtypes:
            key = machine_key(dtype, threads, info)
            old = _read(cache_path()).get(key)
            if not force and _current(old):
                results[_dtype_name(dtype)] = old
                continue
            t_start, load = time.perf_counter(), os.getloadavg()[0]
            inputs = _inputs(n, dtype, shape)
            tried: dict[Settings, float] = {}
            best, default = None, _fixed(dtype)
            for stage in range(3):
                todo = candidates(default, threads, shape["hkv"], best, stage)
                while todo:
                    for cand in todo:
                        if cand not in tried:
                            tried[cand] = _time(cand, inputs, repeats)
                            if log:
                                log(f"  {_dtype_name(dtype)} {cand.label()}: {tried[cand]:.3f} s")
                    best = min(tried, key=tried.get)
                    step = _beyond(best, stage)
                    todo = [step] if step is not None and step not in tried else []
            if best != default:  # confirm against the defaults, interleaved, so that a drift in load cannot pick it
                for _ in range(repeats):
                    for cand in (default, best):
                        tried[cand] = min(tried[cand], _time(cand, inputs, 1))
                best = min((default, best), key=tried.get)
            entry = {"settings": dataclasses.asdict(best), "torch": torch.__version__, "revision": OPERATOR_REVISION,
                     "cpu": info, "threads": threads,
                     "n": n, "shape": shape, "default": dataclasses.asdict(default),
                     "time_s": tried[best], "default_time_s": tried.get(default),
                     "candidates": [dataclasses.asdict(s) | {"time_s": t} for s, t in tried.items()],
                     "load_before": load, "load_after": os.getloadavg()[0],
                     "tuning_s": time.perf_counter() - t_start, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            with _LOCK:  # merge with entries other processes may have written meanwhile
                entries = _read(cache_path())
                entries[key] = entry
                _write(cache_path(), entries)
            results[_dtype_name(dtype)] = entry
    finally:
        torch.set_num_threads(saved)
        reload()
    return results
