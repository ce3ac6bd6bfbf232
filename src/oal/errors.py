"""The one exception type for bad input that knows which argument it is about.

Library code raises `ValueError` for bad input (the project's convention), its message starting with the argument's
name. Where the library also knows which command-line option a value came from, it raises `InputError` (a
ValueError) with `param` set, so the CLI can name the option (`--data`, `--model`, ...) in its one-line error.
"""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Bad input. str(): "arg: message" (the library argument); `param`: the CLI option ("--model"), if any."""

    def __init__(self, message: str, param: str | None = None, arg: str | None = None):
        self.message, self.param, self.arg = message, param, arg
        arg = arg or (param.lstrip("-").replace("-", "_") if param else None)
        super().__init__(f"{arg}: {message}" if arg else message)

    def __reduce__(self):  # pickled whole (not just str()) when it travels between processes (oal.distributed)
        return type(self), (self.message, self.param, self.arg)
