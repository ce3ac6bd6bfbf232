"""Checks of a model folder before anything loads it: config.json, a supported architecture, safetensors weights
(never pickle); and the one-line errors those checks raise on `--model`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from oal.errors import InputError, ModelUnavailableError  # noqa: F401  (its home was here)
from oal.models.families import SUPPORTED_ARCHITECTURES
from oal.rundir.files import load_json

__all__ = ["ModelUnavailableError", "PICKLE_SUFFIXES", "bad_model", "check_model_folder", "first_line",
           "hub_blobs", "layers_beyond_weights", "looks_like_path"]


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def bad_model(message: str) -> InputError:
    return InputError(message, "--model", "name_or_path")


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check_model_folder(path: Path, architectures: Mapping[str, str] | None = None) -> None:
    """A loadable HF folder: config.json, a supported architecture (model_type -> class name; default: the causal
    LMs of `models.families`), safetensors weights (never pickle)."""
    if not (path / "config.json").is_file():
        raise bad_model(f"{path} is not a Hugging Face model folder (no config.json)")
    cfg = load_json(path / "config.json")
    architectures = SUPPORTED_ARCHITECTURES if architectures is None else architectures
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in architectures:
        archs = (cfg.get("architectures") if isinstance(cfg, dict) else None) or ["?"]
        raise bad_model(f"{path}: unsupported architecture {archs[0]} (model_type={model_type!r}); supported: "
                         f"{', '.join(f'{v} ({k})' for k, v in architectures.items())}")
    files = [p.name for p in path.iterdir() if p.is_file()]
    if not any(f.endswith(".safetensors") for f in files):
        pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise bad_model(
                f"{path} holds pickle weights only ({', '.join(pickles)}); oal loads safetensors only, since "
                "unpickling can run code. Convert once, where you trust the file: "
                "AutoModelForCausalLM.from_pretrained(PATH, use_safetensors=False).save_pretrained(NEW_PATH) "
                "(writes model.safetensors), then pass NEW_PATH")
        raise bad_model(f"{path} holds no weights (no *.safetensors file)")
    beyond = layers_beyond_weights(path)
    if beyond:
        raise bad_model(beyond)


# a layer's tensors: model.layers.3.self_attn..., encoder.layer.3.attention..., transformer.h.3...
_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def layers_beyond_weights(path: Path) -> str | None:
    """What is wrong when config.json's num_hidden_layers exceeds the layers its safetensors weights hold (None when
    it does not, or the weights' names are not recognised): transformers would allocate and initialise the missing
    layers, as many as the config asks for, before any check of the weights, so a config edited to 40 layers over
    3 layers' weights costs 40 layers of memory first. Only the files' headers are read."""
    from safetensors import SafetensorError, safe_open

    cfg = load_json(path / "config.json")
    n = cfg.get("num_hidden_layers") if isinstance(cfg, dict) else None
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    found = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                found.update(int(m[1]) for k in st.keys() if (m := _LAYER_KEY.search(k)))
        except (SafetensorError, OSError):  # a damaged file is named by whatever loads it next
            return None
    if found and n > max(found) + 1:
        return (f"{path / 'config.json'}: num_hidden_layers is {n}, but its weights hold {max(found) + 1} layers; "
                "the config does not describe these weights (restore the folder's config.json)")
    return None


def hub_blobs(directory: str | Path) -> Path | None:
    """REPO/blobs (resolved) when `directory` is a snapshot of the hub's download cache (REPO/snapshots/<revision>,
    what `snapshot_download(id)` returns), whose files are links into the repo's blobs; None otherwise."""
    real = Path(directory).resolve()
    blobs = real.parent.parent / "blobs"
    return blobs if real.parent.name == "snapshots" and blobs.is_dir() else None


def looks_like_path(name: str) -> bool:
    # a hub id is "owner/name"; anything else with a separator, or starting like a path, is a local path
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or "\\" in name
