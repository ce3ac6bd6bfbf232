"""Load models by name: the embedded default, a local HF folder, or a pinned hub checkpoint; with provenance.

Provenance is read from the files actually loaded (SHA256 of every config/weight/tokenizer file), never from the
name the user typed: an Instruct checkpoint cannot pass as Base because its config and weight hashes differ from
the pinned Base ones (reproduction notes). A loaded model object is fingerprinted from its tensors
(`state_dict_sha256`), so an object can be checked against what an artefact was computed from
(`check_base_model`). Weights load from safetensors only: a folder with pickle weights only is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from oal.data.wikitext import hub_reachable
from oal.errors import InputError
from oal.runio import load_json, sha256_file

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_model"
HASHED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Converted layers keep their method under `self_attn.oal_method`; a base-model fingerprint leaves them out.
_METHOD_KEY = ".oal_method."


class ModelUnavailableError(RuntimeError):
    """A hub model that is neither reachable nor in the local cache."""


# Pinned hub checkpoints. `weights` gives (size in bytes, sha256) of a weight file where it is known;
# `base_config` lists config.json values that tell the Base checkpoint from its Instruct sibling.
HUB_MODELS: dict[str, dict] = {
    "Qwen/Qwen2.5-0.5B": {
        "revision": "060db6499f32faf8b98477b0a26969ef7d8b9987",
        "weights": {"model.safetensors": (988_097_824,
                                          "88c142557820ccad55bb59756bfcfcf891de9cc6202816bd346445188a0ed342")},
        # Base ends documents with <|endoftext|> (151643); Instruct's config says <|im_end|> (151645).
        "base_config": {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "eos_token_id": 151643},
        "preset": "qwen2.5-0.5b",
    },
    "meta-llama/Llama-3.2-1B": {
        "revision": "4e20de362430cd3b72f300e6b0f18e50e7166e08",
        "weights": {},  # no published weight hash in our notes: hashes are recorded, not checked
        # Base: eos 128001 only; Instruct lists [128001, 128008, 128009].
        "base_config": {"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "eos_token_id": 128001},
        "preset": "llama-3.2-1b",
    },
}

# Per-preset grouping / protocol settings (paper App. B, F.2). `layers=None` means default_layers' rule.
PRESETS: dict[str, dict] = {
    "default": {"model": "default", "layers": None, "alpha": 0.25, "gamma": 0.9, "tau": 1.5, "min_groups": 2,
                "n_bootstrap": 1000, "n_prompts": 40, "prompt_len": 128, "block_len": 256, "adapt_steps": 64,
                "val_blocks": 8, "plan": "default"},
    "qwen2.5-0.5b": {"model": "Qwen/Qwen2.5-0.5B", "layers": list(range(3, 21)), "alpha": 0.25, "gamma": 0.9,
                     "tau": 1.5, "min_groups": 2, "n_bootstrap": 1000, "n_prompts": 40, "prompt_len": 128,
                     "block_len": 4096, "adapt_steps": 512, "val_blocks": 32, "plan": "qwen2.5-0.5b"},
    "llama-3.2-1b": {"model": "meta-llama/Llama-3.2-1B", "layers": list(range(1, 15)), "alpha": 0.5, "gamma": 0.5,
                     "tau": 1.5, "min_groups": 2, "n_bootstrap": 1000, "n_prompts": 40, "prompt_len": 128,
                     "block_len": 4096, "adapt_steps": 512, "val_blocks": 32, "plan": "llama-3.2-1b"},
}


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
                         "or from bare methods); recompute it")
    dtype = recorded.get("dtype")
    have = state_dict_sha256(model, dtype)
    label = (provenance or {}).get("model") or getattr(getattr(model, "config", None), "_name_or_path", None) or "?"
    if have != want:
        own = model_dtype(model)
        note = (f"; that record is of the model in {dtype} and this one is {own}: load it with dtype={dtype}"
                if dtype and own != dtype else "")
        raise ValueError(f"base_model: the weights of {label!r} (sha256 {_short(have)}) differ from the base model "
                         f"recorded in {where} ({name!r}, sha256 {_short(want)}){note}")
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


def _bad_model(message: str) -> InputError:
    return InputError(message, "--model", "name_or_path")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _check_model_folder(path: Path, architectures: Mapping[str, str] | None = None) -> None:
    """A loadable HF folder: config.json, a supported architecture (model_type -> class name; default: the causal
    LMs of `models.capture`), safetensors weights (never pickle)."""
    if not (path / "config.json").is_file():
        raise _bad_model(f"{path} is not a Hugging Face model folder (no config.json)")
    cfg = load_json(path / "config.json")
    if architectures is None:
        from .capture import SUPPORTED_ARCHITECTURES as architectures

    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in architectures:
        archs = (cfg.get("architectures") if isinstance(cfg, dict) else None) or ["?"]
        raise _bad_model(f"{path}: unsupported architecture {archs[0]} (model_type={model_type!r}); supported: "
                         f"{', '.join(f'{v} ({k})' for k, v in architectures.items())}")
    files = [p.name for p in path.iterdir() if p.is_file()]
    if not any(f.endswith(".safetensors") for f in files):
        pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise _bad_model(
                f"{path} holds pickle weights only ({', '.join(pickles)}); oal loads safetensors only, since "
                "unpickling can run code. Convert once, where you trust the file: "
                "AutoModelForCausalLM.from_pretrained(PATH, use_safetensors=False).save_pretrained(NEW_PATH) "
                "(writes model.safetensors), then pass NEW_PATH")
        raise _bad_model(f"{path} holds no weights (no *.safetensors file)")


def _looks_like_path(name: str) -> bool:
    # a hub id is "owner/name"; anything else with a separator, or starting like a path, is a local path
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or "\\" in name


def identify(path: str | Path) -> tuple[str | None, dict]:
    """Which pinned hub checkpoint a folder is, judged by its files; returns (hub id or None, evidence).

    A folder is identified as a pinned Base model only when its config matches the Base config values and every
    known weight hash matches. The evidence lists every check and its outcome.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return None, {"reason": "no config.json"}
    cfg = load_json(cfg_path)
    evidence: dict = {}
    for hub_id, spec in HUB_MODELS.items():
        base = spec["base_config"]
        shape_keys = ("model_type", "num_hidden_layers", "hidden_size")
        if any(cfg.get(k) != base[k] for k in shape_keys):
            continue
        checks = {f"config.{k}": cfg.get(k) == v for k, v in base.items()}
        for fname, (size, sha) in spec["weights"].items():
            f = path / fname
            checks[f"{fname}.size"] = f.is_file() and f.stat().st_size == size
            checks[f"{fname}.sha256"] = bool(checks[f"{fname}.size"]) and file_sha256(f) == sha
        evidence[hub_id] = checks
        if all(checks.values()):
            return hub_id, evidence
    return None, evidence


def _resolve_hub(name: str, revision: str | None) -> tuple[Path, str]:
    spec = HUB_MODELS.get(name)
    if revision is None:
        if spec is None:
            raise _bad_model(f"{name!r} is not 'default', a local folder or a pinned hub model "
                             f"({sorted(HUB_MODELS)}); pass revision= to load another hub model")
        revision = spec["revision"]
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
    online = hub_reachable()
    try:
        path = snapshot_download(name, revision=revision, allow_patterns=patterns, local_files_only=not online)
    except Exception as exc:  # hub raises several error types; all mean "not available here"
        why = "reachable" if online else "unreachable or HF_HUB_OFFLINE is set, and the files are not cached"
        raise ModelUnavailableError(
            f"model {name}@{revision}: hub {why} ({type(exc).__name__}: {exc}). Download it where the hub is "
            f"reachable and pass the local folder instead, or use the embedded model ('default')."
        ) from exc
    return Path(path), revision


def load_model(name_or_path: str | Path = "default", *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               revision: str | None = None, expect: str | None = None):
    """Load (model, tokenizer, provenance).

    - "default": the embedded byte-level Qwen2 model shipped in the package (offline);
    - a local folder in HF format;
    - a hub id: the pinned revision of `HUB_MODELS` (or `revision=`), from the hub or the local HF cache.

    `expect="Qwen/Qwen2.5-0.5B"` (etc.) demands that the files be that pinned Base checkpoint; a mismatch (for
    example an Instruct checkpoint) raises ValueError. Hub ids in HUB_MODELS are always checked this way.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
    name = str(name_or_path)
    source, rev = "local", None
    if name == "default":
        path, source = DEFAULT_MODEL_DIR, "package"
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"name_or_path: the embedded model is missing from {path}; "
                             "build it with scripts/train_embedded_model.py")
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        from .encoder import is_encoder_model

        if is_encoder_model(path):  # AutoModelForCausalLM would bolt a random LM head onto it
            raise _bad_model(f"{name} is an encoder (BERT family): `oal run --model` runs the encoder protocol, "
                             "and oal.models.encoder.load_encoder loads it")
    elif Path(name).exists():
        raise _bad_model(f"{name} is a file; expected 'default', a model folder or a hub id")
    elif "/" in name and not _looks_like_path(name):
        path, rev = _resolve_hub(name, revision)
        source = "hub"
        if name in HUB_MODELS:
            expect = expect or name
    elif "/" in name or "\\" in name:
        raise _bad_model(f"no such model folder: {name}")
    else:
        raise _bad_model(f"expected 'default', a local model folder or a hub id (owner/name), got {name!r}")
    _check_model_folder(path)

    identified, evidence = identify(path)
    if expect is not None and identified != expect:
        failed = {k: v for k, v in evidence.get(expect, {}).items() if not v}
        raise ValueError(f"model {name}: files are not the pinned {expect} Base checkpoint "
                         f"(failed checks: {failed or 'architecture differs'}); refusing to label it {expect}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _bad_model(f"{path}: cannot load its tokenizer ({_first_line(exc)})") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     use_safetensors=True).to(device)
    except (OSError, ValueError, KeyError) as exc:
        raise _bad_model(f"{path}: cannot load the model ({_first_line(exc)})") from exc
    model.eval()
    provenance = {
        "model": name,
        "identified_as": identified,
        "source": source,
        "path": str(Path(path).resolve()),
        "revision": rev or (HUB_MODELS[identified]["revision"] if identified else None),
        "architecture": type(model).__name__,
        "dtype": str(dtype).replace("torch.", ""),
        "sha256": hash_model_dir(path),
        **weights_record(model),
        "checks": evidence.get(identified, {}) if identified else evidence,
    }
    if source == "package":
        summary = path / "training_summary.json"
        if summary.is_file():
            meta = json.loads(summary.read_text())
            provenance["trained_on"] = meta.get("corpus", {})
            provenance["steps_trained"] = meta.get("steps_trained")
    return model, tokenizer, provenance


def preset_for(model_or_config) -> str:
    """The PRESETS key that fits a model (by architecture and shape), "default" otherwise."""
    cfg = getattr(model_or_config, "config", model_or_config)
    for spec in HUB_MODELS.values():
        base = spec["base_config"]
        if all(getattr(cfg, k, None) == base[k] for k in ("model_type", "num_hidden_layers", "hidden_size")):
            return spec["preset"]
    return "default"


def default_layers(model_or_config) -> list[int]:
    """Layers to convert: Qwen2.5-0.5B 3..20, Llama-3.2-1B 1..14 (App. F), otherwise all but the first and last.

    Models with fewer than 3 layers have no middle; all their layers are returned.
    """
    preset = PRESETS[preset_for(model_or_config)]
    if preset["layers"] is not None:
        return list(preset["layers"])
    cfg = getattr(model_or_config, "config", model_or_config)
    n = int(cfg.num_hidden_layers)
    return list(range(1, n - 1)) if n >= 3 else list(range(n))
