"""The user's cache folder for what oal derives once and reuses (dequantised GGUF models, fetched model files,
compiled kernels, tuned settings): `$OAL_CACHE_DIR`, else `$XDG_CACHE_HOME/oal`, else `~/.cache/oal`.

Nothing read from it is trusted as found: what oal writes there comes with a record of the SHA256 of every file,
written with it (`write_record`), and a reader checks the files against it (`changed_file`) and rebuilds what differs.
Work in progress lives in temporary folders (`work_dir`) that hold a lock while their process runs, so the next use
removes what a killed process left (`clean_stale`) and never a running one's: a folder is created and locked while
its process holds a lock on the parent folder itself, which a cleanup also takes, so none sees a new folder before
its lock. An entry that several processes may fill at once (a dequantised model, the tuning file) is filled under
its own lock (`entry_lock`): the others wait, then use what the first wrote. A reader opens only regular files
(`regular_problem`): a FIFO put where a file was would block its read for ever. Records and the folders made here
are readable by all whatever the umask (SHARED_FILE, SHARED_DIR: `write_record`, `make_folder`), and writers give
what they write the same modes, so that a cache one user fills serves the others.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from oal.rundir.files import flock
from oal.rundir.hashes import sha256_file

__all__ = ["SHARED_DIR", "SHARED_FILE", "WRITE_ERRNOS", "CacheWriteError", "cache_root", "cache_writes", "changed_file",
           "checked_file", "clean_stale", "entry_lock", "file_problem", "files_sha256", "make_folder", "probe_writable",
           "read_record", "regular_problem", "work_dir", "write_record"]

log = logging.getLogger("oal")

TMP_SUFFIX = ".tmp"  # every temporary name oal makes in the cache: ".<label>.<random>.tmp"
_LOCK = ".lock"  # inside a temporary folder: flock-ed by the process filling it
# A temporary entry without a lock (a file, or a folder of an oal that took none) is stale once this old: longer
# than any single write or compile (the C++ build's timeout is 300 s).
STALE_S = 900
SHARED_FILE, SHARED_DIR = 0o644, 0o755  # the modes of what the cache holds, whatever the umask


def cache_root(*parts: str) -> Path:
    """The folder `cache_root("gguf")` etc., not created. CacheWriteError when there is no home folder to put it in
    and neither variable names one."""
    try:
        base = os.environ.get("OAL_CACHE_DIR")
        if base:
            root = Path(base).expanduser()
        else:
            xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
            # the XDG spec: a relative path is invalid and ignored (else each working folder got a cache of its own)
            root = (xdg if xdg.is_absolute() else Path.home() / ".cache") / "oal"
    except RuntimeError:  # no $HOME and a user id without a passwd entry (`env -i`, a container's --user 1234)
        raise CacheWriteError("no folder for oal's cache: $HOME is not set and this user has no home folder; set "
                              "OAL_CACHE_DIR to a writable folder") from None
    return root.joinpath(*parts)


# ----------------------------------------------------------------------------------------------- failed writes


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a write failed for want of room
WRITE_ERRNOS = (*FULL_ERRNOS, errno.EROFS)  # ... or of write access


class CacheWriteError(OSError):
    """A write into the user's cache failed (read-only, full, a file in the way). Its message names the folder and
    OAL_CACHE_DIR: the cache, not the model or data being written, is what the user must change."""


@contextlib.contextmanager
def cache_writes(what: str, folder: Path) -> Iterator[None]:
    """Turn an OSError (or safetensors' error of a failed write) in the block into a CacheWriteError about writing
    `what` into `folder`."""
    from safetensors import SafetensorError

    try:
        yield
    except CacheWriteError:
        raise
    except (OSError, SafetensorError) as exc:
        reason = (exc.strerror if isinstance(exc, OSError) and exc.strerror else " ".join(str(exc).split()))
        full = (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS) or "space" in reason
        advice = "free space there, or set OAL_CACHE_DIR to a folder with room" if full else \
            "set OAL_CACHE_DIR to a writable folder"
        raise CacheWriteError(f"cannot write {what} into the cache folder {folder} ({reason}); {advice}") from None


def probe_writable(folder: Path, what: str, room: int = 1 << 16) -> None:
    """CacheWriteError now, before any long work, when `folder` cannot be created or written, or has no `room`
    bytes free (a full disk still makes an empty file)."""
    with cache_writes(what, folder):
        make_folder(folder)
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(bytes(room))
            f.flush()
            os.fsync(f.fileno())  # a file system that allocates late (NFS) says "full" here


def make_folder(folder: Path) -> None:
    """`folder` and its missing parents, those made here SHARED_DIR: under umask 077 they were 0700, and another
    user of a shared cache could not reach the 0644 files inside."""
    made, p = [], folder
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    for p in made:
        with contextlib.suppress(OSError):  # made by another user's process meanwhile: theirs to set
            os.chmod(p, SHARED_DIR)


# ----------------------------------------------------------------------------------------------- file records


def regular_problem(path: Path) -> str | None:
    """None when `path` is a regular file (a link to one included), else why not, in a few words: "missing", "not a
    regular file (a FIFO)". Checked before a read: opening a FIFO waits for a writer that never comes."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file where a folder above it should be
        return "missing"
    except OSError as exc:  # a loop of links, a folder it may not enter
        return f"unreadable ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return f"not a regular file ({next((kind for test, kind in kinds if test(mode)), 'a device')})"


def files_sha256(folder: Path, hasher: Callable[[Path], str] = sha256_file, skip: tuple[str, ...] = ()) -> dict:
    """{relative path: SHA256} of every file below `folder` (links and the names in `skip` aside)."""
    return {p.relative_to(folder).as_posix(): hasher(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.relative_to(folder).as_posix() not in skip}


def write_record(path: Path, record: dict) -> None:
    """`record` as JSON at `path`, written to a temporary name and renamed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.chmod(tmp, SHARED_FILE)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_record(path: Path) -> dict | None:
    """The JSON object at `path`, or None (missing, unreadable, damaged, not an object, not a regular file)."""
    if regular_problem(path) is not None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def changed_file(folder: Path, recorded, hasher: Callable[[Path], str] = sha256_file,
                 skip: tuple[str, ...] = ()) -> str | None:
    """None when the files below `folder` are exactly those of `recorded` ({relative path: SHA256}), else which
    differs first and how ("config.json was changed", "x.json was added", "tokenizer.json is missing",
    "config.json is not a regular file (a FIFO)")."""
    if not isinstance(recorded, dict) or not recorded:
        return "the record lists no files"
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir() or p.is_symlink()}
    found -= set(skip)
    for name in sorted(found | set(recorded)):
        path = folder / name
        if name not in recorded:
            return f"{name} was added"
        if name not in found:
            return f"{name} is missing"
        if path.is_symlink():
            return f"{name} was changed"
        problem = regular_problem(path)
        if problem is not None:  # before the hash, which would wait for ever on a FIFO
            return f"{name} is {problem}" if problem.startswith("not") else f"{name}: {problem}"
        try:
            if hasher(path) != recorded[name]:
                return f"{name} was changed"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
    return None


def file_problem(path: Path, record_path: Path, **expected) -> str | None:
    """None when `path` is the file that the record at `record_path` describes (its SHA256, and the value of every
    field in `expected`), else why not: "missing", or a few words that a warning can quote."""
    return checked_file(path, record_path, **expected)[0]


def checked_file(path: Path, record_path: Path, **expected) -> tuple[str | None, str]:
    """(`file_problem`, the SHA256 it checked: "" when it read none), for a caller that records the hash of the file
    it then uses without reading it a second time."""
    problem = regular_problem(path)
    if problem is not None:
        return problem, ""
    record = read_record(record_path)
    if record is None:
        return f"no record of how it was built ({record_path.name} missing, damaged or not a regular file)", ""
    if any(record.get(name) != value for name, value in expected.items()):
        return "its record names other inputs", ""
    try:
        sha = sha256_file(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror})", ""
    return (None, sha) if record.get("sha256") == sha else ("its SHA256 is not the one recorded when it was written",
                                                            sha)


# ----------------------------------------------------------------------------------------------- temporaries


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Hold `entry`'s lock (`.<name>.lock` beside it) for the block: a cache entry that several processes may fill at
    once is filled by one, while the others wait (then find it filled)."""
    make_folder(entry.parent)
    lock = entry.parent / f".{entry.name}.lock"
    with flock(lock, wait=False) as free:
        if free:
            yield
            return
    log.info("waiting for another oal process that is writing %s", entry)
    with flock(lock):
        yield


@contextlib.contextmanager
def work_dir(parent: Path, label: str) -> Iterator[Path]:
    """A fresh temporary folder `.<label>.<random>.tmp` in `parent`, locked while the block runs and removed after
    it (what the block renames out of it stays). Stale ones in `parent` are removed first."""
    make_folder(parent)
    clean_stale(parent)
    with flock(parent):  # a cleanup in another process must not see the folder before its lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{label}.", suffix=TMP_SUFFIX, dir=parent))
        fd = os.open(tmp / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def _held(folder: Path) -> bool | None:
    """Whether a running process holds `folder`'s lock; None when it has no lock file."""
    try:
        fd = os.open(folder / _LOCK, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the lock taken just now
    return False


def clean_stale(parent: Path, legacy: tuple[str, ...] = (".fetch.",)) -> list[Path]:
    """Remove the temporary entries in `parent` that no running process uses: a folder whose lock is free, a file
    (or a folder without a lock: names starting with `legacy` included, those of earlier versions) older than
    STALE_S. Returns what was removed."""
    if not parent.is_dir():
        return []
    try:
        with flock(parent, wait=False) as free:
            return _clean(parent, legacy) if free else []  # another process is making a folder: clean next time
    except OSError:  # a folder oal cannot write: nothing to clean there either
        return []


def _clean(parent: Path, legacy: tuple[str, ...]) -> list[Path]:
    removed = []
    now = time.time()
    for p in parent.iterdir():
        if not (p.name.startswith(".") and (p.name.endswith(TMP_SUFFIX) or p.name.startswith(legacy))):
            continue
        held = _held(p) if p.is_dir() and not p.is_symlink() else None
        with contextlib.suppress(OSError):
            if held is False or (held is None and now - p.lstat().st_mtime > STALE_S):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()
                removed.append(p)
    if removed:
        log.info("removed %d temporary file(s) an interrupted oal process left in %s", len(removed), parent)
    return removed
