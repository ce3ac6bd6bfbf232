"""Where a command writes while it works: stage rules, progress bars and notes go to stderr (stdout keeps its
results), silent under `oal --quiet` and on the other processes of a launch."""

from __future__ import annotations

__all__ = ["notes_console"]


def notes_console():
    """The console of what a command says while it works (stage rules, progress bars, skip lines): stderr; silent
    under `oal --quiet` and on a launch's other processes."""
    from rich.console import Console

    from oal.cli.app import quiet
    from oal.launch import env_rank

    return Console(stderr=True, quiet=env_rank() != 0 or quiet())
