"""A trained adapter on disk (`DIR/adapter/<method>/`): peft's LoRA files, the trained kernel tensors, adapt.json,
and `oal_adapter.json` with the SHA256 of each file and of the converted model it was trained on; `load_adapter`
checks both before use."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from oal.adaptation.config import AdaptResult
from oal.rundir.files import atomic_dir, atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from oal.rundir.hashes import sha256_file

__all__ = ["ADAPTER_MANIFEST", "check_adapter", "converted_model_sha256", "load_adapter", "quiet_peft",
           "save_adapter", "strip_peft_prefix"]


_PEFT_PREFIX = "base_model.model."


ADAPTER_MANIFEST = "oal_adapter.json"


ADAPTER_FORMAT = "oal-adapter/1"


@contextlib.contextmanager
def quiet_peft():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model (a FutureWarning that
    says nothing to our users); silence that one warning where it arises."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def converted_model_sha256(model) -> str:
    """SHA256 of every tensor of a (converted) model, its kernel tensors included: what an adapter was trained on.

    Floating tensors are hashed as float32, so the same weights loaded in bfloat16/float16 or upcast to float32
    (both exact) give the same fingerprint, while other weights never do."""
    from oal.models.provenance import state_dict_sha256

    return state_dict_sha256(model, torch.float32, kernels=True)


def strip_peft_prefix(name: str) -> str:
    return name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name


def save_adapter(peft_model, out_dir: str | Path, result: AdaptResult | None = None,
                 kernel_names: list[str] | None = None, *, base_sha256: str | None = None) -> Path:
    """DIR/adapter/: peft `save_pretrained` + `kernel_params.safetensors` (trained kernel tensors) + adapt.json, and
    `oal_adapter.json` with the SHA256 of each file and of the converted model it was trained on (`base_sha256`,
    default: `result.base_sha256`)."""
    out_dir = Path(out_dir)
    base_sha256 = base_sha256 or (result.base_sha256 if result is not None else None)
    if not base_sha256:
        raise ValueError("base_sha256: expected the converted_model_sha256 of the model before adaptation (or an "
                         "AdaptResult that holds it); an adapter must record what it was trained on")
    if kernel_names is None:
        kernel_names = result.kernel_names if result is not None else [
            strip_peft_prefix(n) for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    named = {strip_peft_prefix(n): p for n, p in peft_model.named_parameters()}
    with atomic_dir(out_dir) as tmp:
        peft_model.save_pretrained(str(tmp))
        if kernel_names:  # the softmax arm has no kernel parameters (and safetensors cannot read an empty file)
            atomic_save_safetensors(tmp / "kernel_params.safetensors", {n: named[n].data for n in kernel_names})
        if result is not None:
            atomic_write_json(tmp / "adapt.json", result.to_dict())
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / ADAPTER_MANIFEST, {
            "format": ADAPTER_FORMAT, "sha256": files,
            "base": {"state_dict_sha256": base_sha256}})
    return out_dir


def check_adapter(adapter_dir: str | Path, model=None) -> dict:
    """Check a saved adapter before use: every file it recorded has its SHA256 and, given `model` (converted, not
    yet adapted), that model is the one it was trained on. Returns the manifest; ValueError naming the file."""
    adapter_dir = Path(adapter_dir)
    manifest_path = adapter_dir / ADAPTER_MANIFEST
    if not (adapter_dir / "adapter_config.json").exists():
        raise ValueError(f"adapter_dir: {adapter_dir} has no adapter_config.json (not a saved adapter)")
    if not manifest_path.is_file():
        raise ValueError(f"adapter_dir: {adapter_dir} has no {ADAPTER_MANIFEST} (no record of its files' hashes); "
                         "adapt again with this version of oal")
    manifest = load_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != ADAPTER_FORMAT or "sha256" not in manifest:
        raise ValueError(f"{manifest_path}: expected format {ADAPTER_FORMAT!r} with file hashes")
    for name, want in sorted(manifest["sha256"].items()):
        f = adapter_dir / name
        if not f.is_file():
            raise ValueError(f"{f}: missing (recorded in {manifest_path})")
        if sha256_file(f) != want:
            raise ValueError(f"{f}: SHA256 does not match {manifest_path} (file changed or truncated)")
    if model is not None:
        base = manifest.get("base") or {}
        have = converted_model_sha256(model)
        if have != base.get("state_dict_sha256"):
            raise ValueError(f"adapter_dir: the adapter in {adapter_dir} was trained on another model (sha256 "
                             f"{str(base.get('state_dict_sha256'))[:12]}) than the one given (sha256 {have[:12]}): "
                             "other base weights or other kernels")
    return manifest


def load_adapter(model, adapter_dir: str | Path):
    """Attach a saved LoRA adapter to `model` (already converted, if it was) and load its trained kernel tensors,
    after `check_adapter` (file hashes, and that `model` is the model the adapter was trained on)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    check_adapter(adapter_dir, model)
    kernel_path = adapter_dir / "kernel_params.safetensors"
    kernels = load_safetensors(kernel_path) if kernel_path.exists() else {}
    named = dict(model.named_parameters())
    missing = [n for n in kernels if n not in named]
    if missing:
        raise ValueError(f"adapter_dir: kernel parameters {missing[:3]} do not exist in the model "
                         "(was it converted with the same layers and methods?)")
    with torch.no_grad():
        for n, t in kernels.items():
            if named[n].shape != t.shape:
                raise ValueError(f"adapter_dir: {n} has shape {tuple(t.shape)}, model has {tuple(named[n].shape)}")
            named[n].copy_(t)
    with quiet_peft():
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    peft_model.eval()
    return peft_model
