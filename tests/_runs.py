"""Run directories for the artefact tests, written by the library's own writers (save_kernels, save_adapter) for a
tiny random Llama, with random kernels and a random (non-zero) LoRA adapter, so every check can tell adapted from
calibrated and converted from softmax."""

import copy
import json
from pathlib import Path

import torch

from oal.adaptation.adapter import converted_model_sha256, save_adapter
from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import wrap_lora
from oal.artefact.arms import adapter_dir
from oal.calibration.kernels import kernel_dir, save_kernels
from oal.methods import build_method
from oal.models.convert import convert
from oal.models.registry import load_model

LAYERS = [1, 2]
IDS = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 7, 130, 64, 12, 200, 33]])
SRC = str(Path(__file__).resolve().parents[1] / "src")


def random_methods(name: str, n_heads: int, n_kv: int, head_dim: int, seed: int, **kwargs) -> dict:
    """Seeded methods for LAYERS with every parameter moved off its initial value."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in LAYERS:
        if name == "oal":
            kwargs["groups"] = torch.randint(0, 3, (n_heads, head_dim), generator=gen)
        m = build_method(name, n_heads, n_kv, head_dim, layer_idx=i, seed=seed, **kwargs)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        out[i] = m
    return out


def make_run(root: Path, base_dir: Path, methods: dict[str, bool], dtype: str | None = None) -> Path:
    """A run directory as `oal run` leaves it: kernels per method, and adapter/<method>/ where methods[m] is True."""
    run = root / "run"
    _, _, provenance = load_model(str(base_dir))
    for k, (name, with_adapter) in enumerate(methods.items()):
        ms = random_methods(name, 4, 2, 8, seed=k)
        save_kernels(ms, kernel_dir(run, name), base_model=str(base_dir), provenance=provenance)
        if with_adapter:
            mdl, _, _ = load_model(str(base_dir))
            convert(mdl, LAYERS, copy.deepcopy(ms))
            trained_on = converted_model_sha256(mdl)
            peft_model, names = wrap_lora(mdl, AdaptConfig(lora_r=2, lora_alpha=4, lora_dropout=0.0))
            gen = torch.Generator().manual_seed(100 + k)
            with torch.no_grad():  # LoRA B starts at zero: move every trainable tensor so the adapter matters
                for _, p in sorted(peft_model.named_parameters()):
                    if p.requires_grad:
                        p.add_(0.05 * torch.randn(p.shape, generator=gen))
            save_adapter(peft_model, adapter_dir(run, name), kernel_names=names, base_sha256=trained_on)
    if dtype is not None:
        (run / "config.json").write_text(json.dumps({"config": {"dtype": dtype}}))
    return run


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def timeless(path: Path):
    """A run file's content with its timing fields dropped (calibration.json records seconds per layer and of the
    capture): what two runs of the same work must agree on."""
    if path.name == "calibration.json":
        data = json.loads(path.read_text())
        data.get("capture", {}).pop("seconds", None)
        for per_layer in data["methods"].values():
            for rec in per_layer.values():
                rec.pop("elapsed_s", None)
        return data
    return path.read_bytes()
