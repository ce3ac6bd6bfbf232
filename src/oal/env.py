"""oal's on/off switches in the environment (OAL_CPU_KERNEL, OAL_NO_TUNE, OAL_DEBUG, ...), read one way: unset or
empty gives the default; "0", "false", "no" and "off" (any case) are off; any other value is on. (Each switch read
its own way: OAL_CPU_KERNEL=false left the kernel on, OAL_NO_TUNE=false turned tuning off.)"""

from __future__ import annotations

import os

__all__ = ["OFF", "flag"]

OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """The switch `name` of the environment (see the module)."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in OFF
