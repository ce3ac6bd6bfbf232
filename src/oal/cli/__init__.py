"""The `oal` command line. Each command lives in its own module under `oal.cli` and registers on `app`."""

from __future__ import annotations

import importlib

from .app import app

# One module per command group; each adds its commands to `app` on import.
_COMMAND_MODULES = ("demo", "analyze", "run", "diagnose", "convert")


def main() -> None:
    for mod in _COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    app()
