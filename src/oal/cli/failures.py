"""How the command line reports a failed command: the one line of an error of bad input, and a reader gone away."""

import typer

__all__ = ["bad_input_message", "drop_stdout"]


def bad_input_message(exc: Exception) -> str | None:
    """The one-line message of an error of bad input, or None for anything else (a bug: keep its traceback)."""
    from oal.errors import InputError
    from oal.models.folders import ModelUnavailableError

    if isinstance(exc, typer.TyperException) and hasattr(exc, "format_message"):  # typer's (vendored click) errors
        return exc.format_message()
    if isinstance(exc, InputError) and exc.param:
        return f"Invalid value for '{exc.param}': {exc.message}"
    if isinstance(exc, (ValueError, OSError, ModelUnavailableError)):
        return str(exc)
    return None


def drop_stdout() -> None:
    """Point stdout at /dev/null, as rich does on a broken pipe, so that the interpreter's last flush stays quiet."""
    import os
    import sys

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (a test runner's)
        pass
