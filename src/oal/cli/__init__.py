"""The `oal` command line. Each command lives in its own module under `oal.cli` and registers on `app`."""

from __future__ import annotations

import importlib
import sys

from oal.cli.app import INTERRUPTED, app
from oal.cli.consoles import quit_on_ctrl_c

# One module per command (or small family of commands); each adds its commands to `app` on import.
_COMMAND_MODULES = ("demo", "analyze", "calibrate", "convert", "evaluate", "generate", "run", "adapt", "diagnose",
                  "export", "select_layers", "fetch", "tune")


def load_commands():
    """Register every command on `app` and return it (tests invoke it with typer's CliRunner)."""
    for mod in _COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    return app


def main() -> None:
    try:
        with quit_on_ctrl_c():  # torch's import: a KeyboardInterrupt inside it may be swallowed or hang the process
            commands = load_commands()
    except KeyboardInterrupt:  # Ctrl-C while the commands import torch, before `app` handles it: the same line
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    commands(prog_name="oal")
