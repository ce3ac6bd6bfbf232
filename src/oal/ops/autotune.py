"""The tuner behind `oal tune-cpu` and `benchmarks.operator`: times a pruned grid of the chunked operator's settings
on this machine and stores the best in `oal.ops.tuning`'s cache. Apart from `tuning` (which the operator imports to
read the cache) so that the operator never imports what measures it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time

import torch

from oal.ops import chunked, oal_attention
from oal.ops.kernel import perturbed_factor, taylor_factor
from oal.ops.tuning import (
    OPERATOR_REVISION,
    TUNE_SHAPE,
    Settings,
    _dtype_name,
    _read,
    cache_path,
    cpu_info,
    entry_problem,
    forced,
    kernel_mode,
    machine_key,
    reload,
    stale_reason,
    store_entry,
)

__all__ = ["busy_process", "candidates", "tune"]


def _inputs(n: int, dtype: torch.dtype, shape: dict):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, shape["hq"], n, shape["d"], generator=gen).to(dtype)
    k = torch.randn(1, shape["hkv"], n, shape["d"], generator=gen).to(dtype)
    v = torch.randn(1, shape["hkv"], n, shape["d"], generator=gen).to(dtype)
    groups = torch.randint(0, shape["g"], (shape["hq"], shape["d"]), generator=gen)
    factor = perturbed_factor(taylor_factor(shape["hq"], shape["g"]), 0.1, generator=gen)
    return q, k, v, groups, factor


def _fixed(dtype: torch.dtype) -> Settings:
    return chunked.fixed_settings(dtype)


def _time(settings: Settings, inputs, repeats: int) -> float:
    best = float("inf")
    with forced(settings), torch.no_grad():
        oal_attention(*inputs, backend="chunked")  # warm-up: scratch buffers
        for _ in range(repeats):
            t0 = time.perf_counter()
            oal_attention(*inputs, backend="chunked")
            best = min(best, time.perf_counter() - t0)
    return best


# spins in pure Python, asking every ~1e5 iterations (a few ms) whether its parent still lives
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100000):\n        pass\n"


@contextlib.contextmanager
def busy_process():
    """One competing process spinning a core for the duration of the block (issue 25's "one busy process"). It
    stops by itself once its parent is gone (a tuner killed by SIGTERM or -9 runs no `finally`: the child spun on for
    ever), and has a session of its own, so that a terminal's Ctrl-C reaches the tuner alone (no second traceback)."""
    proc = subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
    try:
        time.sleep(0.3)  # past the interpreter's start: spinning when the timing begins
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _time_loaded(settings: Settings, inputs, repeats: int) -> float:
    with busy_process():
        return _time(settings, inputs, repeats)


CHUNKS, BLOCK_TOKENS = (32, 64, 128), (128, 256, 512, 1024)


def candidates(default: Settings, threads: int, n_kv: int, best: Settings | None = None, stage: int = 0):
    """The pruned grid, one coordinate at a time: (0) the chunk size at the default block length, (1) the block
    length at the best chunk, (2) the worker layout at the best chunk and block (only with several threads).
    `tune` runs (0) and (1) again under the best layout when that is not the default's."""
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


def _reuse_problem(entry: dict, n: int, shape: dict) -> str | None:
    """Why a current cache entry cannot answer a tuning of length `n` at `shape` (None: it can). An entry timed at
    another length answered `--length 4096` with the choice and times of N = 256."""
    problem = entry_problem(entry, times=True)
    if problem is None and (entry.get("n") != n or entry.get("shape") != shape):
        problem = f"measured at N={entry.get('n')}, shape {entry.get('shape')}; asked N={n}, shape {shape}"
    return problem


def tune(dtypes=(torch.float32, torch.bfloat16), threads: int | None = None, n: int = 8192, repeats: int = 2,
         force: bool = False, shape: dict | None = None, log=None, contention: bool = True) -> dict:
    """Measure and cache the best settings for each dtype (wall clock, `threads` torch threads, causal forward of
    length n at `shape`, best of `repeats` calls per candidate). Entries already cached for this torch version are
    kept unless `force` (or measured at another n or shape). Returns {dtype name: entry}; an entry holds the settings,
    every candidate's time, the load average before and after, and how long the tuning took; a reused one also holds
    "cached": True.

    `contention`: when torch's own threads (serial) win on the quiet machine, the serial winner and the best
    pipelined candidate are timed again beside one busy process, and the one with the smaller mean of quiet and
    loaded time is kept. The workers exist because serial blocks stall beside a busy process (issue 25): on a
    Xeon with AMX serial was 21% faster quiet and 51% slower loaded at 16k. `False`: the quiet time alone."""
    shape = TUNE_SHAPE if shape is None else shape
    saved = torch.get_num_threads()
    threads = saved if threads is None else threads
    info = cpu_info()
    results = {}
    torch.set_num_threads(threads)
    try:
        for dtype in dtypes:
            kernel = kernel_mode(dtype)  # the calls timed run this path; an entry of the other is another key's
            key = machine_key(dtype, threads, info, kernel)
            old = _read(cache_path()).get(key)
            if not force and isinstance(old, dict):
                problem = stale_reason(old) or _reuse_problem(old, n, shape)
                if problem is None:
                    results[_dtype_name(dtype)] = {**old, "cached": True}  # marked for the caller, not stored
                    continue
                if log:
                    log(f"  {_dtype_name(dtype)}: the cached entry is not usable ({problem}); measuring it again")
            t_start, load = time.perf_counter(), os.getloadavg()[0]
            inputs = _inputs(n, dtype, shape)
            tried: dict[Settings, float] = {}
            best, default = None, _fixed(dtype)
            base = default
            for stage in (0, 1, 2, 0, 1):
                # the second pass (chunk, then block, under the best layout) only when the layout moved: on a
                # CPU where torch's own threads beat the workers (a Xeon with AMX), their best block differs
                if stage == 0 and best is not None:
                    if (best.pipeline, best.kv_groups) == (base.pipeline, base.kv_groups):
                        break
                    base = dataclasses.replace(default, pipeline=best.pipeline, kv_groups=best.kv_groups)
                todo = candidates(base, threads, shape["hkv"], best, stage)
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
                for cand in (default, best) if log else ():  # the times the choice and the summary line use
                    log(f"  {_dtype_name(dtype)} {cand.label()} against the other, interleaved: {tried[cand]:.3f} s")
                best = min((default, best), key=tried.get)
            loaded = {}
            pipelined = [c for c in tried if c.pipeline]
            if contention and threads > 1 and not best.pipeline and pipelined:
                rival = min(pipelined, key=tried.get)
                for cand in (best, rival):
                    loaded[cand] = _time_loaded(cand, inputs, repeats)
                    if log:
                        log(f"  {_dtype_name(dtype)} {cand.label()} beside a busy process: {loaded[cand]:.3f} s")
                best = min(loaded, key=lambda c: (tried[c] + loaded[c]) / 2)
            entry = {"settings": dataclasses.asdict(best), "torch": torch.__version__, "revision": OPERATOR_REVISION,
                     "cpu": info, "threads": threads, "cpu_kernel": kernel,
                     "n": n, "shape": shape, "default": dataclasses.asdict(default),
                     "time_s": tried[best], "default_time_s": tried.get(default),
                     "candidates": [dataclasses.asdict(s) | {"time_s": t} for s, t in tried.items()],
                     "loaded": [dataclasses.asdict(s) | {"time_s": t} for s, t in loaded.items()],
                     "load_before": load, "load_after": os.getloadavg()[0],
                     "tuning_s": time.perf_counter() - t_start, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            store_entry(key, entry)  # merged with the entries other processes wrote meanwhile
            results[_dtype_name(dtype)] = entry
    finally:
        torch.set_num_threads(saved)
        reload()
    return results
