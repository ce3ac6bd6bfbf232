"""Rebuild a converted model: `oal.load(DIR)` for an exported folder, `oal.load(RUN, base_model)` for a run's
calibrated kernels on their base model (checked against the record by tensors and files, no pickle anywhere)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oal.calibration.kernels import META_FILE, check_kernels_base, load_kernels, model_fingerprint, recorded_base_model
from oal.device import resolve_device, resolve_dtype
from oal.errors import InputError
from oal.models.folders import first_line
from oal.models.pretrained import read_json_object
from oal.rundir.confine import escaping_links

__all__ = ["load", "load_export", "load_with_tokenizer"]


def load(directory: str | Path, base_model: nn.Module | str | os.PathLike | None = None,
         **load_kwargs: Any) -> nn.Module:
    """Rebuild a converted model: from a converted model's folder, or from kernels on the base model they fit.

    The base model must be the one the kernels were calibrated on: a loaded model is checked by the SHA256 of its
    tensors (`models.provenance.state_dict_sha256`); a name/path goes through `oal.models.registry.load_model`
    and its folder must also hold exactly the files recorded at save time.

    Args:
        directory: without `base_model`, a converted model's folder (`oal export`, or `save_pretrained` of a
            converted model: `oal.linearize`'s result, `oal.convert`'s). With `base_model`, a kernels folder:
            what `oal.save_kernels` writes, `oal.linearize`'s `out_dir` (whichever method it converted to), or a
            run directory of `oal run` (its OAL kernels; `DIR/kernels/<method>` for another method).
        base_model: the base model of those kernels: a loaded HF model (converted in place) or a name/path.
        **load_kwargs: how to load: `dtype=`, `device=` (`oal.artefact.load.load_export`) for a converted folder,
            `load_model`'s options for a base model given by name; none for a loaded base model.

    Returns:
        the converted model (a converted folder's in eval mode).

    Raises:
        ValueError: a folder that is neither, a base model whose architecture or tensors differ from the
            kernels' record (or a converted model's folder given as one), files changed since they were saved,
            a device this torch cannot use, an option that does not apply.
    """
    if not isinstance(directory, (str, os.PathLike)):  # pathlib's TypeError named no argument
        raise ValueError(f"directory: expected a folder's path, got {type(directory).__name__}")
    if not Path(directory).is_dir():
        raise ValueError(f"directory: {directory} is not a folder (expected a converted model's folder, or a run's "
                         "kernels folder with base_model)")
    if "device" in load_kwargs:  # before any loading: `cuda` without a GPU was torch's AssertionError after it
        load_kwargs["device"] = resolve_device(load_kwargs["device"])
    if base_model is None:
        if not (Path(directory) / "config.json").is_file() and _kernel_folders(directory):
            raise ValueError(f"base_model: {directory} holds kernels, not a converted model; pass the base model "
                             "they were calibrated on: oal.load(directory, base_model)")
        return load_export(directory, **_known(load_export, load_kwargs))
    if not _kernel_folders(directory):  # "DIR/kernels.json: is missing" for a converted model's folder
        what = ("is a converted model's folder; load it without base_model: oal.load(directory)"
                if _converted_folder(directory) else f"holds no kernels ({META_FILE}, or kernels/<method>/{META_FILE}, "
                "as oal.save_kernels and oal.linearize's out_dir write them)")
        raise ValueError(f"directory: {directory} {what}")
    if isinstance(base_model, (str, os.PathLike)):
        _check_base_folder(base_model)
        from oal.models.encoder import is_encoder_model, load_encoder
        from oal.models.registry import load_model

        kwargs = _known(load_encoder if is_encoder_model(str(base_model)) else load_model, load_kwargs)
        if isinstance(kwargs.get("dtype"), str):  # as load_export takes it
            kwargs["dtype"] = resolve_dtype(kwargs["dtype"])
        try:
            return load_with_tokenizer(directory, str(base_model), **kwargs)[0]
        except InputError as exc:  # load_model's, naming its own argument (name_or_path)
            if exc.arg != "name_or_path":
                raise
            raise ValueError(f"base_model: {exc.message}") from None
    if not isinstance(base_model, nn.Module) or not hasattr(base_model, "config"):
        raise ValueError(f"base_model: expected an HF model or a name/path, got {type(base_model).__name__}")
    if load_kwargs:
        raise ValueError(f"load_kwargs: {sorted(load_kwargs)} set how a model is loaded, and base_model is already "
                         "loaded (convert it with .to() first)")
    return _convert_checked(directory, base_model, None)


def _known(fn, load_kwargs: dict) -> dict:
    """`load_kwargs` when `fn` takes each of them; ValueError naming the others (not a TypeError of `fn`)."""
    import inspect

    known = [k for k, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY]
    unknown = sorted(set(load_kwargs) - set(known))
    if unknown:
        raise ValueError(f"load_kwargs: {', '.join(unknown)} not among the options here ({', '.join(known)})")
    return load_kwargs


def _converted_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a converted model (config.json of an "oal_<family>" model_type)."""
    cfg = Path(folder) / "config.json"
    try:
        return cfg.is_file() and str(read_json_object(cfg, "config").get("model_type", "")).startswith("oal_")
    except ValueError:
        return False


def _check_base_folder(base_model: str | os.PathLike) -> None:
    """A base model given by path is not a converted model's folder nor a kernels folder (load_model's error named
    `name_or_path` and an unsupported architecture, or a missing config.json)."""
    folder = Path(base_model).expanduser()
    if not folder.is_dir():
        return
    if _converted_folder(folder):
        raise ValueError(f"base_model: {folder} is a converted model's folder; pass the base model the kernels were "
                         "calibrated on (or load that folder alone: oal.load(folder))")
    if _kernel_folders(folder):
        raise ValueError(f"base_model: {folder} is a kernels folder; pass the base model they were calibrated on")


def _kernels_folder(directory: str | Path) -> Path:
    """The folder of `directory`'s kernels: `directory` itself when it holds kernels.json, else its one
    `kernels/<method>/` (what `oal.linearize` keeps for a method other than "oal"); ValueError naming them where
    there are several. Where there is none, `directory` (`load_kernels` says what is missing)."""
    directory = Path(directory)
    found = _kernel_folders(directory)
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"directory: {directory} holds the kernels of several methods "
                         f"({', '.join(p.name for p in found)}); pass one of {[str(p) for p in found]}")
    return directory


def _kernel_folders(directory: str | Path) -> list[Path]:
    """[`directory`] when it holds kernels.json, else its `kernels/<method>/` folders that do (sorted)."""
    directory = Path(directory)
    if (directory / META_FILE).is_file():
        return [directory]
    return sorted(p.parent for p in (directory / "kernels").glob(f"*/{META_FILE}"))


def load_with_tokenizer(directory: str | Path, base_model: str | None = None, **load_kwargs):
    """(converted model, tokenizer, provenance): the base model `base_model` (default: the one recorded in
    kernels.json) loaded by `load_model` (a local encoder folder: `models.encoder.load_encoder`), checked against
    the record (tensors and files), then converted."""
    from oal.models.encoder import is_encoder_model, load_encoder
    from oal.models.registry import load_model

    directory = _kernels_folder(directory)
    name = base_model or recorded_base_model(directory) or "default"
    model, tokenizer, provenance = (load_encoder if is_encoder_model(name) else load_model)(name, **load_kwargs)
    return _convert_checked(directory, model, provenance), tokenizer, provenance


def _convert_checked(directory, base_model: nn.Module, provenance: Mapping | None) -> nn.Module:
    directory = _kernels_folder(directory)
    for link, target in escaping_links(directory, limit=1):
        raise ValueError(f"{link}: a symbolic link to {target}, outside {directory}; oal reads a kernels folder "
                         "from its own files only")
    methods, meta = load_kernels(directory, fingerprint=model_fingerprint(base_model))
    check_kernels_base(directory, meta, base_model, provenance)
    n_layers = model_fingerprint(base_model)["num_hidden_layers"]
    if any(i >= n_layers for i in methods):
        raise ValueError(f"base_model: kernel layers {sorted(methods)} exceed its {n_layers} layers")
    from oal.models.convert import convert

    return convert(base_model, sorted(methods), methods)


def load_export(directory: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """Load a folder written by `export` / `save_pretrained` of a converted model (`oal.load(directory)`)."""
    from oal.models.auto import base_model_type, register_model

    device = resolve_device(device)  # 'cuda' without a GPU: one line here, not torch's assertion after the load
    directory = Path(directory)
    cfg_path = directory / "config.json"
    model_type = read_json_object(cfg_path, "the config of a converted model folder (oal export)").get("model_type")
    try:
        family = base_model_type(model_type)
    except ValueError:
        raise ValueError(f"{cfg_path}: model_type {model_type!r} is not a converted model ('oal_<family>'); "
                         "load an unconverted model with transformers, or its run with oal.load(run_dir, model)"
                         ) from None
    register_model(family)  # families outside models.auto.FAMILIES too
    from transformers import AutoModel, AutoModelForCausalLM

    from oal.models.auto import ENCODER_FAMILIES

    auto = AutoModel if family in ENCODER_FAMILIES else AutoModelForCausalLM  # encoders: the base encoder
    kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        model = auto.from_pretrained(directory, local_files_only=True, **kwargs)
    except _config_errors() as exc:  # transformers' own check of config.json's fields: several lines, not a ValueError
        raise ValueError(f"{cfg_path}: {first_line(exc)}") from None
    return model.to(device).eval()


def _config_errors() -> tuple[type[Exception], ...]:
    """The error types of transformers' validation of a config's fields (huggingface_hub's strict dataclasses)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs are not validated there
        return ()
    return (StrictDataclassError,)
