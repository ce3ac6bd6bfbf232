"""The builtin corpus's layout, kept in the user's cache so that each process does not parse the standard library
again (4-6 s on a 2-core machine, for every `oal run` and `oal.linearize` on the builtin corpus).

An entry is named by a key over everything the layout is computed from: the Python version, the source of the code
that computes it (`oal.data.corpus`) and the SHA256 of every file it reads (the stdlib files and pydoc's topics).
Its record holds the key and the layout file's SHA256; a reader recomputes the key from the files as they are now,
checks the layout file against the record, and builds the layout again (one warning) where either differs.
`oal.data.corpus` calls this module with its inputs and its builder (this module imports nothing of it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from oal.rundir.hashes import sha256_file
from oal.rundir.user_cache import (
    SHARED_FILE,
    cache_root,
    clean_stale,
    file_problem,
    make_folder,
    read_record,
    work_dir,
    write_record,
)

__all__ = ["cached_layout", "layout_key"]

log = logging.getLogger("oal")

FOLDER = "corpus"


def layout_key(code: Path, files: Sequence[Path], root: Path) -> str:
    """SHA256 (first 16 hex) over the Python version, the source file `code` and each of `files` in order (its name
    below `root` and its SHA256)."""
    h = hashlib.sha256(sys.version.encode())
    h.update(code.read_bytes())
    for path in files:
        h.update(f"\n{path.relative_to(root).as_posix()}:{sha256_file(path)}".encode())
    return h.hexdigest()[:16]


def _record(path: Path) -> Path:
    return path.with_name(path.name.replace(".layout.json", ".json"))


def _read(path: Path, splits: Sequence[str]) -> dict | None:
    """The layout at `path` when it has the layout's shape, else None (a file whose SHA256 matches its record but
    that was put there by hand)."""
    try:
        layout = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = (isinstance(layout, dict) and isinstance(layout.get("splits"), dict)
          and all(isinstance(layout["splits"].get(s), str) for s in splits)
          and isinstance(layout.get("pretrain_start"), int) and isinstance(layout.get("units"), dict))
    return layout if ok else None


def _drop_superseded(folder: Path, kept: Path) -> None:
    """Remove the entries of this Python version other than `kept` (made from other code or other stdlib files), so
    the folder holds one entry per Python version."""
    for record in folder.glob("builtin-*.json"):
        if record.name.endswith(".layout.json"):
            continue
        layout = record.with_name(record.name.replace(".json", ".layout.json"))
        if layout == kept:
            continue
        found = read_record(record)
        if found is None or found.get("python") == sys.version:
            for p in (record, layout):
                p.unlink(missing_ok=True)


def cached_layout(build: Callable[[], dict], code: Path, files: Sequence[Path], root: Path, splits: Sequence[str],
                  folder: Path | None = None) -> dict:
    """`build()`, the builtin corpus's layout ({"splits": {name: text for name in splits}, "pretrain_start",
    "units"}) computed by `code` from `files`, read from the user's cache when an entry for these inputs verifies,
    else built and written there (atomically; a cache that cannot be written only costs the next process the time)."""
    try:
        folder = cache_root(FOLDER) if folder is None else folder
        key = layout_key(code, files, root)
    except (OSError, ValueError) as exc:  # an unreadable input, one outside `root`, or no cache folder: no cache
        log.info("the builtin corpus is not cached (%s)", exc)
        return build()
    path = folder / f"builtin-{key}.layout.json"
    problem = file_problem(path, _record(path), key=key)
    if problem is None:
        layout = _read(path, splits)
        if layout is not None:
            return layout
        problem = "not a layout of the builtin corpus"
    if problem != "missing":
        log.warning("%s: %s; building the builtin corpus again", path, problem)
    layout = build()
    try:
        make_folder(folder)
        clean_stale(folder)
        with work_dir(folder, path.name) as tmp:
            out = tmp / path.name
            out.write_text(json.dumps(layout), encoding="utf-8")
            os.chmod(out, SHARED_FILE)  # as every file of the cache, whatever the umask
            write_record(_record(path), {"key": key, "sha256": sha256_file(out), "python": sys.version})
            os.replace(out, path)
        _drop_superseded(folder, path)
    except OSError as exc:
        log.warning("could not cache the builtin corpus in %s (%s); it is built again in the next process", folder,
                    exc.strerror or exc)
    return layout
