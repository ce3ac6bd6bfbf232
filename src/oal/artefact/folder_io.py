"""What the exports of a run (`artefact.export`, `artefact.softmax_export`) do alike when they write a folder: refuse
to replace a folder that is not an export, save the tokenizer with a true length, cast the base weights, and keep
machine paths out of what they record."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["cast_base_weights", "save_tokenizer", "without_paths", "writable_target"]


def writable_target(to: Path) -> None:
    """Refuse to replace a folder that is not an export, or the current folder (or one above it): `atomic_dir`
    swaps the whole folder."""
    from oal.models.pretrained import MANIFEST

    try:
        here = Path.cwd().resolve()
    except OSError:  # the current folder was removed: nothing to protect
        here = None
    if here is not None and (to.resolve() == here or to.resolve() in here.parents):
        raise ValueError(f"to: {to} is the current folder (or holds it), which an export would replace as a whole; "
                         "name a new folder instead, such as converted/")
    if to.exists() and (not to.is_dir() or (any(to.iterdir()) and not (to / MANIFEST).is_file())):
        raise ValueError(f"to: {to} exists and is not a converted-model folder; choose a new or empty folder")


def save_tokenizer(tokenizer, to: Path, max_positions: int | None) -> None:
    """The tokenizer, with a true model_max_length (the model's positions) where it says "no limit" (transformers'
    1e30), less what transformers saves of the load that made it (`models.gguf.drop_load_arguments`:
    `local_files_only: true` would follow the folder to a machine that is online); the tokenizer given is left as it
    was."""
    from oal.models.gguf import drop_load_arguments

    old = getattr(tokenizer, "model_max_length", None)
    if max_positions and isinstance(old, (int, float)) and old > 1e29:
        tokenizer.model_max_length = int(max_positions)
    try:
        tokenizer.save_pretrained(to)
    finally:
        if old is not None:
            tokenizer.model_max_length = old
    drop_load_arguments(to)


def cast_base_weights(model, dtype: torch.dtype) -> None:
    """The base model's floating parameters to `dtype`; kernel tensors keep theirs (fp32 factors, fp64 features)."""
    for name, p in model.named_parameters():
        if ".oal_method." not in name and p.is_floating_point():
            p.data = p.data.to(dtype)


def without_paths(record: dict) -> dict:
    """The kernels' base-model record with a local folder named by its last component only."""
    name = record.get("name_or_path")
    if isinstance(name, str) and Path(name).is_absolute():
        return {**record, "name_or_path": Path(name).name}
    return dict(record)
