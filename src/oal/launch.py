"""Several processes, one result (design.md "Scale and devices"): what each process of a `torchrun` or
`accelerate launch` launch does, and the few collectives oal uses (accelerate's, over torch.distributed).

A launch of N processes computes what one process computes:
- adaptation is data-parallel (`adaptation.train`): the blocks of an update come from one block order that does not
  depend on N, each process takes its share of them, and DDP averages the gradients;
- calibration is layer-parallel (`oal.calibration.resume.calibrate_layers`): process r calibrates layers r, r + N,
  ... of those still to do, and the main process gathers the kernels;
- every other stage (analysis, fidelity, perplexity, the report) runs on the main process while the others wait.

Only the main process writes (the run directory, checkpoints, adapters, the stage log, the report), and it decides
for the others what is already done (`Ranks.on_main`: its result, or its error, reaches every process), so no
process reads a file the main process may be writing. The run directory must be on a filesystem every process
sees (a shared one across machines): the others read the run's kernels and groups from it.

Processes must be given the same settings (`Ranks.agree` refuses others). One that never joins (`JOIN_TIMEOUT`) or
that stops mid-launch (`peer_errors`) makes the others stop with one line rather than wait.

A plain process (no launcher, or a launch of one) is rank 0 of 1, and nothing here touches torch.distributed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

__all__ = ["Ranks", "env_rank", "interactive", "launched", "log_console", "peer_errors", "process_device",
           "progress_bar", "ranks", "show_progress", "training_accelerator"]

T = TypeVar("T")
log = logging.getLogger("oal")

# The other processes wait at a barrier while the main process runs a single-process stage (perplexity on the test
# split, analysis); torch's default of 10-30 minutes is too short for the paper's models.
TIMEOUT = timedelta(hours=6)
# How long the processes wait for one another to start (seconds apart: the group forms before any model is read). A
# process that stopped before it joined (bad input on one machine) left the others waiting for TIMEOUT.
JOIN_TIMEOUT = timedelta(minutes=10)


# what `accelerate launch` sets for the sharded engines oal does not drive (FSDP, DeepSpeed, Megatron-LM)
SHARDING_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")


def launched() -> bool:
    """True inside a launch of several processes (`torchrun` and `accelerate launch` set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def env_rank() -> int:
    """This process's rank as the launcher set it (0 outside a launch); readable before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def reports_error(exc: BaseException) -> bool:
    """Whether this process prints `exc`'s one line: the main process always; another process of a launch only a
    failure of its own, raised after the launch's group formed and not bad input (bad input is alike on every
    process, as is an error raised before the group formed or re-raised from the main process by `Ranks.on_main`:
    the main process prints those). A rank's own failure (its scratch disk full) was otherwise shown by none."""
    from oal.errors import InputError, ModelUnavailableError

    if env_rank() == 0:
        return True
    if getattr(exc, "oal_from_main", False):
        return False
    # the first process of each machine prints the errors alike on every process too: another machine's log (its
    # own --model path missing, a mistyped option there) otherwise showed nothing while the main process waited
    first_here = int(os.environ.get("LOCAL_RANK", env_rank())) == 0
    alike = isinstance(exc, (InputError, ModelUnavailableError))
    return first_here or ("this" in _RANKS and not alike)


# where stderr is a file, a running bar writes a line this often (seconds): a cluster's log shows a long stage moving
LOG_EVERY_S = 60.0
# what a bar does whose caller does not say (`progress=None`): `oal --no-progress` and `oal --quiet` turn it off
_BARS = {"on": True}


def show_progress(on: bool) -> None:
    """Whether a progress bar whose caller passes no `progress` is shown (the command line's root options)."""
    _BARS["on"] = bool(on)


def interactive(console) -> bool:
    """A terminal that redraws: rich draws nothing while a bar runs on a file or on a dumb terminal (TERM=dumb,
    an editor's shell), so there a bar writes lines instead and long lines are not wrapped (grep finds them)."""
    return console.is_terminal and not console.is_dumb_terminal


def progress_bar(progress: bool | None = None, console=None, columns: tuple | None = None):
    """A rich Progress on `console` (default `log_console()`): transient on a terminal; where stderr is a file (a
    cluster's log) or a dumb terminal, where rich draws nothing while it runs, a bar writes its line every
    `LOG_EVERY_S` seconds while it moves, and leaves its last line, with its elapsed time. `progress`: shown or
    not (default: on, unless `show_progress(False)`); `columns`: rich's columns (default: description, bar, count),
    with the elapsed time added in a file where they have none."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = console or log_console()
    progress = _BARS["on"] if progress is None else progress
    if interactive(console):
        return Progress(*(columns or ()), console=console, disable=not progress, transient=True)

    class LoggedProgress(Progress):
        """Writes the bars' lines into the log when `LOG_EVERY_S` passed since it last did (checked as they move)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.logged_at = self.get_time()

        def update(self, task_id, **kwargs) -> None:
            super().update(task_id, **kwargs)
            self.log_now()

        def advance(self, task_id, advance: float = 1) -> None:
            super().advance(task_id, advance)
            self.log_now()

        def log_now(self) -> None:
            finished = all(task.finished for task in self.tasks)  # its last line is written when it stops
            if not (self.disable or finished) and self.get_time() - self.logged_at >= LOG_EVERY_S:
                self.logged_at = self.get_time()
                self.console.print(self.make_tasks_table(self.tasks))

    elapsed = any(isinstance(c, TimeElapsedColumn) for c in columns or ())
    columns = (*columns, *[TimeElapsedColumn()] * (not elapsed)) if columns else (
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), MofNCompleteColumn(),
        TimeElapsedColumn())  # what finished, how long
    return LoggedProgress(*columns, console=console, disable=not progress, transient=False)


def log_console():
    """The rich console of what a command says while it works (stage rules, progress bars, skip lines): stderr, so
    that stdout keeps its results; quiet on the other processes of a launch (the main process reports). In a file
    its lines are not wrapped at 80 columns (a path split over two lines is not found by grep)."""
    from rich.console import Console

    console = Console(stderr=True, quiet=env_rank() != 0)
    console.soft_wrap = not interactive(console)
    return console


_CLOSING: list = []  # the exit handler that destroys the process group, once registered


def _state(cpu: bool):
    """accelerate's process state (it starts the process group: gloo on the CPU, NCCL on CUDA)."""
    import torch.distributed as dist
    from accelerate import PartialState

    forming = not dist.is_initialized()
    try:
        state = PartialState(cpu=cpu, timeout=JOIN_TIMEOUT if forming else TIMEOUT)
        if forming and dist.is_initialized():  # everyone joined (NCCL connects lazily: the barrier makes it)
            state.wait_for_everyone()
            dist.distributed_c10d._set_pg_timeout(TIMEOUT)
            dist.distributed_c10d._get_default_store().set_timeout(TIMEOUT)
    except dist.DistError as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise ConnectionError(
            f"launch: process {env_rank()} of {os.environ.get('WORLD_SIZE')} did not meet the others at {where} "
            f"within {int(JOIN_TIMEOUT.total_seconds())} s ({str(exc).splitlines()[0]}); a process that stopped "
            "before joining says why in its own log (on its machine)") from None
    if not _CLOSING:  # once: a process that exits with its group alive may abort in gloo's threads (SIGABRT)
        _CLOSING.append(atexit.register(state.destroy_process_group))
    if (state.device.type == "cpu") != cpu:
        raise ValueError(f"device: this process already runs on {state.device.type}; one launch uses one kind of "
                         "device")
    return state


class Ranks:
    """This process's place in its launch: `index` of `size`, `is_main`, and the collectives oal needs. With one
    process every collective is the identity."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.index, self.size, self.state = 0, 1, None
        if launched():
            unsupported = [k for k in SHARDING_ENV if os.environ.get(k, "false").lower() == "true"]
            if unsupported:
                raise ValueError(f"accelerate config: {', '.join(unsupported)} is set, but oal runs plain data "
                                 "parallelism (every process holds the whole model); use distributed_type: MULTI_GPU")
            self.state = _state(torch.device(device).type == "cpu")
            self.index, self.size = self.state.process_index, self.state.num_processes

    @property
    def is_main(self) -> bool:
        return self.index == 0

    def broadcast(self, obj: T) -> T:
        """The main process's `obj` on every process (pickled: keep tensors on the CPU)."""
        if self.size == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        return self._talk(broadcast_object_list, [obj])[0]

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every process (pickled: keep tensors on the CPU)."""
        if self.size == 1:
            return [obj]
        from accelerate.utils import gather_object

        return self._talk(gather_object, [obj])

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over the processes, the same tensor on every one of them."""
        if self.size == 1:
            return tensor
        from accelerate.utils import reduce

        return self._talk(reduce, tensor.to(self.state.device), "sum").to(tensor.device)

    def _talk(self, collective: Callable, *args):
        with peer_errors():
            return collective(*args)

    def agree(self, values: dict, options: dict[str, str] | None = None) -> None:
        """Refuse, on every process alike (InputError), a launch whose processes hold different `values` (name ->
        a picklable value: settings, hashes of their data): each would compute its own result while the collectives
        mixed them. `options`: the command-line option of a name, named in the error."""
        if self.size == 1:
            return
        from oal.errors import InputError

        every = self.gather(values)
        for rank, theirs in enumerate(every[1:], 1):
            differ = sorted(k for k in {*every[0], *theirs} if every[0].get(k) != theirs.get(k))
            if differ:
                name = differ[0]
                raise InputError(f"the processes of this launch differ in {', '.join(differ)} (process 0: "
                                 f"{_short(every[0].get(name))}, process {rank}: {_short(theirs.get(name))}); start "
                                 "every process with the same command, model and data", (options or {}).get(name))

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the main process only; every process returns its result or raises its error (so a bad input
        found there stops the whole launch with the same message, and no process runs ahead of its writes)."""
        if self.size == 1:
            return fn()
        outcome: tuple = (None, None)
        if self.is_main:
            try:
                outcome = (fn(), None)
            except Exception as exc:  # re-raised below, on every process
                outcome = (None, exc)
        result, error = self.broadcast(outcome)
        if error is not None:
            if self.is_main:
                raise error
            error.oal_from_main = True  # the main process reports it (`reports_error`)
            raise error from None
        return result


# what torch's backends say when a peer has gone (gloo: 'Connection closed by peer', a plain RuntimeError)
_PEER_GONE = re.compile(r"gloo|NCCL|[Cc]onnection (closed|reset|refused)|[Tt]imed out")


@contextlib.contextmanager
def peer_errors():
    """Collectives (DDP's included) inside: a failure because another process of the launch stopped becomes a
    ConnectionError of one line (each survivor prints it, marked with its rank), not a traceback."""
    import torch.distributed as dist

    try:
        yield
    except RuntimeError as exc:
        if not dist.is_initialized() or not (isinstance(exc, dist.DistError) or _PEER_GONE.search(str(exc))):
            raise  # one process, or not the backend's: as it is
        text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(exc).split()))  # gloo's '[.../pair.cc:553] ' in front
        raise ConnectionError(f"launch: lost contact with another process of this launch ({text.split('. ')[0]}); "
                              "it stopped: its own log (or torchrun's summary) says why") from None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_RANKS: dict[str, Ranks] = {}


def ranks(device: torch.device | str | None = None) -> Ranks:
    """This process's `Ranks`, made on first use; `device` says whether the launch runs on the CPU or on CUDA (a
    later call with the other kind is a ValueError)."""
    from oal.device import resolve_device

    dev = resolve_device(device or "auto")
    if "this" not in _RANKS:
        _refuse_one_process_launch()
        _RANKS["this"] = Ranks(dev)
    elif _RANKS["this"].state is not None:
        _state(dev.type == "cpu")
    return _RANKS["this"]


def _requested_processes(argv: list[str]) -> int | None:
    """The --num_processes (or --num-processes) value in a launcher's command line, if any."""
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            value = arg[len(flag) + 1:] if arg.startswith(flag + "=") else argv[i + 1] if (
                arg == flag and i + 1 < len(argv)) else None
            if value is not None:
                try:
                    return int(value)
                except ValueError:
                    return None
    return None


def _refuse_one_process_launch() -> None:
    """`accelerate launch --cpu --num_processes N` starts one process (its simple launcher; it sets no WORLD_SIZE),
    so oal would train alone while N were asked for: refuse it (ValueError), with the launchers that start N CPU
    processes. The request is read from the launcher's command line (/proc, Linux); elsewhere nothing is said."""
    if launched() or "ACCELERATE_USE_CPU" not in os.environ:  # not accelerate's one-process launcher
        return
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return
    asked = _requested_processes(argv)
    if asked is not None and asked > 1:
        raise ValueError(f"--num_processes {asked}: accelerate launch --cpu starts 1 process, not {asked} (its "
                         f"one-process launcher); for {asked} CPU processes run `torchrun --nproc_per_node {asked} "
                         f"$(which oal) ...` (or `accelerate launch --multi_gpu --num_processes {asked}`, which runs "
                         "on the CPU with gloo on a machine without a GPU)")


def process_device(spec: str | torch.device | None) -> torch.device:
    """`--device` for this process: as `oal.device.resolve_device`, except that under a launch of several processes
    on CUDA each process takes its own GPU (cuda:LOCAL_RANK, as the launcher assigned it)."""
    from oal.device import resolve_device

    dev = resolve_device(spec)
    if not launched() or dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: a launch of several processes runs on the CPU or on CUDA, not {dev.type!r}")
    if dev.index is not None:
        raise ValueError(f"device: under a launch of several processes each process uses its own GPU "
                         f"(cuda:LOCAL_RANK); pass --device cuda or auto, not {str(spec)!r}")
    return ranks(dev).state.device


def training_accelerator(device: torch.device, grad_accum: int):
    """The `accelerate.Accelerator` of one adaptation: DDP across the processes of a launch (nothing to wrap for one
    process), gradient accumulation over `grad_accum` micro-batches. oal places the model itself (`--device`) and
    keeps its own precision rules (`--dtype`, oal.device), so accelerate's device placement and autocast are off."""
    from accelerate import Accelerator

    ranks(device)  # the process group, with oal's timeout, before accelerate would start one with its own
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if asked != "no":
        log.warning("accelerate config: mixed_precision=%s is not used; the base model's precision is oal's --dtype "
                    "(kernels and LoRA stay float32)", asked)
    acc = Accelerator(cpu=device.type == "cpu", device_placement=False, mixed_precision="no",
                      gradient_accumulation_steps=grad_accum)
    if acc.gradient_accumulation_steps != grad_accum:  # an accelerate config file set its own
        raise ValueError(f"grad_accum: the accelerate config sets gradient_accumulation_steps="
                         f"{acc.gradient_accumulation_steps}, oal's setting is {grad_accum}; use --grad-accum only")
    if acc.distributed_type.value not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        raise ValueError(f"accelerate config: distributed_type {acc.distributed_type.value} is not supported by "
                         "oal adapt; use plain data parallelism (torchrun, or accelerate launch --multi_gpu)")
    return acc
