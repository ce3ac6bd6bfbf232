"""Files of a run directory: atomic writes and the readers that name the file they fail on.

Every file of a run directory is written to a temporary name in the same folder and renamed into place, so a
killed process leaves either the old file or the new one, never half of one (`clean_tmp` removes the temporary
names a kill leaves behind). A write that fails for want of space (ENOSPC, a full quota) removes its temporary file
and raises an OSError naming the file. Readers of JSON and safetensors files raise a ValueError that names the file.

Every write, rename and delete here goes through `rundir.confine.inside`: under a command that owns a directory, no
path outside it (through a symbolic link or otherwise) is ever written, renamed or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from oal.errors import InputError
from oal.rundir.confine import inside

__all__ = ["atomic_dir", "atomic_save_figure", "atomic_save_safetensors", "atomic_write", "atomic_write_json",
           "atomic_write_text", "check_json_size", "check_out_dir", "clean_tmp", "existing_dir", "load_json",
           "load_safetensors", "DiskFull", "flock", "make_dirs", "remove", "safetensors_metadata", "to_jsonable"]

log = logging.getLogger("oal")


def _tmp_path(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def _replace(tmp: Path, path: Path) -> None:
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; run outputs are ordinary readable files
    # the data reaches the disk before the name does: after a crash or power loss the old file or the new one,
    # never an empty one under the new name (a kill alone never needs this: the rename is atomic)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFull(OSError):
    """A write that failed for want of space, naming the file (the CLI prints it as one line)."""


def _disk_error(exc: BaseException, path: Path) -> OSError | None:
    """A DiskFull naming `path` for a write that failed for want of space, else None. Writers report it their own
    way: an OSError, or (safetensors, through Rust) a SafetensorError whose message carries the OS error."""
    text = str(exc)
    full = (isinstance(exc, OSError) and exc.errno in _NO_SPACE) or "No space left" in text or "os error 28" in text
    if not full or isinstance(exc, DiskFull):  # already named by the innermost write
        return None
    return DiskFull(errno.ENOSPC, f"{path}: no space left on the device while writing it (nothing half-written was "
                    "kept); free some space and rerun")


def make_dirs(path: str | Path) -> Path:
    """`mkdir -p path`, inside the directory the command owns."""
    path = Path(path)
    inside(path, "create")
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove(path: str | Path) -> None:
    """Delete a file, a folder (with its contents) or a link itself (never what it points to); nothing if absent."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        inside(path.parent, "delete")  # the link's own folder: removing a link touches nothing it points to
        path.unlink(missing_ok=True)
    elif path.is_dir():
        inside(path, "delete")
        shutil.rmtree(path, ignore_errors=True)


def atomic_write(path: str | Path, write) -> Path:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    inside(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_path(path)
        write(tmp)
        _replace(tmp, path)
    except Exception as exc:
        full = _disk_error(exc, path)
        if full is None:
            raise
        raise full from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_save_figure(fig, path: str | Path, **savefig_kwargs) -> Path:
    """Write a matplotlib figure as PNG atomically, and close it."""
    import matplotlib.pyplot as plt

    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", **savefig_kwargs))
    finally:
        plt.close(fig)


def to_jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def strict_json(obj):
    """`obj` with every NaN / inf float as None (null): strict JSON parsers reject bare NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj) -> Path:
    """JSON with sorted keys and a trailing newline (stable bytes for stable hashes)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=to_jsonable) + "\n")


# The records oal writes are a few MB at most: a larger file (a downloaded run or export) is refused unread, rather
# than parsed into many times its size in memory.
MAX_JSON_BYTES = 256 << 20


def check_json_size(path: Path) -> None:
    """ValueError naming `path` when it is not a regular file (a FIFO or a device would block or never end) or is
    larger than any record oal writes (`MAX_JSON_BYTES`); FileNotFoundError when it is missing."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file; expected a JSON record")
    size = st.st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {size} bytes, larger than any JSON record oal writes ({MAX_JSON_BYTES} at most); "
                         "refusing to parse it")


def load_json(path: str | Path):
    """Parse a JSON file; a missing, unreadable, oversized or damaged file (nested too deep included) is a ValueError
    naming it."""
    path = Path(path)
    try:
        check_json_size(path)
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: damaged, not valid JSON ({exc})") from None
    except RecursionError:  # json's C parser recurses once per level of nesting
        raise ValueError(f"{path}: damaged, JSON nested too deeply to be a record of oal") from None


def atomic_save_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata=None) -> Path:
    """safetensors needs contiguous, non-shared tensors: clone them (they are small: adapters, factors). At most
    one metadata entry: safetensors writes its header's metadata in the order of a randomly seeded hash map, so two
    entries give other bytes from one process to the next, and a recomputed file would not verify as the same."""
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    if len(meta) > 1:
        raise ValueError(f"metadata: at most one entry keeps {Path(path).name}'s bytes reproducible, got "
                         f"{sorted(meta)}")
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file; a missing, truncated or damaged file is a ValueError naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: damaged or truncated safetensors file ({exc})") from None


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of a safetensors file's header (empty when it has none); ValueError naming a damaged
    file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: damaged or truncated safetensors file ({exc})") from None


@contextlib.contextmanager
def flock(path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path`, a folder or a file (created empty), for the block; with `wait=False` the block
    gets False, and no lock, when another process holds it."""
    fd = os.open(path, os.O_RDONLY if path.is_dir() else os.O_CREAT | os.O_RDONLY, 0o644)  # flock needs no write
    try:
        if not path.is_dir():  # readable by the other users of a shared cache, whatever the umask (not ours: theirs)
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Fill a fresh temporary directory, then swap it in for `path` (old contents removed only afterwards)."""
    path = Path(path)
    inside(path)
    old = path.with_name(f".{path.name}.old")
    inside(old)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        try:
            yield tmp
        except Exception as exc:
            full = _disk_error(exc, path)
            if full is None:
                raise
            raise full from None
        # one swap at a time in this folder: two processes writing `path` at once (two `oal export --to X`) each
        # moved `path` to the one `.old` name and one failed with 'Directory not empty'; the last swap now wins
        with flock(path.parent):  # the folder itself: no lock file beside the user's
            if path.exists():
                if old.exists():
                    shutil.rmtree(old)
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)  # also a stale one left by a kill between the renames
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def existing_dir(path: str | Path) -> Path | None:
    """`path`, or the previous version `atomic_dir` keeps while swapping (a kill can land between the renames)."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    return path if path.is_dir() else (old if old.is_dir() else None)


def clean_tmp(run_dir: str | Path) -> list[Path]:
    """Remove the temporary files and folders (`.NAME.*.tmp`) a killed process left below `run_dir`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    stale = []
    for folder, dirs, files in os.walk(run_dir, followlinks=False):  # never into a linked folder
        stale += [Path(folder) / n for n in (*dirs, *files) if n.startswith(".") and n.endswith(".tmp")]
        dirs[:] = [d for d in dirs if not (d.startswith(".") and d.endswith(".tmp"))]
    for p in stale:
        remove(p)
    if stale:
        log.info("removed %d temporary file(s) left by an interrupted run in %s", len(stale), run_dir)
    return stale


def check_out_dir(path: str | Path, param: str = "--out") -> Path:
    """`path` is usable as an output folder: not an existing file, and not below one. Creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path} is an existing file; expected a directory", param)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{parent} is a file, so {path} cannot be created below it", param)
            break
    return path


