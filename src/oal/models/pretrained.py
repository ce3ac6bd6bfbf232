"""The converted model as a transformers model: its class, its saved form, and the checks made when reloading it.

`converted_class(Qwen2ForCausalLM)` is `OALQwen2ForCausalLM`, the family's class with `ConvertedModelMixin` in
front. `oal.convert` gives the model it converts this class (the instance keeps its own config), so the ordinary
`model.save_pretrained(d)` (also after peft's `merge_and_unload`) writes the converted form:
- config.json: the family's config as an "oal_<family>" config (`models.auto`), the conversion under "oal": per
  converted layer the method name, (Hq, Hkv, d), seed and constructor settings;
- model.safetensors: the base weights and, under `model.layers.<i>.self_attn.oal_method.*`, every parameter and
  persistent buffer of each method (OAL's factor and groups, Performer's random features, ...), in its own dtype
  (non-persistent buffers, such as SpectraFormer's Hadamard matrix, are rebuilt from the recorded settings);
- oal.json: the SHA256 of every file of the folder and where the model came from.

`from_pretrained` (also through `AutoModelForCausalLM` after `import oal`) checks those hashes first, builds the
family's model, converts the recorded layers in __init__, and lets transformers load everything from the one state
dict. A tensor missing from the checkpoint, or one it does not expect, is an error: transformers would otherwise
re-initialise a missing kernel and carry on.

Dtypes: the methods are built in fp32 whatever `dtype=` asks for, and transformers loads each tensor in the dtype of
the parameter it fills, so kernels stay fp32 (and fp64 random features fp64) under an fp16/bf16 base, as they are in
memory after `oal.convert` (design.md: kernels stay in fp32).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from oal.methods.base import AttentionMethod, build_method
from oal.models.attention import converted_methods, swap_attention
from oal.rundir.files import atomic_write_json
from oal.rundir.hashes import sha256_files, versions

__all__ = ["FORMAT", "MANIFEST", "ConvertedModelMixin", "build_methods", "conversion_spec", "read_json_object",
           "verify_manifest", "write_manifest"]

log = logging.getLogger("oal")

MANIFEST = "oal.json"
FORMAT = "oal-model/1"
SPEC_FORMAT = "oal-conversion/1"
_INIT_ATTRS = ("eps", "n_groups", "n_features", "chunk_size", "window", "sinks")  # JSON-able constructor settings


# ----------------------------------------------------------------------------------------------- conversion spec


def _method_info(m: AttentionMethod) -> dict:
    init = {a: getattr(m, a) for a in _INIT_ATTRS
            if isinstance(getattr(m, a, None), (int, float)) and not isinstance(getattr(m, a), bool)}
    if isinstance(getattr(m, "dtype", None), torch.dtype):
        init["dtype"] = str(m.dtype).removeprefix("torch.")
    return {"method": m.name, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim,
            "seed": m.seed, "init": init}


def conversion_spec(model: nn.Module) -> dict:
    """What config.json records under "oal": how to rebuild each converted layer's method (tensors aside)."""
    methods = converted_methods(model)
    if not methods:
        raise ValueError("model: it has no converted layers; call oal.convert first")
    return {"format": SPEC_FORMAT, "layers": {str(i): _method_info(m) for i, m in sorted(methods.items())}}


@contextlib.contextmanager
def _fp32_on_cpu():
    """Build methods on the CPU in fp32 even inside from_pretrained's meta-device / target-dtype context."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(old)


def _build(layer: int, info: dict) -> AttentionMethod:
    try:
        init = dict(info.get("init", {}))
        if "dtype" in init:
            init["dtype"] = getattr(torch, init["dtype"])
        return build_method(info["method"], info["n_heads"], info["n_kv_heads"], info["head_dim"], layer_idx=layer,
                            seed=info.get("seed", 0), **init)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.oal: layer {layer}: cannot rebuild the method from {info!r} ({exc})") from None


def build_methods(spec) -> dict[int, AttentionMethod]:
    """layer -> freshly built method, as `conversion_spec` recorded them (the tensors come from the checkpoint)."""
    if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT or not isinstance(spec.get("layers"), dict):
        got = spec.get("format") if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"config.oal: expected a conversion of format {SPEC_FORMAT!r}, got {got!r}")
    with _fp32_on_cpu():
        return {int(key): _build(int(key), info) for key, info in spec["layers"].items()}


# ----------------------------------------------------------------------------------------------- manifest


def write_manifest(directory: str | Path, source: dict | None = None) -> Path:
    """DIR/oal.json: SHA256 of every model file in DIR (config, weights, tokenizer, adapter) and their origin."""
    directory = Path(directory)
    files = {k: v for k, v in sha256_files(directory).items() if k != MANIFEST and not k.startswith(".")}
    return atomic_write_json(directory / MANIFEST, {"format": FORMAT, "sha256": files, "source": source or {},
                                                     "versions": versions()})


def read_json_object(path: Path, expected: str) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is missing, not JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; expected {expected}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); expected {expected}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {expected}, got a JSON {type(data).__name__}")
    return data


def verify_manifest(directory: str | Path) -> dict:
    """Check DIR/oal.json and the hash of every file it lists; ValueError naming the first file that fails."""
    from oal.models.provenance import file_sha256

    directory = Path(directory)
    path = directory / MANIFEST
    manifest = read_json_object(path, "the manifest of a converted model folder (written by `oal export` or by "
                                      "save_pretrained of a converted model)")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: expected format {FORMAT!r}, got {manifest.get('format')!r}")
    files = manifest.get("sha256")
    if not isinstance(files, dict) or "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"{path}: expected the hashes of config.json and the .safetensors weights")
    for name, want in sorted(files.items()):
        f = directory / name
        if not f.is_file():
            raise ValueError(f"{f}: missing (listed in {MANIFEST})")
        if file_sha256(f) != want:
            raise ValueError(f"{f}: SHA256 does not match {MANIFEST} (file changed or corrupt)")
    return manifest


# ----------------------------------------------------------------------------------------------- the model class


def _as_converted_config(config, spec: dict, cls: type):
    """A copy of `config` as the "oal_<family>" config `cls` carrying `spec`."""
    data = config.to_dict()
    data.pop("model_type", None)
    data["oal"] = spec
    return cls.from_dict(data)


def _restore_non_persistent(model: nn.Module) -> None:
    """Rebuild what a checkpoint does not hold: the methods' non-persistent buffers (SpectraFormer's Hadamard
    matrix, ...), which from_pretrained leaves uninitialised (the family's own _init_weights does not know them)."""
    for i, m in converted_methods(model).items():
        names = [n for n, _ in m.named_buffers(recurse=False) if n in m._non_persistent_buffers_set]
        if names:
            with _fp32_on_cpu():
                fresh = _build(i, _method_info(m))
            for n in names:
                m.get_buffer(n).copy_(fresh.get_buffer(n))


class ConvertedModelMixin:
    """In front of a family's causal-LM class: convert in __init__, save and reload the converted form."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        spec = getattr(config, "oal", None)
        if spec is None:
            raise ValueError(f"config: {type(self).__name__} needs the conversion under config.oal "
                             "(a config saved from a converted model)")
        swap_attention(self, methods=build_methods(spec))

    def save_pretrained(self, save_directory, *args, oal_source: dict | None = None, **kwargs):
        """transformers' save_pretrained with the config as an "oal_<family>" config, then DIR/oal.json."""
        if getattr(self, "_hf_peft_config_loaded", False):
            raise ValueError("model: transformers would save only its LoRA adapter; merge it into the weights first, "
                             "or export the run with `oal export`")
        config = self.config
        self.config = _as_converted_config(config, conversion_spec(self), type(self).config_class)
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config = config
        write_manifest(save_directory, oal_source)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained after checking DIR/oal.json; every checkpoint tensor must fit the model."""
        if pretrained_model_name_or_path is not None:
            if Path(pretrained_model_name_or_path).is_dir():
                verify_manifest(pretrained_model_name_or_path)
            else:
                log.warning("%s is not a local folder: its file hashes (oal.json) are not checked",
                            pretrained_model_name_or_path)
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("use_safetensors", True)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        _restore_non_persistent(model)
        bad = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            details = "; ".join(f"{k.replace('_', ' ')}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
                                for k, v in bad.items())
            raise ValueError(f"{pretrained_model_name_or_path}: the weights do not fit the converted model ({details})")
        return (model, info) if want_info else model


