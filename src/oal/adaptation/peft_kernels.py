"""Kernel coefficients in a peft model's own adapter saves, so that `transformers.Trainer` checkpoints keep them.

`oal.add_lora` trains the converted layers' kernel coefficients beside LoRA, but they are not peft adapter weights:
peft's `save_pretrained` (which the Trainer calls for every checkpoint) writes the LoRA matrices only, and its
`load_adapter` (which the Trainer calls to resume and for `load_best_model_at_end`) reads them only. The peft model
`add_lora` returns has a class in front of peft's that also writes the kernel tensors to
`DIR/oal_kernels.safetensors` (with the SHA256 of the adapter file they were saved beside, in the header) and reads
them back in `load_adapter`. `oal run` and `oal adapt` save adapters their own way (`adaptation.adapter`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from oal.models.pretrained import LORA_FILE
from oal.rundir.files import atomic_save_safetensors, load_safetensors
from oal.rundir.hashes import header_binds, record_header, sha256_file

__all__ = ["KERNELS_FILE", "with_kernels_in_saves"]

KERNELS_FILE = "oal_kernels.safetensors"


def _kernels(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".oal_method." in n}


def _binding(folder: Path) -> dict:
    adapter = folder / LORA_FILE
    return {"adapter_sha256": sha256_file(adapter) if adapter.is_file() else None}


def _kernels_file(model_id, kwargs: dict) -> Path | None:
    """The kernels file beside the adapter peft read: in the folder, its `subfolder`, or the hub repository (and
    revision) it came from; only `model_id / KERNELS_FILE` was looked at, so an adapter read from a subfolder or the
    hub kept the model's calibrated kernels without a word."""
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in ("subfolder", "revision", "cache_dir", "token", "local_files_only", "force_download",
                                  "proxies") if kwargs.get(k) is not None}
    found = cached_file(str(model_id), KERNELS_FILE, _raise_exceptions_for_missing_entries=False, **hub)
    return Path(found) if found else None


class _KernelsInSaves:
    """In front of a peft model class: its saves and loads carry the kernel coefficients too."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            folder = Path(save_directory)
            tensors = {n: p.detach().to("cpu").contiguous() for n, p in _kernels(self).items()}
            atomic_save_safetensors(folder / KERNELS_FILE, tensors, metadata=record_header(_binding(folder)))

    def load_adapter(self, model_id, adapter_name, *args, **kwargs):
        out = super().load_adapter(model_id, adapter_name, *args, **kwargs)
        path = _kernels_file(model_id, kwargs)
        if path is not None:  # a folder saved without them (peft's own) keeps the model's kernels
            if header_binds(path, _binding(path.parent)) is False:
                raise ValueError(f"{path}: saved beside another {LORA_FILE} than the one in its folder")
            saved, own = load_safetensors(path), _kernels(self)
            if set(saved) != set(own) or any(saved[n].shape != own[n].shape for n in own):
                raise ValueError(f"{path}: its kernel tensors do not fit this model's converted layers")
            with torch.no_grad():
                for name, p in own.items():
                    p.copy_(saved[name])
        return out


@functools.cache
def _class_for(base: type) -> type:
    return type(f"OAL{base.__name__}", (_KernelsInSaves, base), {"__module__": __name__})


def with_kernels_in_saves(peft_model):
    """`peft_model` (in place) with the class whose saves and loads carry the kernel coefficients."""
    if not isinstance(peft_model, _KernelsInSaves):
        peft_model.__class__ = _class_for(type(peft_model))
    return peft_model
