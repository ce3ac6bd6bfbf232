"""The arms of a run directory as models: base + a method's calibrated kernels (+ its LoRA adapter and trained
kernels), or the softmax reference arm; and the SHA256 of the run files an arm is built from.

A run directory keeps a method's calibrated kernels (`calibration.kernels.kernel_dir`) and, after adaptation, its
LoRA adapter and trained kernel tensors in `adapter/<method>/` (`adaptation.adapter.save_adapter`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from oal.calibration.kernels import KERNELS_FILE, META_FILE, kernel_dir
from oal.errors import InputError
from oal.models.pretrained import read_json_object
from oal.rundir.confine import escaping_links
from oal.rundir.hashes import sha256_tree
from oal.rundir.stages import StageLog

__all__ = ["adapter_dir", "arm_inputs", "calibrated_methods", "load_arm", "load_converted"]

log = logging.getLogger("oal")


_ADAPTER_MANIFEST = "oal_adapter.json"  # adaptation.adapter.ADAPTER_MANIFEST: every saved adapter has it


def adapter_dir(run_dir: str | Path, method: str) -> Path:
    """Where a run directory keeps `method`'s LoRA adapter and trained kernel tensors."""
    return Path(run_dir) / "adapter" / method


def calibrated_methods(run_dir: str | Path) -> list[str]:
    """Methods with calibrated kernels in `run_dir` (OAL's at the top, the others under kernels/)."""
    run_dir = Path(run_dir)
    found = ["oal"] if (kernel_dir(run_dir, "oal") / META_FILE).is_file() else []
    others = run_dir / "kernels"
    if others.is_dir():
        found += sorted(p.name for p in others.iterdir() if (p / META_FILE).is_file())
    return found


def _check_run_dir(run_dir: Path, method: str) -> None:
    """A run directory an arm may be read from: `method` a plain name (a run's config.json lists them, and
    kernels/<method>, adapter/<method> must stay below the run), no symbolic link out of the directory."""
    if not run_dir.is_dir():
        raise InputError(f"{run_dir} is not a directory (expected a run directory of `oal run`)", "--out", "run_dir")
    if not isinstance(method, str) or not method.isprintable() or method in ("", ".", "..") or any(
            c in method for c in "/\\"):
        raise InputError(f"{method!r} is not a method name", "--method")
    for link, target in escaping_links(run_dir, limit=1):
        raise InputError(f"{link} is a symbolic link to {target}, outside {run_dir}; oal reads a run directory from "
                         "its own files only: remove the link (or move its target inside)", "--out", "run_dir")


def _kernels_or_fail(run_dir: Path, method: str) -> Path:
    _check_run_dir(run_dir, method)
    kdir = kernel_dir(run_dir, method)
    if not (kdir / META_FILE).is_file():
        have = calibrated_methods(run_dir)
        if not have:  # not a run that calibrated anything: the folder is wrong, not the method
            raise InputError(f"{run_dir} holds no calibrated kernels (run `oal run --out {run_dir}` first)", "--out",
                             "run_dir")
        raise InputError(f"the run did not calibrate {method!r} ({kdir / META_FILE} is missing; calibrated: "
                         f"{', '.join(have) or 'none'})", "--method")
    return kdir


def _adapter_or_none(run_dir: Path, method: str, adapter: bool | None) -> Path | None:
    adir = adapter_dir(run_dir, method)
    if adapter is False:
        return None
    if not (adir / _ADAPTER_MANIFEST).is_file():
        if adapter:
            # `oal adapt` adapts an `oal run` directory; one made stage by stage (analyze, calibrate) has no config
            train = (f"train one with `oal adapt --out {run_dir} --method {method}`, or " if
                     (run_dir / "config.json").is_file() else "")
            alone = "the base model alone" if method == "softmax" else "the calibrated kernels alone"  # no kernels
            raise InputError(f"{adir / _ADAPTER_MANIFEST} is missing: the run has no adapter for {method!r} ({train}"
                             f"pass --no-adapter for {alone})", "--adapter", "adapter")
        return None
    return adir


def _run_config(run_dir: Path) -> dict:
    """config.json of `oal run`, checked against the SHA256 its setup stage recorded (where there is that record:
    a run directory written by the library's parts alone has none); {} when there is no config.json."""
    path = run_dir / "config.json"
    if not path.is_file():
        return {}
    config = read_json_object(path, "the configuration of an `oal run` run directory")
    StageLog(run_dir).check_config(required=False)
    return config


def _run_dtype(run_dir: Path, config: dict | None = None, base: tuple[Path, dict] | None = None) -> torch.dtype:
    """The dtype the run loaded its model in: config.json of `oal run` (`config` when already read), else the one
    the kernels' base-model record holds (`base`: kernels.json's path and its "base_model"), float32 when neither
    records one. A directory made stage by stage (`oal analyze`, `oal calibrate`) has no config.json: its bfloat16
    kernels were loaded on a float32 model. Any torch dtype name passed: "int8" loaded the base model in int8 (even
    under --dtype float32, a wider dtype), and the error blamed the base model rather than config.json."""
    from oal.device import resolve_dtype

    path, key = run_dir / "config.json", "config."
    config = (_run_config(run_dir) if config is None else config).get("config")
    name = config.get("dtype") if isinstance(config, dict) else None
    if not name and base is not None and isinstance(base[1], dict) and base[1].get("dtype"):
        (path, record), key = base, "base_model."
        name = record["dtype"]
    try:
        return resolve_dtype((name if isinstance(name, str) else repr(name)) if name else "float32")
    except ValueError as exc:
        raise ValueError(f"{path}: {key}{exc}") from None


def _load_dtype(run_dir: Path, dtype: torch.dtype | None, config: dict | None = None,
                base: tuple[Path, dict] | None = None):
    """(the dtype to load the base model in, the dtype to cast it to afterwards or None). A wider dtype than the
    run's (float32 on a bfloat16 run) loads the run's model and casts it: exactly the weights its kernels and adapter
    were made on (a float32 checkpoint loaded as float32 has other, unrounded weights, which no adapter matches)."""
    run = _run_dtype(run_dir, config, base)
    want = dtype or run
    if want != run and want.is_floating_point and want.itemsize > run.itemsize:
        return run, want
    return want, None


def _widen(mdl, dtype: torch.dtype | None) -> None:
    if dtype is not None:
        from oal.artefact.folder_io import cast_base_weights

        cast_base_weights(mdl, dtype)  # the kernels keep their own dtype


def load_converted(run_dir: str | Path, method: str = "oal", adapter: bool | None = None, *,
                   model: str | None = None, dtype: torch.dtype | None = None, device: str = "cpu",
                   merge: bool = True):
    """The run's converted model: base model + `method`'s calibrated kernels (+ its LoRA adapter).

    `adapter`: None uses the run's adapter for `method` when there is one, True requires it, False leaves it out.
    With an adapter, its trained kernel tensors replace the calibrated ones and LoRA is merged into the base
    weights (`merge=False`: a peft `PeftModel` instead). `model` overrides the base model recorded in
    kernels.json (its file hashes must still match); `dtype` defaults to the run's. Returns
    (model, tokenizer, info) with info = {"method", "base_model", "kernels", "adapter" (path or None), "merged"}.
    ValueError (naming the file) for a method the run did not calibrate or a required adapter it does not have.
    """
    from transformers import AutoTokenizer

    from oal.artefact.load import load

    run_dir = Path(run_dir)
    kdir = _kernels_or_fail(run_dir, method)
    adir = _adapter_or_none(run_dir, method, adapter)
    base = read_json_object(kdir / META_FILE, "kernels metadata (oal.save_kernels)").get("base_model")
    name = model or (base.get("name_or_path") if isinstance(base, dict) else None) or "default"
    load_dtype, widen = _load_dtype(run_dir, dtype, base=(kdir / META_FILE, base))
    mdl = load(kdir, name, dtype=load_dtype, device=device)  # checks the base model's hashes
    tokenizer = AutoTokenizer.from_pretrained(mdl.config.name_or_path, local_files_only=True)
    if adir is not None:
        from oal.adaptation.adapter import load_adapter

        mdl = load_adapter(mdl, adir)
        if merge:
            mdl = mdl.merge_and_unload()
    _widen(mdl, widen)
    mdl.eval()
    if adir is not None:
        how = f"its LoRA adapter ({'merged' if merge else 'unmerged'}) and trained kernels from {adir}"
    else:
        how = "its calibrated kernels only (" + ("adapter left out" if adapter is False
                                                 else "the run has no adapter for it") + ")"
    log.info("%s: using %s with %s", run_dir, method, how)
    info = {"method": method, "base_model": name, "kernels": str(kdir), "adapter": str(adir) if adir else None,
            "merged": bool(adir) and merge}
    return mdl, tokenizer, info


def load_arm(run_dir: str | Path, method: str, adapter: bool | None = None, *, model: str | None = None,
             dtype: torch.dtype | None = None, device: str = "cpu"):
    """One arm of a run as `load_converted` returns it; for the softmax reference arm (no kernels), the run's base
    model, checked against the record in its config.json, with the run's adapter for it (LoRA merged)."""
    if method != "softmax":
        return load_converted(run_dir, method, adapter, model=model, dtype=dtype, device=device)
    from oal.adaptation.adapter import load_adapter
    from oal.models.encoder import is_encoder_model, load_encoder
    from oal.models.provenance import check_base_model
    from oal.models.registry import load_model

    run_dir = Path(run_dir)
    _check_run_dir(run_dir, method)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{config_path}: missing; expected the configuration of an `oal run` run directory")
    config = _run_config(run_dir)
    record = config.get("model")
    if not isinstance(record, dict) or not record.get("state_dict_sha256"):
        raise ValueError(f"{config_path}: records no fingerprint of the run's base model; rerun `oal run`")
    name = model or record.get("model") or "default"
    loader = load_encoder if config.get("protocol") == "encoder" and is_encoder_model(name) else load_model
    load_dtype, widen = _load_dtype(run_dir, dtype, config)
    mdl, tokenizer, provenance = loader(name, dtype=load_dtype, device=device)
    check_base_model({"name_or_path": record.get("model"), "state_dict_sha256": record["state_dict_sha256"],
                      "dtype": record.get("dtype"), "hashes": record.get("sha256")}, mdl, provenance,
                     where=str(config_path))
    adir = _adapter_or_none(run_dir, method, adapter)
    if adir is not None:
        mdl = load_adapter(mdl, adir).merge_and_unload()
    _widen(mdl, widen)
    log.info("%s: using softmax %s", run_dir, f"with its LoRA adapter from {adir}" if adir else "(no adapter)")
    info = {"method": method, "base_model": name, "kernels": None, "adapter": str(adir) if adir else None,
            "merged": adir is not None}
    return mdl.eval(), tokenizer, info


def arm_inputs(run_dir: str | Path, method: str, adapter: str | Path | None) -> dict[str, str]:
    """SHA256 of the run files an arm is built from (`method`'s kernels unless softmax, and the adapter folder
    `adapter` when one was used), keyed by path relative to the run directory: what metrics.json records."""
    run_dir = Path(run_dir)
    used = [] if method == "softmax" else [kernel_dir(run_dir, method) / f for f in (KERNELS_FILE, META_FILE)]
    if adapter is not None:
        used.append(Path(adapter))
    return {k: v for p in used for k, v in sha256_tree(run_dir, p.resolve().relative_to(run_dir.resolve())).items()}
