"""The user's input, read one way: the exception type for bad input that knows which argument it is about, the
checks of configuration values (dict keys, name lists, integers) that raise it, and the environment's on/off
switches (`env_flag`).

Library code raises `ValueError` for bad input (the project's convention), its message starting with the argument's
name. Where the library also knows which command-line option a value came from, it raises `InputError` (a
ValueError) with `param` set, so the CLI can name the option (`--data`, `--model`, ...) in its one-line error.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re

__all__ = ["ENV_OFF", "InputError", "ModelUnavailableError", "SelectionSizeError", "check_int", "env_flag",
           "from_known_keys", "message_of", "parse_names"]


class InputError(ValueError):
    """Bad input. str(): "arg: message" (the library argument); `param`: the CLI option ("--model"), if any."""

    def __init__(self, message: str, param: str | None = None, arg: str | None = None):
        self.message, self.param, self.arg = message, param, arg
        arg = arg or (param.lstrip("-").replace("-", "_") if param else None)
        super().__init__(f"{arg}: {message}" if arg else message)

    def __reduce__(self):  # pickled whole (not just str()) when it travels between processes (oal.launch)
        return type(self), (self.message, self.param, self.arg)


class ModelUnavailableError(RuntimeError):
    """A hub model that is neither reachable nor in the local cache (`oal.models.folders`)."""


class SelectionSizeError(InputError):
    """`auto:K` asks for more layers than the model has candidates; `k` and `limit` let a command that takes K under
    another option (`oal select-layers --k`) word the error its own way."""

    def __init__(self, k: int, limit: int, param: str = "--layers"):
        self.k, self.limit = k, limit
        super().__init__(f"expected auto:K with K <= {limit} (the candidate layers), got auto:{k}", param, "layers")

    def __reduce__(self):
        return type(self), (self.k, self.limit, self.param)


def message_of(exc: Exception, about: str | None = None) -> str:
    """`exc`'s message without the library argument named in front ("name_or_path: ...", "indices: ..."): for a
    command's error, which names its own option. `about` (a path, a name) goes in front unless the message names
    it already."""
    text = exc.message if isinstance(exc, InputError) else re.sub(r"^[a-z_]+: ", "", str(exc))
    return text if about is None or str(about) in text else f"{about}: {text}"


ENV_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """oal's on/off switch `name` in the environment (OAL_CPU_KERNEL, OAL_NO_TUNE, ...), read one way for all: unset or
    empty gives `default`; "0", "false", "no" and "off" (any case) are off; any other value is on. (Each switch read
    its own way: OAL_CPU_KERNEL=false left the kernel on, OAL_NO_TUNE=false turned tuning off.)"""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ENV_OFF


def check_int(name: str, value, low: int) -> int:
    """`value` when it is an integer >= `low` (a bool is not); ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def from_known_keys(cls, d: dict, label: str):
    """Build dataclass `cls` from dict `d`, refusing keys it does not have (a typo must not pass silently)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{label}: unknown keys {sorted(unknown)}; expected some of {sorted(known)}")
    return cls(**d)


def parse_names(spec: str | list | tuple, known: tuple[str, ...], label: str) -> list[str]:
    """'a,b' (or a list) -> ['a', 'b'] in order, without repeats; 'all' stands for every name in `known`."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    out: list[str] = []
    for item in (i for i in items if i):
        for name in (known if item == "all" else (item,)):
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"{label}: unknown {label.rstrip('s')} {name!r}; expected some of {', '.join(known)} "
                                 f"or 'all'{hint}")
            if name not in out:
                out.append(name)
    return out
