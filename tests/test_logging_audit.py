"""What a command writes while it works, as a user's log file, terminal and Ctrl-C meet it: log lines and notes in
a file are whole lines (grep finds a path), a bar on a dumb terminal leaves its line, `oal --no-progress` reaches
the bars of a command without its own --progress, --verbose shows transformers' warnings, and a Ctrl-C while torch
imports ends the process with the one line."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

SRC = Path(__file__).resolve().parents[1] / "src"
LONG = "/tmp/" + "a_run_directory_whose_name_goes_on_and_on_" * 3 + "end"


@pytest.fixture
def oal_logger():
    """The "oal" logger and transformers' verbosity as they were: setup_logging changes both."""
    import transformers

    log = logging.getLogger("oal")
    saved = log.handlers[:], log.level, log.propagate, transformers.logging.get_verbosity()
    yield log
    log.handlers[:], log.level, log.propagate = saved[:3]
    transformers.logging.set_verbosity(saved[3])


def test_a_log_message_in_a_file_is_one_line(oal_logger, capsys):
    """In a log file rich's handler wrapped a message at 80 columns and folded a long path mid-name: `grep RUN_DIR`
    found half of it."""
    from oal.cli.app import setup_logging

    setup_logging(logging.INFO)
    oal_logger.info("%s: using oal with its calibrated kernels only (the run has no adapter for it)", LONG)
    line = f"INFO     {LONG}: using oal with its calibrated kernels only (the run has no adapter for it)"
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_note_in_a_file_is_one_line(capsys):
    """`wrote DIR/groups.json, ... and DIR/figures` was wrapped at 80 columns, a path split over two lines."""
    from oal.cli.consoles import notes_console

    notes_console().print(f"wrote {LONG}/groups.json and {LONG}/figures")
    assert capsys.readouterr().err.splitlines() == [f"wrote {LONG}/groups.json and {LONG}/figures"]


def test_a_bar_on_a_dumb_terminal_leaves_its_line():
    """On TERM=dumb (an editor's shell) rich draws nothing while a bar runs, and the transient bar left nothing
    either: a whole stage ran without a trace."""
    from oal.launch import progress_bar

    screen = io.StringIO()
    console = Console(file=screen, width=120, force_terminal=True, _environ={"TERM": "dumb"})
    with progress_bar(console=console) as bar:
        task = bar.add_task("capture", total=4)
        for _ in range(4):
            bar.advance(task)
    assert "capture" in screen.getvalue() and "4/4" in screen.getvalue()


@pytest.mark.parametrize("root, shown", [([], True), (["--no-progress"], False), (["--quiet"], False)])
def test_no_progress_reaches_a_command_without_its_own_progress(tmp_path, monkeypatch, oal_logger, root, shown):
    """`oal --no-progress diagnose` ("no progress bars in any command") still drew Table 1's and Fig. 2(b)'s bars:
    diagnose has no --progress of its own, and its bars did not ask."""
    import oal.diagnostics.runner
    from oal.cli import load_commands
    from oal.launch import progress_bar

    seen = []

    def diagnose(*args, console=None, **kwargs):  # the real runner opens its bars so
        with progress_bar(console=console) as bar:
            seen.append(not bar.disable)

    monkeypatch.setattr(oal.diagnostics.runner, "diagnose", diagnose)
    res = CliRunner().invoke(load_commands(), [*root, "diagnose", "--out", str(tmp_path / "d"), "--parts", "offset",
                                               "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert seen == [shown]
    with progress_bar(console=Console(file=io.StringIO())) as bar:  # the library's default again afterwards
        assert not bar.disable


@pytest.mark.parametrize("level, shown", [(logging.DEBUG, logging.WARNING), (logging.INFO, logging.ERROR),
                                          (logging.WARNING, logging.ERROR)])
def test_verbose_shows_transformers_warnings(oal_logger, level, shown):
    """`oal -v` ("debug messages too") changed nothing: oal logs no debug message, and transformers' warnings, kept
    quiet as noise by default, could not be seen at all."""
    import transformers

    from oal.cli.app import setup_logging

    setup_logging(level)
    assert transformers.logging.get_verbosity() == shown


_CTRL_C_IN_TORCH = """
import importlib, os, signal, time
import oal.cli as cli

real = importlib.import_module

def import_module(name, *args):
    if name == "oal.cli.demo":  # torch imports dill like this: a KeyboardInterrupt there becomes another error
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except:  # noqa: E722
            raise ModuleNotFoundError("No module named 'version'")
    return real(name, *args)

importlib.import_module = import_module
cli.main()
"""


def test_ctrl_c_while_torch_imports_says_so_in_one_line():
    """A Ctrl-C in the first seconds of `oal demo`, inside torch's import, printed a ModuleNotFoundError traceback
    (dill turns the KeyboardInterrupt into one); other times it was swallowed (the command ran on, or hung on the
    import lock), or C++ aborted. Now the process ends there with the one line and 130."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TORCH, "demo", "--length", "8"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.startswith("Interrupted. Nothing half-written is left") and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_adaptation_and_calibration_bars_write_lines_in_a_log_file(monkeypatch, tmp_path):
    """Their bars were plain rich bars, not `launch.progress_bar`: in a log file `oal calibrate` wrote nothing for
    its 3 min 44 s and an adaptation only its last line; a tail of the log could not tell a moving stage from a hung
    one."""
    import oal.adaptation.train as train
    from oal import launch

    log = io.StringIO()
    monkeypatch.setattr(launch, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(train, "log_console", lambda: Console(file=log, width=200))
    with train._progress(True) as bar:
        task = bar.add_task("adapt oal", total=3, loss="-", val="-")
        for step in range(3):
            bar.update(task, advance=1, loss=f"{2.5 - step:.2f}", val="3.10")
    lines = [line for line in log.getvalue().splitlines() if "adapt oal" in line]
    assert len(lines) >= 3 and "loss 0.50" in lines[-1] and "val NLL 3.10" in lines[-1]
    # calibration's bar, in a log file: its line with the layers done
    import torch

    from oal.calibration.data import CalibConfig
    from oal.calibration.resume import calibrate_layers

    class Stop(Exception):
        pass

    def capture(layer):
        raise Stop  # the bar is open by now; what it wrote is what matters here

    log = io.StringIO()
    with pytest.raises(Stop):
        calibrate_layers(["oal"], [0], capture, groups={0: torch.zeros(1, 4, dtype=torch.long)}, cfg=CalibConfig(),
                         seed=0, progress=True, console=Console(file=log, width=200))
    assert "calibrate layer 0: oal" in log.getvalue() and "0/1" in log.getvalue()
