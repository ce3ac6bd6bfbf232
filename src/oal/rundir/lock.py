"""One writer per directory: the lock every command that writes a folder holds while it runs (`oal run`, `adapt`,
`evaluate`, `select-layers`, `analyze`, `calibrate`, `diagnose`, `oal.linearize(out_dir=)`).

`own_dir(DIR)` takes an exclusive `flock` on `DIR/.oal.lock` (created with DIR when missing) and confines every
write to DIR (`rundir.confine`). A second command on the same directory is refused at once with one line that names
the holder (its pid and command line, from /proc/locks where there is one); it never waits. The kernel releases the
lock when its process ends, however it ends, so a killed run leaves no stale lock: the next command takes it.
Nested `own_dir` calls of one process on a directory it already holds only confine (`oal adapt` calling the
pipeline); a folder below it (a seed's `seed-<s>/` under `oal run --seeds`) takes its own lock, so that no other
command writes that folder meanwhile. Under a launch of several processes only the main process writes, so only it
locks and is confined, and its refusal reaches every process (`group=`; the others write nothing below DIR:
calibration's scratch capture of a process other than the main one goes to a private temporary folder).

The lock file stays in place when released (another process may be opening it); `clear_run` does not delete it.
On a platform without `fcntl` (Windows) no lock is taken, with a warning.

A folder written outside any run directory (an export) takes no such lock: `locked_atomic_dir` fills it in a
temporary folder that it flock-s, so that the next writer of the same folder removes what a killed one left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from oal.errors import InputError
from oal.rundir.confine import confined, escaping_links, inside
from oal.rundir.files import atomic_dir, flock

__all__ = ["LOCK_FILE", "locked_atomic_dir", "own_dir"]

log = logging.getLogger("oal")

LOCK_FILE = ".oal.lock"
# scratch folders whose stages remove their own entries (adaptation checkpoints): left empty, they go on release
SCRATCH = (Path(".oal") / "checkpoints",)
_HELD: set[str] = set()  # realpaths of the directories this process holds


def _holder(fd: int) -> str:
    """' (pid N: its command line)' of the process holding the flock on `fd`'s file, from /proc/locks (Linux; ''
    elsewhere). The lock file itself stays empty, so that a refused command changes no byte of the directory."""
    try:
        inode = os.fstat(fd).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and fields[-3].rsplit(":", 1)[-1] == str(inode):
                pid = fields[-4]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f" (pid {pid}: {cmd.strip()[:160]})"
    except (OSError, IndexError, ValueError):
        pass
    return ""


def _acquire(path: Path) -> int | None:
    """The fd of DIR's lock file, locked; InputError when another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        log.warning("%s: no directory lock on this platform; do not run two oal commands on it at once", path)
        return None
    lock = inside(path / LOCK_FILE)
    while True:
        try:  # flock needs no write access: an existing lock file is only opened (a refused command writes nothing)
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise InputError(f"{path} is in use by another oal process{who}: wait for it to finish, or use another "
                             f"--out (its lock: {lock})", "--out", "out_dir") from None
        # the file may have been replaced between open and flock: lock the one that is in place
        if os.path.exists(lock) and os.stat(lock).st_ino == os.fstat(fd).st_ino:
            return fd
        os.close(fd)


def _take(path: Path) -> tuple[bool, int | None, list[Path]]:
    """(this process held `path` already, the locked fd, the folders it created for `path`, deepest first): refuse
    links that leave `path`, then lock it."""
    with confined(path):
        links = escaping_links(path) if path.is_dir() else []
        if links:
            shown = "; ".join(f"{p} -> {t}" for p, t in links[:3])
            raise InputError(f"{path} holds symbolic links that leave it ({shown}); oal writes only inside its "
                             "directory: remove them, or copy their targets in", "--out", "out_dir")
        key = os.path.realpath(path)
        if key in _HELD:  # an enclosing command of this process holds it
            return True, None, []
        created = [] if path.is_dir() else [p for p in (path, *path.parents) if not p.exists()]
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)  # another process may create it meanwhile
        if not os.access(path, os.W_OK):  # else the first write failed, naming a temporary file
            raise InputError(f"{path} is not writable (a read-only folder or file system): copy it somewhere "
                             "writable, or use another --out", "--out", "out_dir")
        fd = _acquire(path)
        _HELD.add(key)
        return False, fd, created


def _remove_if_unused(path: Path, created: list[Path]) -> None:
    """A command that wrote nothing (refused) leaves no folder behind: the lock file, then the folders it created for
    `path`, while it still holds the lock."""
    try:
        if created and {p.name for p in path.iterdir()} == {LOCK_FILE}:
            os.unlink(path / LOCK_FILE)
            for p in created:
                p.rmdir()
    except OSError:  # another process wrote there meanwhile: keep it
        pass


def _remove_empty_scratch(path: Path) -> None:
    """Remove the scratch folders (SCRATCH) left empty below `path` (a link or a non-empty folder stays)."""
    for folder in SCRATCH:
        with contextlib.suppress(OSError):  # a command that wrote nothing touches nothing (no rmdir attempted)
            if (path / folder).is_dir() and not (path / folder).is_symlink() and not any((path / folder).iterdir()):
                os.rmdir(path / folder)


@contextlib.contextmanager
def own_dir(path: str | Path, group=None) -> Iterator[Path]:
    """Hold `path`'s lock and confine writes to it for the duration of the block (the main process of `group`, an
    `oal.launch.Ranks`, when given: its refusal reaches every process, and the others only wait).

    Refused (InputError on --out) when another process holds the lock, or when a symbolic link below `path` leads
    outside it (oal would write or delete through it). Without `group` under a launch of several processes (a
    command that runs in one process: each process would take the lock for itself, and the one refused would stop
    the launch, often without a word), refused on every process before anything is locked."""
    from oal.launch import launched

    if group is None and launched():
        raise InputError("this command runs in one process: run it without torchrun / accelerate launch (oal run, "
                         "adapt, calibrate and select-layers are the commands that run under them; "
                         "docs/guides/distributed.md)")
    path = Path(path)
    held, fd, created = group.on_main(lambda: _take(path)) if group is not None else _take(path)
    if group is not None and not group.is_main:  # writes nothing below `path` (its scratch: a private temp folder)
        yield path
        return
    try:
        with confined(path):
            yield path
    finally:
        if not held:
            _remove_empty_scratch(path)
            _remove_if_unused(path, created)
            _HELD.discard(os.path.realpath(path))
            if fd is not None:
                os.close(fd)  # releases the flock


# ----------------------------------------------------------------------------------------------- exports


@contextlib.contextmanager
def locked_atomic_dir(path: str | Path) -> Iterator[Path]:
    """`rundir.files.atomic_dir(path)` with its temporary folder flock-ed until it is swapped in, for a folder that
    no run lock covers (an export): the temporary folders of `path` that a killed writer left (lock free) are removed
    first, never a running writer's. Each is made and locked under the parent folder's lock, which the cleanup takes
    too, so no cleanup sees one before its lock."""
    import fcntl

    path = inside(Path(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [os.close(fd) for fd in fds])  # runs after atomic_dir's swap: held until then
        with flock(path.parent):
            _remove_abandoned(path)
            tmp = stack.enter_context(atomic_dir(path))
            fds.append(os.open(tmp, os.O_RDONLY))
            fcntl.flock(fds[0], fcntl.LOCK_EX)
        yield tmp


def _remove_abandoned(path: Path) -> None:
    """Remove `path`'s temporary folders (`.NAME.<8 random>.tmp`, as atomic_dir names them) that no process holds."""
    import fcntl

    name = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")
    removed = 0
    for p in path.parent.iterdir():
        if not name.fullmatch(p.name) or p.is_symlink() or not p.is_dir():
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:  # removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(p, ignore_errors=True)
            removed += not p.exists()  # a folder oal cannot write in keeps it
        except BlockingIOError:  # a running writer's
            pass
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d temporary folder(s) that an interrupted oal process left beside %s", removed, path)
