"""Hashes that bind a run's artefacts to what they were made from: files, folders, tensors, configurations, and the
versions of the libraries whose numerics the results depend on."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from oal.rundir.files import safetensors_metadata, to_jsonable

__all__ = ["RECORD_KEY", "config_hash", "header_binds", "record_hash", "record_header", "sha256_file", "sha256_files",
           "sha256_tree", "tensor_hash", "versions"]

RECORD_KEY = "record_sha256"  # the tensor file's header entry that binds the JSON record saved beside it


def tensor_hash(t: torch.Tensor) -> str:
    """SHA256 (first 16 hex) of a tensor's dtype, shape and bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def config_hash(obj) -> str:
    """SHA256 (first 16 hex) of the canonical JSON of `obj`."""
    blob = json.dumps(obj, sort_keys=True, default=to_jsonable, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def record_hash(record) -> str:
    """The SHA256 of a JSON record as a reader sees it (written and parsed back: tuples are lists, keys strings),
    canonical: what a tensor file's metadata binds, so that the record beside it cannot change unseen (callers
    leave out the record's own field with the tensor file's SHA256: each binds the other)."""
    parsed = json.loads(json.dumps(record, default=to_jsonable))
    blob = json.dumps(parsed, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def record_header(record) -> dict[str, str]:
    """The safetensors metadata that binds `record` to the tensor file saved with it."""
    return {RECORD_KEY: record_hash(record)}


def header_binds(path: str | Path, record) -> bool | None:
    """Whether the tensor file at `path` was saved with `record` (`record_header`); None when its header binds no
    record (a file saved before records were bound)."""
    bound = safetensors_metadata(path).get(RECORD_KEY)
    return None if bound is None else bound == record_hash(record)


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


# the distributions behind the names recorded: oal is installed as `oal-attention` (`oal` on PyPI is another project)
_DISTRIBUTIONS = {"oal": "oal-attention"}


def versions() -> dict[str, str]:
    """Versions of the interpreter and of the libraries whose numerics the results depend on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for mod in ("torch", "transformers", "peft", "safetensors", "datasets", "numpy", "oal"):
        try:
            out[mod] = version(_DISTRIBUTIONS.get(mod, mod))
        except (PackageNotFoundError, ValueError):  # not installed: record the absence rather than fail a run
            out[mod] = "absent"
    return out
