"""Shared by the benchmarks: thread/clock options and figure finishing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

# The clock every timing uses: wall time, or with --clock cpu the process's CPU time (robust on a shared machine).
CLOCK, CLOCK_NAME = time.perf_counter, "wall"


def add_timing_args(parser) -> None:
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, robust to a shared machine (needs --threads 1)")


def apply_timing_args(parser, args) -> None:
    """Set torch's threads and the module clock from --threads/--clock."""
    global CLOCK, CLOCK_NAME
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        parser.error("--clock cpu: needs --threads 1 (process CPU time counts every thread, spinning included)")
    CLOCK, CLOCK_NAME = (time.process_time if args.clock == "cpu" else time.perf_counter), args.clock


def add_length_args(parser) -> None:
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--lengths", help="comma-separated lengths instead of min-len..max-len doubling")


def lengths_from(parser, args) -> list[int]:
    """The lengths to run: --lengths, or min-len doubling up to max-len."""
    if args.lengths:
        try:
            lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
        except ValueError:
            parser.error(f"--lengths: expected comma-separated integers, got {args.lengths!r}")
        if not lengths or lengths[0] < 1:
            parser.error(f"--lengths: expected positive integers, got {args.lengths!r}")
        return lengths
    if args.min_len < 1 or args.max_len < args.min_len:
        parser.error("--min-len/--max-len: expected 1 <= min-len <= max-len")
    lengths, n = [], args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2
    return lengths


def timing_flags() -> list[str]:
    """The same settings, as arguments for a child process."""
    return ["--threads", str(torch.get_num_threads()), "--clock", CLOCK_NAME]


def clock() -> float:
    return CLOCK()


def finish_figure(fig, axes, title: str, path: Path) -> None:
    from oal.rundir.files import atomic_save_figure

    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)


class PeakRSS:
    """Peak resident memory (MiB) above the level at entry, sampled from /proc/self/statm every `interval` s.

    ru_maxrss cannot be reset, so a peak reached earlier in the process (loading a model) would hide the peak of
    the section measured; sampling sees the section's own peak (to within the sampling interval).
    """

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak_mib = interval, 0.0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        import threading

        self._base = self._peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._rss())
        self.peak_mib = (self._peak - self._base) / 2**20
