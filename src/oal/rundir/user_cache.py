"""The user's cache folder for what oal derives once and reuses (dequantised GGUF models, fetched model files):
`$OAL_CACHE_DIR`, else `$XDG_CACHE_HOME/oal`, else `~/.cache/oal`."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root(*parts: str) -> Path:
    """The folder `cache_root("gguf")` etc., not created."""
    base = os.environ.get("OAL_CACHE_DIR")
    if base:
        root = Path(base).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "oal"
    return root.joinpath(*parts)
