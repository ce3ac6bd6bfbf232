"""The result file of one diagnostics part (`DIR/diagnostics/<part>.json`): written with the key of what it was
computed from and the SHA256 of its own content, and reused only when both still hold.

A part's key alone let an edited result file be served as computed (its table and figure redrawn from the edited
numbers); the content hash makes such a file, or a damaged one, count as not done, so the part runs again.
"""

from __future__ import annotations

import logging
from pathlib import Path

from oal.rundir.files import atomic_write_json, load_json
from oal.rundir.hashes import record_hash

__all__ = ["done_part", "write_part"]

log = logging.getLogger("oal")
_CONTENT = "content_sha256"


def write_part(path: Path, data: dict) -> dict:
    """Write `data` (which holds its "settings_key") with the SHA256 of its content; returns what was written."""
    data = {k: v for k, v in data.items() if k != _CONTENT}
    data[_CONTENT] = record_hash(data)
    atomic_write_json(path, data)
    return data


def done_part(path: Path, key: str) -> dict | None:
    """The part's results at `path` if they were computed for `key` and are unchanged since; None otherwise."""
    if not path.is_file():
        return None
    try:
        data = load_json(path)
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("settings_key") != key:
        return None
    if data.get(_CONTENT) != record_hash({k: v for k, v in data.items() if k != _CONTENT}):
        log.warning("%s changed after it was written (or predates its content hash): computing it again", path)
        return None
    return data
