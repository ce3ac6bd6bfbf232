"""A trained adapter on disk (`DIR/adapter/<method>/`), format "oal-adapter/2":

- adapter_model.safetensors: the LoRA tensors, under peft's state-dict names (`get_peft_model_state_dict`);
- kernel_params.safetensors: the trained kernel tensors, under the model's parameter names (none for softmax);
- adapt.json: the training record (`AdaptResult`);
- oal_adapter.json: the format, the LoRA's peft config ("lora"), the SHA256 of each file above and of the converted
  model it was trained on ("base"); the LoRA file's header holds the SHA256 of "lora" and "base" (`record_sha256`),
  so that an edited lora_alpha or base model is refused like an edited tensor.

There is deliberately no adapter_config.json: peft's own loaders (`PeftModel.from_pretrained(base, DIR)`,
`AutoPeftModelForCausalLM`, transformers' adapter detection) would attach the LoRA to whatever model they are given,
a softmax one included, and leave the trained kernels behind; without it they refuse the folder ("Can't find
'adapter_config.json'"). `load_adapter` checks the hashes and the model, then attaches both through peft's API.
The files are the same bytes for identical runs: the peft config is written with sorted keys and sorted target
modules, and without a base-model path (the model it binds to is recorded by its tensors' SHA256).

Folders of format "oal-adapter/1" (a peft folder: adapter_config.json + the same two safetensors files) are still
read; only .json and .safetensors files named in oal_adapter.json are ever opened (never a pickle).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch

from oal.adaptation.config import AdaptResult
from oal.models.pretrained import LORA_FILE, confined_file, read_json_object
from oal.rundir.files import atomic_dir, atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from oal.rundir.hashes import header_binds, record_header, sha256_file

__all__ = ["ADAPTER_MANIFEST", "LORA_FILE", "check_adapter", "converted_model_sha256", "load_adapter", "lora_record",
           "quiet_peft", "save_adapter", "strip_peft_prefix"]


_PEFT_PREFIX = "base_model.model."


ADAPTER_MANIFEST = "oal_adapter.json"


ADAPTER_FORMAT = "oal-adapter/2"
_FORMAT_V1 = "oal-adapter/1"  # a peft folder (adapter_config.json) beside the kernel file: still read
KERNEL_FILE = "kernel_params.safetensors"
_ALLOWED_SUFFIXES = (".json", ".safetensors")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_PEFT_CARD = "README.md"  # peft's model card in a format-1 folder: hashed, never parsed


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


def _to_adaptation_start(model, saved: list) -> None:
    """Put `model`'s converted layers' trainable kernel parameters where a run starts LoRA from them (App. F.1:
    a baseline's at their initial values; OAL's and the learned global's stay calibrated); each moved parameter
    and its old value are appended to `saved`."""
    from oal.calibration.kernels import adaptation_start
    from oal.models.attention import converted_methods

    with torch.no_grad():
        for m in converted_methods(model).values():
            if (start_method := adaptation_start(m)) is m:
                continue
            start = dict(start_method.named_parameters())
            for name, p in m.named_parameters():
                saved.append((p, p.detach().clone()))
                p.copy_(start[name])


@contextlib.contextmanager
def _at_adaptation_start(model):
    """`model` at its adaptation start (`_to_adaptation_start`), restored on exit; yields whether anything moved.
    The check of what an adapter was trained on uses it; `load_adapter` keeps the start where the adapter matched
    only there (kernel parameters it holds no trained tensors of, e.g. frozen ones, keep their start values)."""
    saved = []
    try:
        _to_adaptation_start(model, saved)
        yield bool(saved)
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


def strip_peft_prefix(name: str) -> str:
    return name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name


def _canonical(value):
    """JSON-ready with a stable order: peft keeps target_modules as a set, whose order follows PYTHONHASHSEED."""
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return json.loads(json.dumps(value, default=str))  # enums (PeftType, TaskType) are str subclasses


def lora_record(peft_model, adapter_name: str = "default") -> tuple[dict, dict[str, torch.Tensor]]:
    """(peft config as stable JSON, LoRA state dict) of `peft_model`'s adapter: what an adapter folder and an
    unmerged export store. The config is for inference and names no base model (machine-specific paths)."""
    from peft import get_peft_model_state_dict

    config = _canonical(peft_model.peft_config[adapter_name].to_dict())
    config.update(inference_mode=True, base_model_name_or_path=None, revision=None)
    return config, get_peft_model_state_dict(peft_model, adapter_name=adapter_name)


def save_adapter(peft_model, out_dir: str | Path, result: AdaptResult | None = None,
                 kernel_names: list[str] | None = None, *, base_sha256: str | None = None) -> Path:
    """DIR/adapter/: the LoRA tensors, the trained kernel tensors, adapt.json, and `oal_adapter.json` with the peft
    config, the SHA256 of each file and of the converted model it was trained on (`base_sha256`, default:
    `result.base_sha256`)."""
    out_dir = Path(out_dir)
    base_sha256 = base_sha256 or (result.base_sha256 if result is not None else None)
    if not base_sha256:
        raise ValueError("base_sha256: expected the converted_model_sha256 of the model before adaptation (or an "
                         "AdaptResult that holds it); an adapter must record what it was trained on")
    if kernel_names is None:
        kernel_names = result.kernel_names if result is not None else [
            strip_peft_prefix(n) for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    named = {strip_peft_prefix(n): p for n, p in peft_model.named_parameters()}
    config, lora = lora_record(peft_model)
    bound = {"lora": config, "base": {"state_dict_sha256": base_sha256}}
    with atomic_dir(out_dir) as tmp:
        # the LoRA file's header binds the manifest's peft config and base model (its SHA256 binds the file)
        atomic_save_safetensors(tmp / LORA_FILE, lora, metadata=record_header(bound))
        if kernel_names:  # the softmax arm has no kernel parameters (and safetensors cannot read an empty file)
            atomic_save_safetensors(tmp / KERNEL_FILE, {n: named[n].data for n in kernel_names})
        if result is not None:
            atomic_write_json(tmp / "adapt.json", result.to_dict())
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / ADAPTER_MANIFEST, {"format": ADAPTER_FORMAT, "sha256": files, **bound})
    return out_dir


def check_adapter(adapter_dir: str | Path, model=None) -> dict:
    """Check a saved adapter before use: every file it recorded (a .json or .safetensors file inside the folder)
    has its SHA256 and, given `model` (converted, not yet adapted), that model is the one it was trained on.
    Returns the manifest; ValueError naming the file."""
    return _check_adapter(adapter_dir, model)[0]


def _check_adapter(adapter_dir: str | Path, model=None) -> tuple[dict, bool]:
    """`check_adapter`, and whether `model` matched the adapter's base only at its adaptation start."""
    adapter_dir = Path(adapter_dir)
    manifest_path = adapter_dir / ADAPTER_MANIFEST
    if not manifest_path.is_file():
        what = "a peft folder without" if (adapter_dir / "adapter_config.json").is_file() else "no"
        raise ValueError(f"adapter_dir: {adapter_dir} has {what} {ADAPTER_MANIFEST} (not an adapter saved by oal, "
                         "no record of its files' hashes); adapt again with this version of oal")
    manifest = load_json(manifest_path)
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt not in (ADAPTER_FORMAT, _FORMAT_V1) or not isinstance(manifest.get("sha256"), dict):
        raise ValueError(f"{manifest_path}: expected format {ADAPTER_FORMAT!r} with file hashes, got {fmt!r}")
    pickled = [n for n in manifest["sha256"] if Path(n).suffix in _PICKLE_SUFFIXES]
    if pickled:
        raise ValueError(f"{manifest_path}: records {pickled[0]!r}, a pickle file; oal loads adapter weights from "
                         "safetensors only, since unpickling a file can run any code it holds (an adapter saved by "
                         f"oal holds {LORA_FILE}: adapt again with oal)")
    needed = [LORA_FILE] + (["adapter_config.json"] if fmt == _FORMAT_V1 else [])
    if fmt == ADAPTER_FORMAT and not isinstance(manifest.get("lora"), dict):
        raise ValueError(f"{manifest_path}: expected the LoRA's peft config under 'lora'")
    for name in needed:
        if name not in manifest["sha256"]:
            raise ValueError(f"{manifest_path}: records no {name}")
    for name, want in sorted(manifest["sha256"].items()):
        f = confined_file(adapter_dir, name, manifest_path)
        if f.suffix not in _ALLOWED_SUFFIXES and not (fmt == _FORMAT_V1 and name == _PEFT_CARD):
            raise ValueError(f"{manifest_path}: lists {name!r}; an adapter holds .safetensors and .json files only "
                             "(no pickle)")
        if not f.is_file():
            raise ValueError(f"{f}: missing (recorded in {manifest_path})")
        if sha256_file(f) != want:
            raise ValueError(f"{f}: SHA256 does not match {manifest_path} (file changed or truncated)")
    # adapters saved before the header held it (None) load as before
    if fmt == ADAPTER_FORMAT and header_binds(adapter_dir / LORA_FILE, {"lora": manifest["lora"],
                                                                        "base": manifest.get("base")}) is False:
        raise ValueError(f"{manifest_path}: its peft config or base model is not the one {LORA_FILE} was saved "
                         "with (edited after saving?)")
    at_start = False
    if model is not None:
        base = manifest.get("base") or {}
        have = converted_model_sha256(model)
        if have != base.get("state_dict_sha256"):  # a baseline's adapter started from its initial parameters
            with _at_adaptation_start(model) as moved:
                have = converted_model_sha256(model) if moved else have
            at_start = moved
        if have != base.get("state_dict_sha256"):
            raise ValueError(f"adapter_dir: the adapter in {adapter_dir} was trained on another model (sha256 "
                             f"{str(base.get('state_dict_sha256'))[:12]}) than the one given (sha256 {have[:12]}): "
                             "other base weights or other kernels")
    return manifest, at_start


def _peft_config(manifest: dict, adapter_dir: Path):
    from peft import PeftConfig

    where = adapter_dir / ADAPTER_MANIFEST
    record = manifest.get("lora")
    if manifest["format"] == _FORMAT_V1:
        where = adapter_dir / "adapter_config.json"
        record = read_json_object(where, "the peft config of a LoRA adapter")
    try:
        config = PeftConfig.from_peft_type(**record)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a peft LoRA config ({exc})") from None
    config.inference_mode = True
    return config


def load_adapter(model, adapter_dir: str | Path):
    """Attach a saved LoRA adapter to `model` (already converted, if it was) and load its trained kernel tensors,
    after `check_adapter` (file hashes, and that `model` is the model the adapter was trained on). Every LoRA tensor
    of the adapter must fill a LoRA parameter of the model, and every LoRA parameter must be filled. A baseline's
    adapter, trained from its initial kernel values (App. F.1), puts the calibrated model given at that start first."""
    from peft import get_peft_model, set_peft_model_state_dict

    adapter_dir = Path(adapter_dir)
    manifest, at_start = _check_adapter(adapter_dir, model)
    config = _peft_config(manifest, adapter_dir)
    kernels = load_safetensors(adapter_dir / KERNEL_FILE) if KERNEL_FILE in manifest["sha256"] else {}
    named = dict(model.named_parameters())
    missing = [n for n in kernels if n not in named]
    if missing:
        raise ValueError(f"adapter_dir: kernel parameters {missing[:3]} do not exist in the model "
                         "(was it converted with the same layers and methods?)")
    for n, t in kernels.items():
        if named[n].shape != t.shape:
            raise ValueError(f"adapter_dir: {n} has shape {tuple(t.shape)}, model has {tuple(named[n].shape)}")
    if at_start:  # trained from the start: what the adapter holds no trained tensors of (frozen kernels) stays there
        _to_adaptation_start(model, [])
    with torch.no_grad():
        for n, t in kernels.items():
            named[n].copy_(t)
    with quiet_peft():
        peft_model = get_peft_model(model, config)
    result = set_peft_model_state_dict(peft_model, load_safetensors(adapter_dir / LORA_FILE))
    unfilled = [k for k in result.missing_keys if "lora_" in k]
    if unfilled or result.unexpected_keys:
        raise ValueError(f"{adapter_dir / LORA_FILE}: does not fit the model's LoRA layers (unfilled: "
                         f"{unfilled[:3]}, unexpected: {list(result.unexpected_keys)[:3]})")
    peft_model.eval()
    return peft_model
