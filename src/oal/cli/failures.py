"""How the command line reports a failed command: the one line of an error of bad input, and a reader gone away."""

import re

import typer

__all__ = ["bad_input_message", "drop_stdout"]


def bad_input_message(exc: Exception, options=()) -> str | None:
    """The one-line message of an error of bad input, or None for anything else (a bug: keep its traceback).
    `options`: the command's option names; a message naming '--method' where the command has --methods names it."""
    message = _message(exc, options)
    if message is None:
        return None
    # typer's 'Invalid value for --grouping: grouping: ...' -> once
    return re.sub(r"^(Invalid value for '?--([\w-]+)'?: )([\w-]+): ",
                  lambda m: m[1] if m[3].replace("_", "-") == m[2] else m[0], message)


def _message(exc: Exception, options) -> str | None:
    from oal.errors import InputError
    from oal.models.folders import ModelUnavailableError

    if isinstance(exc, typer.TyperException) and hasattr(exc, "format_message"):  # typer's (vendored click) errors
        return exc.format_message()
    if isinstance(exc, InputError) and exc.param:
        # a library function shared by commands names '--method'; this command may take --methods
        typed = exc.param + "s" if exc.param not in options and exc.param + "s" in options else exc.param
        if options and typed not in options:  # another command's option ('--lengths' under oal run --passkey)
            return exc.message
        return f"Invalid value for '{typed}': {exc.message}"
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
