"""Provenance of a base model: the SHA256 of its folder's files and of its tensors, and the check that a model is
the one an artefact was computed from (`check_base_model`). Provenance is read from the files actually loaded, never
from the name the user typed."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from oal.errors import InputError
from oal.rundir.hashes import sha256_file

__all__ = ["check_base_model", "file_sha256", "hash_model_dir", "model_dtype", "state_dict_sha256", "weights_record"]


HASHED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken")


# Converted layers keep their method under `self_attn.oal_method`; a base-model fingerprint leaves them out.
_METHOD_KEY = ".oal_method."


def file_sha256(path: str | Path) -> str:
    p = Path(path).resolve()
    st = p.stat()
    return _sha256_cached(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    # keyed on size and mtime so a 1 GB weight file is hashed once per process, yet changes are seen
    return sha256_file(path)


def hash_model_dir(path: str | Path) -> dict[str, str]:
    """SHA256 of every config / weight / tokenizer file in a model folder (sorted by name)."""
    path = Path(path)
    return {p.name: file_sha256(p) for p in sorted(path.iterdir())
            if p.is_file() and p.suffix in HASHED_SUFFIXES}


def state_dict_sha256(model: nn.Module, dtype: torch.dtype | str | None = None, *, kernels: bool = False) -> str:
    """SHA256 of a model's tensors: every state-dict entry (name, dtype, shape, bytes) in name order.

    Converted layers' kernel tensors (`self_attn.oal_method.*`) are left out unless `kernels=True`, so a base model
    and the same model after `oal.convert` have one fingerprint. With `dtype`, floating tensors are first cast to
    it: a float32 model then matches the fingerprint of its bfloat16 copy, while a bfloat16 model cast up does not
    match the float32 original (it has lost the low bits).
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if (_METHOD_KEY in name and not kernels) or not torch.is_tensor(t):
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_dtype(model: nn.Module) -> str:
    """The dtype of a model's first floating parameter, as a name ("float32")."""
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return "float32"


def weights_record(model: nn.Module) -> dict:
    """{"state_dict_sha256", "dtype"}: the fingerprint `check_base_model` compares, taken in the model's dtype."""
    dtype = model_dtype(model)
    return {"state_dict_sha256": state_dict_sha256(model, dtype), "dtype": dtype}


def _short(h) -> str:
    return str(h)[:12] if h else "none"


def check_base_model(recorded: Mapping, model: nn.Module, provenance: Mapping | None = None, *,
                     where: str = "the artefact") -> None:
    """Refuse `model` unless it is the base model that `recorded` (an artefact's base-model record) names.

    `recorded` holds `state_dict_sha256` and `dtype` (the tensors) and `hashes` (file name -> SHA256). The model's
    tensors must match; with `provenance` (from `load_model`), its folder must hold exactly the recorded files with
    the recorded hashes. Raises ValueError naming both sides (`where` names the record).
    """
    name = recorded.get("name_or_path") or "?"
    want = recorded.get("state_dict_sha256")
    if not want:
        raise ValueError(f"{where}: records no fingerprint of its base model's weights (written by an older oal "
                         "or from bare methods): pass provenance= to oal.save_kernels, or recalibrate")
    dtype = recorded.get("dtype")
    have = state_dict_sha256(model, dtype)
    label = (provenance or {}).get("model") or getattr(getattr(model, "config", None), "_name_or_path", None) or "?"
    if have != want:
        own = model_dtype(model)
        message = (f"the weights of {label!r} (sha256 {_short(have)}) differ from the base model recorded in "
                   f"{where} ({name!r}, sha256 {_short(want)})")
        if dtype and own != dtype:  # the dtype asked for is at fault, not the model: the error names --dtype
            raise InputError(f"{message}; that record is of the model in {dtype} and this one is {own}: load it "
                             f"with dtype={dtype} (--dtype {dtype})", "--dtype", "dtype")
        raise ValueError(f"base_model: {message}")
    files = recorded.get("hashes")
    if provenance is not None and files:
        got = provenance.get("sha256") or {}
        changed = sorted(f for f in set(files) & set(got) if files[f] != got[f])
        missing, extra = sorted(set(files) - set(got)), sorted(set(got) - set(files))
        if changed or missing or extra:
            parts = [f"{what} {fs}" for what, fs in (("changed", changed), ("missing", missing),
                                                      ("not recorded", extra)) if fs]
            raise ValueError(f"base_model: the files of {label!r} differ from those recorded in {where} "
                             f"({name!r}): {'; '.join(parts)}")
