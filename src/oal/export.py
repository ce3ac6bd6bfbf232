"""A run's converted model as one artefact: load it (with its adapter), export it to a folder, load the folder back.

    model, tokenizer, info = load_converted("runs/default", "oal")   # base + kernels + the run's LoRA, merged
    export("runs/default", "oal", "converted/")                      # one folder: config, weights, tokenizer
    model = oal.load("converted/")                                   # or, after `import oal`,
    model = AutoModelForCausalLM.from_pretrained("converted/")       # the standard route

A run directory keeps a method's calibrated kernels (`io.kernel_dir`) and, after adaptation, its LoRA adapter and
trained kernel tensors in `adapter/<method>/` (`adapt.save_adapter`). The exported folder is what
`save_pretrained` of the converted model writes (`models.pretrained`): the base weights with the adapter merged
into them, the kernel tensors in the same state dict, the conversion in config.json, and oal.json with the SHA256
of every file and of the run files it came from. `merge=False` keeps the LoRA adapter as a separate peft adapter in
the folder (adapter_config.json + adapter_model.safetensors), which transformers attaches on load.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .io import KERNELS_FILE, META_FILE, kernel_dir
from .models.pretrained import read_json_object
from .runio import atomic_dir, load_json, sha256_files, sha256_tree

__all__ = ["adapter_dir", "arm_inputs", "calibrated_methods", "export", "load_converted", "load_export",
           "save_converted", "softmax_twin"]

log = logging.getLogger("oal")

_ADAPTER_CONFIG = "adapter_config.json"


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


def _kernels_or_fail(run_dir: Path, method: str) -> Path:
    if not run_dir.is_dir():
        raise ValueError(f"run_dir: {run_dir} is not a directory (expected a run directory of `oal run`)")
    kdir = kernel_dir(run_dir, method)
    if not (kdir / META_FILE).is_file():
        have = calibrated_methods(run_dir)
        raise ValueError(f"{kdir / META_FILE}: missing; the run did not calibrate {method!r} "
                         f"(calibrated: {', '.join(have) or 'none'})")
    return kdir


def _adapter_or_none(run_dir: Path, method: str, adapter: bool | None) -> Path | None:
    adir = adapter_dir(run_dir, method)
    if adapter is False:
        return None
    if not (adir / _ADAPTER_CONFIG).is_file():
        if adapter:
            raise ValueError(f"{adir / _ADAPTER_CONFIG}: missing; the run has no adapter for {method!r} (train one "
                             f"with `oal adapt --out {run_dir} --method {method}`, or leave the adapter out)")
        return None
    return adir


def _run_dtype(run_dir: Path) -> torch.dtype:
    """The dtype the run loaded its model in (config.json of `oal run`), float32 when not recorded."""
    path = run_dir / "config.json"
    name = "float32"
    if path.is_file():
        config = read_json_object(path, "the configuration of an `oal run` run directory").get("config")
        name = (config.get("dtype") if isinstance(config, dict) else None) or name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{path}: config.dtype: expected a torch dtype name, got {name!r}")
    return dtype


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

    from .io import load

    run_dir = Path(run_dir)
    kdir = _kernels_or_fail(run_dir, method)
    adir = _adapter_or_none(run_dir, method, adapter)
    base = read_json_object(kdir / META_FILE, "kernels metadata (oal.save_kernels)").get("base_model")
    name = model or (base.get("name_or_path") if isinstance(base, dict) else None) or "default"
    mdl = load(kdir, name, dtype=dtype or _run_dtype(run_dir), device=device)  # checks the base model's hashes
    tokenizer = AutoTokenizer.from_pretrained(mdl.config.name_or_path, local_files_only=True)
    if adir is not None:
        from .adapt import load_adapter

        mdl = load_adapter(mdl, adir)
        if merge:
            mdl = mdl.merge_and_unload()
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
    from .adapt import load_adapter
    from .models.registry import check_base_model, load_model

    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    record = read_json_object(config_path, "the configuration of an `oal run` run directory").get("model")
    if not isinstance(record, dict) or not record.get("state_dict_sha256"):
        raise ValueError(f"{config_path}: records no fingerprint of the run's base model; rerun `oal run`")
    name = model or record.get("model") or "default"
    mdl, tokenizer, provenance = load_model(name, dtype=dtype or _run_dtype(run_dir), device=device)
    check_base_model({"name_or_path": record.get("model"), "state_dict_sha256": record["state_dict_sha256"],
                      "dtype": record.get("dtype"), "hashes": record.get("sha256")}, mdl, provenance,
                     where=str(config_path))
    adir = _adapter_or_none(run_dir, method, adapter)
    if adir is not None:
        mdl = load_adapter(mdl, adir).merge_and_unload()
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


def _writable_target(to: Path) -> None:
    """Refuse to replace a folder that is not an export: `atomic_dir` swaps the whole folder."""
    from .models.pretrained import MANIFEST

    if to.exists() and (not to.is_dir() or (any(to.iterdir()) and not (to / MANIFEST).is_file())):
        raise ValueError(f"to: {to} exists and is not a converted-model folder; choose a new or empty folder")


def save_converted(model, to: str | Path, tokenizer=None, source: dict | None = None) -> Path:
    """Write a converted model (or a peft model around one: its adapter stays separate) to `to`, atomically."""
    from .models.convert import is_converted

    to = Path(to)
    _writable_target(to)
    peft = hasattr(model, "peft_config") and hasattr(model, "unload")
    base = model.get_base_model() if peft else model
    if not is_converted(base):
        raise ValueError("model: it has no converted layers; call oal.convert or oal.load first")
    with atomic_dir(to) as tmp:
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if peft:
            model.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors
            base = model.unload()  # LoRA layers out, base weights untouched; trained kernels stay in place
        base.save_pretrained(tmp, oal_source=source)  # config, weights, generation config, then oal.json
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, 0o644)  # writers that go through mkstemp leave 0600; these are ordinary shared files
    return to


def _cast_base_weights(model, dtype: torch.dtype) -> None:
    """The base model's floating parameters to `dtype`; kernel tensors keep theirs (fp32 factors, fp64 features)."""
    for name, p in model.named_parameters():
        if ".oal_method." not in name and p.is_floating_point():
            p.data = p.data.to(dtype)


def export(run_dir: str | Path, method: str, to: str | Path, *, adapter: bool = True, merge: bool = True,
           model: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the run's converted `method` model (with its adapter unless `adapter=False`) as one folder `to`.

    The folder reloads with `oal.load(to)`, or with `AutoModelForCausalLM.from_pretrained(to)` after `import oal`.
    """
    run_dir = Path(run_dir)
    # loaded in the run's dtype (what its kernels and adapter were made on and are checked against), then cast
    mdl, tok, info = load_converted(run_dir, method, adapter, model=model, merge=merge)
    if dtype is not None:
        _cast_base_weights(mdl, dtype)
    kdir = Path(info["kernels"])
    source = {
        "run_dir": str(run_dir.resolve()), "method": method,
        "base_model": load_json(kdir / META_FILE).get("base_model", {}),
        "kernels": {f: v for f, v in sha256_files(kdir).items() if f in (KERNELS_FILE, META_FILE)},
        "adapter": None if info["adapter"] is None else {"sha256": sha256_files(info["adapter"]),
                                                         "merged": info["merged"]},
    }
    out = save_converted(mdl, to, tok, source)
    log.info("exported %s (%s) to %s", run_dir, method, out)
    return out


def load_export(directory: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """Load a folder written by `export` / `save_pretrained` of a converted model (`oal.load(directory)`)."""
    from .models.auto import base_model_type, register_model

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

    from .models.auto import ENCODER_FAMILIES

    auto = AutoModel if family in ENCODER_FAMILIES else AutoModelForCausalLM  # encoders: the base encoder
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return auto.from_pretrained(directory, local_files_only=True, **kwargs).to(device).eval()


def softmax_twin(model, base_model: str, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """`base_model` loaded afresh with converted `model`'s weights (a merged adapter included) and softmax
    attention everywhere: the reference a converted layer is compared with under frozen attention."""
    from .models.registry import load_model

    twin, _, _ = load_model(base_model, dtype=dtype or next(model.parameters()).dtype, device=device)
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if ".oal_method." not in k})
    return twin.eval()
