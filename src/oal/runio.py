"""Run-directory I/O: atomic writes, config hashes, stage-done markers and provenance.

Every file of a run directory is written to a temporary name in the same folder and renamed into place, so a
killed process leaves either the old file or the new one, never half of one (`clean_tmp` removes the temporary
names a kill leaves behind). A stage records a marker (`DIR/.oal/stages.json`) with the hash of everything it read
(its key) and the SHA256 of every file it wrote; a rerun skips it only when the key matches *and* those files still
hash the same, so a damaged output is recomputed rather than trusted. Readers of JSON and safetensors files raise a
ValueError that names the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import InputError

__all__ = [
    "atomic_dir",
    "atomic_save_safetensors",
    "atomic_write_json",
    "atomic_write_text",
    "check_out_dir",
    "clean_tmp",
    "config_hash",
    "existing_dir",
    "load_json",
    "load_safetensors",
    "sha256_file",
    "sha256_files",
    "sha256_tree",
    "StageLog",
    "tensor_hash",
    "versions",
]


log = logging.getLogger("oal")


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
                raise ValueError(f"{label}: unknown {label.rstrip('s')} {name!r}; expected some of {', '.join(known)} "
                                 "or 'all'")
            if name not in out:
                out.append(name)
    return out


def _tmp_path(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(name)


def _replace(tmp: Path, path: Path) -> None:
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; run outputs are ordinary readable files
    os.replace(tmp, path)


def atomic_write(path: str | Path, write) -> Path:
    """Call `write(tmp)` on a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        write(tmp)
        _replace(tmp, path)
    finally:
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


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def atomic_write_json(path: str | Path, obj) -> Path:
    """JSON with sorted keys and a trailing newline (stable bytes for stable hashes)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")


def load_json(path: str | Path):
    """Parse a JSON file; a missing, unreadable or damaged file is a ValueError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: damaged, not valid JSON ({exc})") from None


def atomic_save_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata=None) -> Path:
    """safetensors needs contiguous, non-shared tensors: clone them (they are small: adapters, factors)."""
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
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


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Fill a fresh temporary directory, then swap it in for `path` (old contents removed only afterwards)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)  # also a stale one left by a kill between the renames
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tensor_hash(t: torch.Tensor) -> str:
    """SHA256 (first 16 hex) of a tensor's dtype, shape and bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def existing_dir(path: str | Path) -> Path | None:
    """`path`, or the previous version `atomic_dir` keeps while swapping (a kill can land between the renames)."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    return path if path.is_dir() else (old if old.is_dir() else None)


def config_hash(obj) -> str:
    """SHA256 (first 16 hex) of the canonical JSON of `obj`."""
    blob = json.dumps(obj, sort_keys=True, default=_jsonable, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(folder: str | Path, suffixes=(".safetensors", ".json", ".txt", ".model", ".bin")) -> dict:
    """SHA256 of the model-defining files of a local checkpoint folder (relative name -> hash)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in suffixes}


def sha256_tree(root: str | Path, rel: str | Path) -> dict[str, str]:
    """SHA256 of `root/rel` (a file), or of every file below it (a folder), keyed by path relative to `root`.

    A missing path gives {} (so a removed output shows up as a difference).
    """
    root = Path(root)
    path = root / rel
    if path.is_file():
        return {str(Path(rel)): sha256_file(path)}
    if path.is_dir():
        return {str(p.relative_to(root)): sha256_file(p) for p in sorted(path.rglob("*"))
                if p.is_file() and not p.name.endswith(".tmp")}
    return {}


def clean_tmp(run_dir: str | Path) -> list[Path]:
    """Remove the temporary files and folders (`.NAME.*.tmp`) a killed process left below `run_dir`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    stale = sorted((p for p in run_dir.rglob(".*.tmp")), key=lambda p: len(p.parts), reverse=True)
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
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


def versions() -> dict[str, str]:
    """Versions of the interpreter and of the libraries whose numerics the results depend on."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for mod in ("torch", "transformers", "peft", "safetensors", "datasets", "numpy", "oal"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:  # not installed: record the absence rather than fail a run
            out[mod] = "absent"
    return out


class StageLog:
    """Stage-done markers in `DIR/.oal/stages.json`: stage -> {key, outputs, sha256, inputs, elapsed_s, finished}.

    `done(stage, key)` is True only when the stage finished with the same key (the hash of its configuration and
    of the files it read) and every file it wrote still has the SHA256 recorded when it finished.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".oal" / "stages.json"
        self.stages: dict = load_json(self.path) if self.path.exists() else {}
        if not isinstance(self.stages, dict) or not all(isinstance(v, dict) for v in self.stages.values()):
            raise ValueError(f"{self.path}: damaged, expected a JSON object of stage records")
        self._verified: set[str] = set()

    def outputs_hash(self, outputs) -> dict[str, str]:
        out: dict[str, str] = {}
        for o in outputs:
            out.update(sha256_tree(self.run_dir, o))
        return out

    def damaged(self, stage: str) -> list[str]:
        """Recorded outputs of `stage` that are missing or whose SHA256 changed (all of them without a record)."""
        rec = self.stages.get(stage) or {}
        want = rec.get("sha256")
        if not isinstance(want, dict) or not want:
            return [str(o) for o in rec.get("outputs", [])] or ["(no recorded outputs)"]
        have = self.outputs_hash(rec.get("outputs", []))
        return sorted(f for f in set(want) | set(have) if want.get(f) != have.get(f))

    def done(self, stage: str, key: str) -> bool:
        rec = self.stages.get(stage)
        if rec is None or rec.get("key") != key:
            return False
        if stage in self._verified:
            return True
        bad = self.damaged(stage)
        if bad:
            log.warning("stage %s: %s changed or missing since it finished (SHA256 differs from %s); recomputing",
                        stage, ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else ""), self.path)
            return False
        self._verified.add(stage)
        return True

    def mark(self, stage: str, key: str, elapsed_s: float, outputs=(), inputs: dict | None = None, **extra) -> None:
        outputs = [str(o) for o in outputs]
        self.stages[stage] = {"key": key, "outputs": outputs, "sha256": self.outputs_hash(outputs),
                              **({"inputs": inputs} if inputs else {}),
                              "elapsed_s": round(float(elapsed_s), 3),
                              "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}
        self._verified.add(stage)
        atomic_write_json(self.path, self.stages)

    def forget(self, stage: str) -> None:
        self._verified.discard(stage)
        if self.stages.pop(stage, None) is not None:
            atomic_write_json(self.path, self.stages)

    def elapsed(self) -> dict[str, float]:
        return {k: v["elapsed_s"] for k, v in self.stages.items()}


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
