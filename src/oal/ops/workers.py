"""Single-threaded CPU workers that run the chunked operator's blocks, and the state chain between them.

Why: torch runs every op as one parallel region that ends in a barrier, and the chunked operator issues about a
hundred ops per 512-token block. Beside one busy competing process, a descheduled thread stalls each barrier: OAL
slowed 2.4-3.8x where SDPA slowed 1.2-1.6x (issue 25). Workers instead take whole blocks from one queue, one
thread each, so a descheduled worker delays only its own block while the others take the next ones.

torch's thread count is process-wide (OpenMP), so `Workers.run` sets it to 1 for the duration of the run and
restores it after: torch work in other Python threads during a run is single-threaded. `OAL_CPU_PIPELINE=0`
turns the pipeline off (the operator then runs its blocks one after another with torch's threads).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from oal.errors import env_flag

__all__ = ["Chain", "Workers", "enabled", "workers"]


def enabled() -> bool:
    return env_flag("OAL_CPU_PIPELINE", True)


class Chain:
    """Values published by one item and awaited by another (the prefix state before each block)."""

    def __init__(self, initial: dict):
        self._values = dict(initial)
        self._failed = False
        self._cond = threading.Condition()

    def put(self, key, value) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def take(self, key):
        """The value published under `key`, once it is, removed from the chain: each is read exactly once, so a
        call holds only the states not yet read, not one per block."""
        with self._cond:
            while key not in self._values:
                if self._failed:  # the item that would publish it raised: give up instead of waiting forever
                    raise RuntimeError("an earlier block of this call failed")
                self._cond.wait()
            return self._values.pop(key)

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


class Workers:
    """`n` threads (a ThreadPoolExecutor: one FIFO queue), each with torch's thread count at 1."""

    def __init__(self, n: int):
        self.size, self.pid = n, os.getpid()
        # threads start on the first run, inside it (the process-wide count is 1 then); the initializer sets this
        # thread's own MKL and OpenMP settings
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="oal-worker", initializer=torch.set_num_threads,
                                        initargs=(1,))
        self._lock = threading.Lock()  # one run at a time: a run sets the process-wide thread count

    def run(self, fn, items: list[tuple], chain: Chain | None = None) -> None:
        """fn(*item) for every item, started in order (an item may wait on one started before it, never after);
        returns when all are done and raises the first error. Grad and inference mode follow the caller's."""
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def call(*args):
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    fn(*args)
            except BaseException:
                if chain is not None:
                    chain.fail()  # release the items waiting for what this one would have published
                raise

        with self._lock:
            saved = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                futures = [self._pool.submit(call, *item) for item in items]
                wait(futures)
            finally:
                torch.set_num_threads(saved)
        for f in futures:
            f.result()  # the first error, in item order

    def close(self) -> None:
        """Stop the threads once they are idle."""
        self._pool.shutdown(wait=False)


_POOL: Workers | None = None
_POOL_LOCK = threading.Lock()


def workers(n: int) -> Workers:
    """The process's pool of `n` workers (rebuilt when n changes, and after a fork: threads do not survive one)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.size != n or _POOL.pid != os.getpid():
            if _POOL is not None and _POOL.pid == os.getpid():
                _POOL.close()
            _POOL = Workers(n)
        return _POOL
