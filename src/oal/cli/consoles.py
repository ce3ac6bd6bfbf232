"""Where a command writes while it works: stage rules, progress bars, notes and log messages go to stderr (stdout
keeps its results), silent under `oal --quiet` and on the other processes of a launch; in a file or on a dumb
terminal one line per message, not wrapped at 80 columns."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

__all__ = ["INTERRUPTED", "QUIET", "notes_console", "quiet", "quit_on_ctrl_c", "setup_logging"]

INTERRUPTED = ("Interrupted. Nothing half-written is left; the same command again resumes from its last checkpoint "
               "(or starts over where it keeps none).")
QUIET = {"on": False}  # `oal --quiet`, set by the root options (oal.cli.app)


def quiet() -> bool:
    """True under `oal --quiet`: a command's notes, stage rules and progress bars stay off (warnings still show)."""
    return QUIET["on"]


def notes_console():
    """The console of what a command says while it works (stage rules, progress bars, skip lines): stderr; silent
    under `oal --quiet` and on a launch's other processes."""
    from oal.launch import log_console

    console = log_console()
    console.quiet = console.quiet or quiet()
    return console


class _Stderr(logging.StreamHandler):
    """'LEVEL    message' on one line, on the sys.stderr of the moment (a test runner swaps it)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: int) -> None:
    """`oal` messages on stderr (stdout keeps a command's results): rich's handler on a terminal, one plain line per
    message in a file (rich wrapped them at 80 columns, splitting paths). transformers' progress bars stay off, its
    warnings show under --verbose only (its advice is noise here; oal checks the loads that matter itself)."""
    from rich.console import Console
    from rich.logging import RichHandler

    from oal.launch import env_rank, interactive

    console = Console(stderr=True)
    log = logging.getLogger("oal")
    log.handlers[:] = [RichHandler(console=console, show_path=False, show_time=False, markup=False)
                       if interactive(console) else _Stderr()]
    log.setLevel(level if env_rank() == 0 else max(level, logging.ERROR))  # a launch's other processes: errors only
    log.propagate = False
    with quit_on_ctrl_c():
        import transformers

    transformers.utils.logging.set_verbosity(logging.WARNING if level <= logging.DEBUG else logging.ERROR)
    transformers.utils.logging.disable_progress_bar()


@contextmanager
def quit_on_ctrl_c():
    """Ctrl-C while third-party modules import ends the process at once, with the one line and exit code 130: a
    KeyboardInterrupt inside torch's import was swallowed (dill's bare except; the command then ran on, or hung on
    the import lock it left held), turned into a ModuleNotFoundError traceback, or aborted in C++."""
    def stop(_signum, _frame):
        os.write(2, f"{INTERRUPTED}\n".encode())  # not sys.stderr: the signal may come in the middle of its write
        os._exit(130)

    if (threading.current_thread() is not threading.main_thread()  # where no signal arrives
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # ignored (nohup), or the caller's
        yield
        return
    signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
