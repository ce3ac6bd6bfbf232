"""Writes stay inside the directory a command owns: no symbolic link turns a run directory against its owner.

A command that owns a directory (`oal run`, `oal adapt`, `oal evaluate`, `oal select-layers`: its `--out`) enters
`confined(DIR)` once, together with the directory's lock (`rundir.lock.own_dir`). While it is active, every write,
rename and delete of `rundir.files` (atomic files and folders, `remove`, `make_dirs`, `clean_tmp`) passes its path
through `inside`, which resolves every symbolic link on the way (the last component included) and refuses a path that
then lies outside DIR, or one that is not below DIR at all. So a link such as `DIR/.oal/checkpoints -> /elsewhere`
stops the command with one line before anything is written there, and nothing outside DIR is ever created, replaced
or deleted. `escaping_links(DIR)` lists such links up front, so a command refuses them before any work.

Outside any `confined` block nothing is checked: a library caller chooses its own paths.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from oal.errors import InputError

__all__ = ["confined", "escaping_links", "inside"]

_ROOTS: ContextVar[tuple[Path, ...]] = ContextVar("oal_confined_roots", default=())


def _absolute(path: str | Path) -> Path:
    """`path` made absolute without resolving links ('..' folded lexically)."""
    return Path(os.path.normpath(os.path.abspath(path)))


def _below(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@contextlib.contextmanager
def confined(root: str | Path) -> Iterator[Path]:
    """Allow writes below `root` only (nested blocks: below the innermost root, and inside every enclosing one)."""
    root = _absolute(root)
    token = _ROOTS.set((*_ROOTS.get(), root))
    try:
        yield root
    finally:
        _ROOTS.reset(token)


def _first_link(path: Path, root: Path) -> Path | None:
    """The first symbolic link on the way from `root` down to `path` (for the message), or None."""
    probe = root
    for part in path.relative_to(root).parts:
        probe = probe / part
        if probe.is_symlink():
            return probe
    return None


def inside(path: str | Path, what: str = "write") -> Path:
    """`path` (absolute) when the current command may `what` it; InputError on --out otherwise.

    A path below a confining root must still lie below that root once every symbolic link is resolved."""
    active = _ROOTS.get()
    if not active:
        return Path(path)
    path = _absolute(path)
    if not _below(path, active[-1]):
        raise InputError(f"{path} is outside the directory this command owns ({active[-1]}); refusing to {what} it",
                         "--out", "out_dir")
    real = Path(os.path.realpath(path))
    for root in active:
        if _below(path, root) and not _below(real, Path(os.path.realpath(root))):
            link = _first_link(path, root) or path
            target = os.path.realpath(link)
            raise InputError(f"{link} is a symbolic link to {target}, outside {root}; oal does not {what} through "
                             "a link that leaves its directory: remove the link (or move its target inside)",
                             "--out", "out_dir")
    return path


def escaping_links(root: str | Path, limit: int = 4) -> list[tuple[Path, str]]:
    """Up to `limit` symbolic links below `root` that resolve outside it, as (link, target); links are not
    followed while walking."""
    root = _absolute(root)
    real_root = Path(os.path.realpath(root))
    found: list[tuple[Path, str]] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in (*dirs, *files):
            p = Path(folder) / name
            if p.is_symlink():
                target = os.path.realpath(p)
                if not _below(Path(target), real_root):
                    found.append((p, target))
                    if len(found) >= limit:
                        return found
    return found
