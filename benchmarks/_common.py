"""Shared by the benchmarks: the command line of a tool (one-line errors, checked arguments and outputs),
thread/clock options and figure finishing.

This module imports no torch: a benchmark parses its arguments with it before its heavy imports, so that --help
and a bad argument answer at once (`ToolParser`, `run_tool`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

# The clock every timing uses: wall time, or with --clock cpu the process's CPU time (robust on a shared machine).
CLOCK, CLOCK_NAME = time.perf_counter, "wall"
MAX_THREADS = 4 * (os.cpu_count() or 1)  # as `oal`'s --threads: more only wait on each other
MAX_TOKENS = 2**20


# ----------------------------------------------------------------------------------------------- the command line


class ToolParser(argparse.ArgumentParser):
    """argparse as the `oal` command line answers: a bad argument is one line `Error: ...` on stderr and exit code
    2 (no usage dump); --help ends with what the tool writes (`outputs`); --debug shows the traceback of an error
    found later (`run_tool`)."""

    def __init__(self, doc: str, outputs: str, **kwargs):
        import textwrap

        super().__init__(description=doc, epilog=textwrap.fill(f"Outputs: {outputs}", 116) + "\n",
                         formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.add_argument("--debug", action="store_true", help="on an error, show the full traceback")

    def error(self, message: str):
        self.exit(2, f"Error: {' '.join(message.split())} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        import json

        global PARSED
        parsed, rest = super().parse_known_args(args, namespace)
        PARSED = json.loads(json.dumps(vars(parsed), default=str))  # `environment()`: every JSON records them
        return parsed, rest


PARSED: dict | None = None  # the arguments of the last ToolParser parse (the tool's own, in a benchmark process)


def run_tool(main, args: argparse.Namespace) -> None:
    """`main(args)` as a command: bad input found after parsing (a ValueError, an OSError, a model that cannot be
    had) is one line `Error: ...` and exit code 2, as `oal` does; the return value is the exit code."""
    try:
        code = main(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        from oal.models.folders import ModelUnavailableError

        if getattr(args, "debug", False) or not isinstance(exc, (ValueError, OSError, ModelUnavailableError)):
            raise
        print(f"Error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high if high is not None else 'inf'}]"
                                             f", got {value}")
        return value
    return parse


def float_in(low: float, high: float, *, open_low: bool = False):
    """An argparse type: a finite number in [low, high] ((low, high] with `open_low`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if open_low else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"expected a number in {'(' if open_low else '['}{low}, {high}], "
                                             f"got {text}")
        return value
    return parse


def list_of(item):
    """An argparse type: a comma-separated, non-empty list of `item` (an argparse type), in the order given."""
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [item(p) for p in parts]
    return parse


def output_file(text: str) -> Path:
    """An argparse type: a file the tool may write (at the end of its work): not a folder, in a folder that exists
    or can be made, where a file can be written now (tried, and removed)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; expected a file to write")
    if path.suffix.lower() == ".png":  # the figure goes beside the file as NAME.png: it would replace the file
        raise argparse.ArgumentTypeError(f"{path}: the PNG is written beside this file under its name; give the "
                                         "JSON's name (e.g. .json)")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path} is not writable")
    _check_writable(path, path.parent)
    return path


def _check_writable(path: Path, folder: Path) -> None:
    """ArgumentTypeError unless a file can be written now in `folder` or, where it does not exist yet, in the
    nearest folder above it that does (a temporary file is made there and removed)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: {folder} is not a folder")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{path}: cannot write in {folder} ({exc.strerror})") from None


def output_dir(text: str) -> Path:
    """An argparse type: a folder the tool may fill: an existing folder or one that can be made where a file can
    be written now (nothing is created yet)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} exists and is not a folder")
    _check_writable(path, path)
    return path


def input_file(text: str) -> Path:
    """An argparse type: an existing readable file."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{path} is not readable")
    return path


def settings_parts(text: str) -> tuple[int, int, bool, int]:
    """`--settings` of benchmarks.operator and settings_ab: "CHUNKxBLOCKS" with an optional ",serial" or ",pipeline"
    and ",kvN" (e.g. "64x2,pipeline,kv2", another machine's tuned choice) as (chunk, block_chunks, pipeline,
    kv_groups), the fields of `oal.ops.tuning.Settings`; ValueError with what was expected otherwise."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        chunk, blocks = (int(x) for x in parts[0].lower().split("x"))
        layout = {"pipeline": True, "serial": False}[parts[1]] if len(parts) > 1 else True
        kv = int(parts[2].removeprefix("kv")) if len(parts) > 2 else 0
        if not (1 <= chunk <= 4096 and 1 <= blocks <= 4096 and 0 <= kv <= 1024) or len(parts) > 3:
            raise ValueError
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"--settings: expected CHUNKxBLOCKS[,serial|pipeline[,kvN]] (e.g. 64x2,pipeline; chunk and "
                         f"blocks in [1, 4096]), got {text!r}") from None
    return chunk, blocks, layout, kv


def settings_text(text: str) -> str:
    """An argparse type: a `settings_parts` string, kept as given."""
    try:
        settings_parts(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--settings: ")) from None
    return text


# ----------------------------------------------------------------------------------------------- timing


def add_timing_args(parser) -> None:
    parser.add_argument("--threads", type=int_in(0, MAX_THREADS), help="torch threads (0 or unset: torch's own "
                        "choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, robust to a shared machine (needs --threads 1)")


def check_timing_args(parser, args) -> None:
    """--clock cpu needs --threads 1 (before any work; `apply_timing_args` applies them)."""
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu: needs --threads 1 (process CPU time counts every thread, spinning included)")


def apply_timing_args(parser, args) -> None:
    """Set torch's threads and the module clock from --threads/--clock (checked by `check_timing_args`)."""
    global CLOCK, CLOCK_NAME
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    CLOCK, CLOCK_NAME = (time.process_time if args.clock == "cpu" else time.perf_counter), args.clock


def add_length_args(parser) -> None:
    parser.add_argument("--min-len", type=int_in(1, MAX_TOKENS), default=1024)
    parser.add_argument("--max-len", type=int_in(1, MAX_TOKENS), default=32768)
    parser.add_argument("--lengths", type=list_of(int_in(1, MAX_TOKENS)),
                        help="comma-separated lengths instead of min-len..max-len doubling")


def lengths_from(parser, args) -> list[int]:
    """The lengths to run: --lengths, or min-len doubling up to max-len (call it before any work)."""
    if args.lengths:
        return sorted(set(args.lengths))
    if args.max_len < args.min_len:
        parser.error("--min-len/--max-len: expected 1 <= min-len <= max-len")
    lengths, n = [], args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2
    return lengths


def timing_flags() -> list[str]:
    """The same settings, as arguments for a child process."""
    import torch

    return ["--threads", str(torch.get_num_threads()), "--clock", CLOCK_NAME]


def child_json(cmd: list[str], what: str):
    """Run a timing child (`cmd`, from the checkout's root) and parse the JSON of its last stdout line; a failed
    child raises with the end of its stderr, which a bare CalledProcessError threw away."""
    import json
    import subprocess

    res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if res.returncode:
        raise RuntimeError(f"{what} failed (exit code {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def clock() -> float:
    return CLOCK()


def finish_figure(fig, axes, title: str, path: Path) -> None:
    from oal.rundir.files import atomic_save_figure

    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend() is None:  # a plot that placed its own legend (off its data) keeps it
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


def direct_launch(on: bool, otherwise: str | None = None):
    """OAL_TRITON_DIRECT_LAUNCH=1 within when `on` (`oal.ops.triton.launch`; read when a plan is made, so the plans
    made inside keep it), else `otherwise` ("0" forces the usual launches; None leaves the environment as it is);
    the environment restored after."""
    from unittest import mock

    from oal.ops.triton import launch

    value = "1" if on else otherwise
    return mock.patch.dict(os.environ, {launch.ENV: value}) if value is not None else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------ provenance


def environment(args: argparse.Namespace | None = None) -> dict:
    """What a benchmark's numbers were measured with, for its JSON: the versions of the interpreter and libraries
    (`oal.rundir.hashes.versions`, torch's build included), the tool's arguments (`args`, as parsed, defaults
    included: those of the last `ToolParser`, or `args` for a tool with a parser of its own), the commit of the
    checkout (as scripts/gpu_check.sh: $COMMIT where set, else `git rev-parse HEAD` with "+uncommitted" when
    tracked files differ; None outside git) and the machine (CPU model, cores, torch's threads, the GPU torch
    sees)."""
    import json
    import platform
    import subprocess

    import torch

    from oal.ops.tuning import cpu_info
    from oal.rundir.hashes import versions

    commit = os.environ.get("COMMIT") or None
    if commit is None:
        def git(*args: str) -> str | None:
            try:
                res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                                     cwd=Path(__file__).resolve().parent)
            except (OSError, subprocess.SubprocessError):
                return None
            return res.stdout.strip() if res.returncode == 0 else None

        commit = git("rev-parse", "HEAD")
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "+uncommitted"
    cuda = torch.cuda.is_available()
    return {"versions": versions() | {"torch_build": torch.__version__, "cuda": torch.version.cuda},
            "commit": commit, "args": PARSED if args is None else json.loads(json.dumps(vars(args), default=str)),
            "machine": {"platform": platform.platform(), "cpu": cpu_info()["model"],
                        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                        "gpu": torch.cuda.get_device_name() if cuda else None}}


# ------------------------------------------------------------------------------------------------ the device's tag

# Cards the GPU scripts may be lent, matched as whole words so that "GH200" is not taken for "H200".
KNOWN_GPUS = ("GH200", "H200", "H100", "A100", "L40S", "L4", "A10G")


def device_tag(name: str) -> str:
    """A short file-name tag for a device name as torch reports it ("NVIDIA H100 80GB HBM3" -> "h100"; "cpu"
    stays "cpu"): the GPU scripts name their outputs with it, so that a run on another card is never filed as the
    H200's, whose numbers the issues' acceptance names."""
    import re

    upper = name.upper()
    for gpu in KNOWN_GPUS:
        if re.search(rf"(?<![A-Z0-9]){gpu}(?![A-Z0-9])", upper):
            return gpu.lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:24] or "unknown"
