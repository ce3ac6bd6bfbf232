"""The converted model as a transformers model: its class, its saved form, and the checks made when reloading it.

`converted_class(Qwen2ForCausalLM)` is `OALQwen2ForCausalLM`, the family's class with `ConvertedModelMixin` in
front. `oal.convert` gives the model it converts this class (the instance keeps its own config), so the ordinary
`model.save_pretrained(d)` (also after peft's `merge_and_unload`) writes the converted form:
- config.json: the family's config as an "oal_<family>" config (`models.auto`), the conversion under "oal": per
  converted layer the method name, (Hq, Hkv, d), seed and constructor settings; an unmerged LoRA adapter's peft
  config under "oal.lora";
- model.oal.safetensors (transformers' weights *variant* "oal"): the base weights and, under
  `model.layers.<i>.self_attn.oal_method.*`, every parameter and persistent buffer of each method (OAL's factor and
  groups, Performer's random features, ...), in its own dtype (non-persistent buffers, such as SpectraFormer's
  Hadamard matrix, are rebuilt from the recorded settings). The variant name is what keeps the family's own class
  (`Qwen2ForCausalLM.from_pretrained(DIR)`) from loading the weights as a softmax model: it looks for
  model.safetensors and fails ("no file named model.safetensors");
- adapter_model.safetensors (unmerged exports only): the LoRA tensors, under peft's state-dict names. There is no
  adapter_config.json, so neither peft (`PeftModel` / `AutoPeftModelForCausalLM`) nor transformers' own adapter
  detection attaches this LoRA to a softmax model; this class attaches it after loading;
- oal.json: the SHA256 of every file that defines the model (all but README.md, generation_config.json and hidden
  files, which routine edits change) and where the model came from.

`from_pretrained` (also through `AutoModelForCausalLM` after `import oal`) checks those hashes first (file names in
oal.json are confined to the folder; pickle files are refused), builds the family's model, converts the recorded
layers in __init__, and lets transformers load everything from the one state dict. A tensor missing from the
checkpoint, or one it does not expect, is an error: transformers would otherwise re-initialise a missing kernel and
carry on.

Dtypes: the methods are built in fp32 whatever `dtype=` asks for, and transformers loads each tensor in the dtype of
the parameter it fills, so kernels stay fp32 (and fp64 random features fp64) under an fp16/bf16 base, as they are in
memory after `oal.convert` (design.md: kernels stay in fp32).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
from contextvars import ContextVar
from pathlib import Path, PurePosixPath

import torch
from torch import nn

from oal.methods.base import AttentionMethod, build_method, check_version, record_settings
from oal.models.attention import _head_shape, converted_methods, dispatch_name, swap_attention
from oal.models.folders import first_line, hub_blobs, layers_beyond_weights
from oal.rundir.confine import escaping_links
from oal.rundir.files import atomic_save_safetensors, atomic_write_json, check_json_size
from oal.rundir.hashes import sha256_file, versions

__all__ = ["FORMAT", "LORA_FILE", "MANIFEST", "UNHASHED", "VARIANT", "ConvertedModelMixin", "build_methods",
           "confined_file", "conversion_spec", "read_json_object", "verify_manifest", "write_manifest"]

log = logging.getLogger("oal")

MANIFEST = "oal.json"
FORMAT = "oal-model/2"  # /1: weights in model.safetensors (the family class loaded them as softmax), peft adapter
VARIANT = "oal"  # the weights file is model.oal.safetensors (transformers' `variant`)
LORA_FILE = "adapter_model.safetensors"  # LoRA tensors: peft's SAFETENSORS_WEIGHTS_NAME (not imported: 4 s)
UNHASHED = frozenset({"README.md", "generation_config.json"})  # routine edits (model card, sampling defaults)
# JSON files hashed without the keys that change no number (tokenizer_config.json's model_max_length, which
# transformers writes as 1e30 for "no limit": a user may set the true one), so that editing them keeps the folder
# loadable; every other key, and every other file, is bound byte for byte.
FREE_KEYS = {"tokenizer_config.json": ("model_max_length",)}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# What transformers' Trainer writes beside the model in a checkpoint-N folder: its own state, which from_pretrained
# never reads (refused as added pickle files, a checkpoint could not be loaded for evaluation).
_TRAINER_STATE = re.compile(r"optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|training_args\.bin|trainer_state\.json"
                            r"|rng_state(_\d+)?\.pth")
SPEC_FORMAT = "oal-conversion/1"
_INIT_ATTRS = ("eps", "n_groups", "n_features", "chunk_size", "window", "sinks")  # JSON-able constructor settings


# ----------------------------------------------------------------------------------------------- conversion spec


def _method_info(m: AttentionMethod) -> dict:
    init = {a: getattr(m, a) for a in _INIT_ATTRS
            if isinstance(getattr(m, a, None), (int, float)) and not isinstance(getattr(m, a), bool)}
    if isinstance(getattr(m, "dtype", None), torch.dtype):
        init["dtype"] = str(m.dtype).removeprefix("torch.")
    return {"method": m.name, "version": m.version, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "seed": m.seed, "init": init}


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


# Integer settings a record may hold, and their least value; what construction allocates grows with them.
_INT_SETTINGS = {"n_groups": 1, "n_features": 1, "chunk_size": 1, "window": 0, "sinks": 0}
_DTYPES = ("float16", "bfloat16", "float32", "float64")
# What construction may allocate beyond the tensors a checkpoint holds (buffers rebuilt, not saved: a Hadamard
# matrix); a record that asks for more is refused before anything is built.
_SLACK_BYTES = 256 << 20


def _construction_bytes(shape: tuple[int, int, int], init: dict) -> int:
    """An upper bound of what building one method allocates: per-(head, dim) tensors (groups, features of
    `n_features` each), an (n_groups + 1)^2 factor per head, and square matrices of the next power of two >= d."""
    n_heads, _, d = shape
    p = 1 << max(0, (d - 1).bit_length())
    per_head = d * (1 + init.get("n_features", 1)) + (init.get("n_groups", 2) + 1) ** 2
    return 8 * (n_heads * per_head + 2 * p * p)


def _check_init(where: str, init) -> None:
    if not isinstance(init, dict):
        raise ValueError(f"{where}: 'init' must be a JSON object of settings, got {type(init).__name__}")
    for name, v in init.items():
        low = _INT_SETTINGS.get(name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{where}: {name} is {v}; expected a finite number")
        if low is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"{where}: {name} must be an integer >= {low}, got {v!r}")
        if name == "dtype" and v not in _DTYPES:
            raise ValueError(f"{where}: dtype must be one of {', '.join(_DTYPES)}, got {v!r}")


def check_records(layers, shape: tuple[int, int, int], n_layers: int, file_bytes: int | None, where) -> None:
    """Refuse, before any method is built, saved layer records (config.oal's, kernels.json's) that do not fit the
    model: a layer it does not have, another (Hq, Hkv, d), settings of the wrong type, a non-finite number, or sizes
    whose construction would allocate far more than the `file_bytes` of tensors saved with them (a downloaded file
    asking for tens of GB). ValueError naming `where`."""
    if not isinstance(layers, dict):
        raise ValueError(f"{where}: expected a JSON object of layer records, got {type(layers).__name__}")
    total = 0
    for key, info in layers.items():
        here = f"{where}: layer {key!r}"
        if not (isinstance(key, str) and key.isdecimal() and int(key) < n_layers) or not isinstance(info, dict):
            raise ValueError(f"{here}: expected a record of one of the model's layers 0..{n_layers - 1}")
        got = tuple(info.get(k) for k in ("n_heads", "n_kv_heads", "head_dim"))
        if not all(type(v) is int and v >= 1 for v in got) or got != tuple(shape):
            raise ValueError(f"{here}: built for (Hq, Hkv, d) = {got}, the model has {tuple(shape)}")
        seed = info.get("seed", 0)
        if type(seed) is not int or not 0 <= seed < 1 << 63:
            raise ValueError(f"{here}: seed must be an integer in [0, 2^63), got {seed!r}")
        _check_init(here, info.get("init", {}))
        total += _construction_bytes(shape, info.get("init", {}))
    if file_bytes is not None and total > file_bytes + _SLACK_BYTES:
        raise ValueError(f"{where}: its layers would allocate {total / 2**30:.1f} GiB when built, far more than the "
                         f"{file_bytes} bytes of tensors saved with them; refusing a damaged or hostile record")


# The local folder being loaded (`from_pretrained`) and the bytes of its weights, which bound what building the
# recorded methods may allocate (`check_records`); None otherwise (a hub id, a config built in memory).
_LOADING: ContextVar[tuple[Path, int] | None] = ContextVar("oal_loading", default=None)


def _loading(directory) -> tuple[Path, int] | None:
    if directory is None or not Path(directory).is_dir():
        return None
    directory = Path(directory)
    return directory, sum(p.stat().st_size for p in directory.iterdir() if p.suffix == ".safetensors" and p.is_file())


def _where() -> str:
    """How errors name the conversion record: with its file while a folder loads."""
    loading = _LOADING.get()
    return f"{loading[0] / 'config.json'}: config.oal" if loading else "config.oal"


def _build(layer: int, info: dict) -> AttentionMethod:
    try:
        init = record_settings(info)
        if "dtype" in init:
            init["dtype"] = getattr(torch, init["dtype"])
        m = build_method(info["method"], info["n_heads"], info["n_kv_heads"], info["head_dim"], layer_idx=layer,
                         seed=info.get("seed", 0), **init)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{_where()}: layer {layer}: cannot rebuild the method from {info!r} ({exc})") from None
    check_version(info, f"{_where()}: layer {layer}")  # the checkpoint's tensors were made for this construction
    return m


def build_methods(spec) -> dict[int, AttentionMethod]:
    """layer -> freshly built method, as `conversion_spec` recorded them (the tensors come from the checkpoint)."""
    if not isinstance(spec, dict) or spec.get("format") != SPEC_FORMAT or not isinstance(spec.get("layers"), dict):
        got = spec.get("format") if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"{_where()}: expected a conversion of format {SPEC_FORMAT!r}, got {got!r}")
    with _fp32_on_cpu():
        return {int(key): _build(int(key), info) for key, info in spec["layers"].items()}


# ----------------------------------------------------------------------------------------------- manifest


def write_manifest(directory: str | Path, source: dict | None = None) -> Path:
    """DIR/oal.json: SHA256 of every file that defines the model in DIR (config, weights, tokenizer, LoRA; not the
    `UNHASHED` files nor hidden ones) and their origin."""
    directory = Path(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory)
        if p.is_file() and rel.as_posix() not in UNHASHED | {MANIFEST} and not any(
                x.startswith(".") for x in rel.parts):
            files[rel.as_posix()] = _digest(p, rel.as_posix())
    return atomic_write_json(directory / MANIFEST, {"format": FORMAT, "sha256": files, "source": source or {},
                                                     "versions": versions()})


def _digest(path: Path, name: str, recorded: str | None = None) -> str:
    """What oal.json records of a file: its SHA256, or for a `FREE_KEYS` file that is a JSON object,
    "json-without-KEYS:" + the SHA256 of its canonical JSON without those keys. With `recorded` (a manifest's
    value), the digest of that kind (a manifest of an earlier oal holds plain SHA256 for every file)."""
    free = FREE_KEYS.get(name)
    prefix = f"json-without-{','.join(free)}:" if free else None
    if prefix is None or (recorded is not None and not str(recorded).startswith(prefix)):
        return sha256_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if not isinstance(data, dict):
        return sha256_file(path)
    text = json.dumps({k: v for k, v in data.items() if k not in free}, sort_keys=True, separators=(",", ":"))
    return prefix + hashlib.sha256(text.encode()).hexdigest()


def read_json_object(path: Path, expected: str) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is missing, not JSON or not an object."""
    try:
        check_json_size(path)
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; expected {expected}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); expected {expected}") from None
    except RecursionError:  # json's C parser recurses once per level of nesting
        raise ValueError(f"{path}: nested too deeply; expected {expected}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {expected}, got a JSON {type(data).__name__}")
    return data


def confined_file(directory: str | Path, name, where: str | Path) -> Path:
    """`directory / name` for a file name read from `where` (a manifest): a relative path below `directory` (no
    absolute path, no `..`, no link out of it); ValueError naming `where` for anything else."""
    directory = Path(directory)
    path = PurePosixPath(name) if isinstance(name, str) and name and name.isprintable() else None  # no NUL, no \n
    if path is None or path.is_absolute() or ".." in path.parts or "\\" in name or path.as_posix() != name:
        raise ValueError(f"{where}: file name {name!r} is not a plain relative path inside {directory}")
    f = directory / path
    blobs = hub_blobs(directory)  # a snapshot's files are links to the downloaded blobs: theirs to lead to
    if not (f.resolve().is_relative_to(directory.resolve()) or blobs and f.resolve().is_relative_to(blobs)):
        raise ValueError(f"{where}: {name!r} leads outside {directory}")
    return f


def verify_manifest(directory: str | Path) -> dict:
    """Check DIR/oal.json and the hash of every file it lists; ValueError naming the first file that fails."""
    directory = Path(directory)
    path = directory / MANIFEST
    manifest = read_json_object(path, "the manifest of a converted model folder (written by `oal export` or by "
                                      "save_pretrained of a converted model)")
    if manifest.get("format") == "oal-model/1":
        raise ValueError(f"{path}: a folder of an earlier oal (format 'oal-model/1', whose weights the family's "
                         "own class loads as softmax); write it again with `oal export` or save_pretrained")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: expected format {FORMAT!r}, got {manifest.get('format')!r}")
    files = manifest.get("sha256")
    if not isinstance(files, dict) or "config.json" not in files or not any(
            isinstance(f, str) and f.endswith(".safetensors") for f in files):
        raise ValueError(f"{path}: expected the hashes of config.json and the .safetensors weights")
    for name, want in sorted(files.items()):
        f = confined_file(directory, name, path)
        if f.suffix in _PICKLE_SUFFIXES:
            raise ValueError(f"{path}: lists {name!r}, a pickle file; a converted model folder holds safetensors "
                             "weights only")
        if not f.is_file():
            raise ValueError(f"{f}: missing (listed in {MANIFEST})")
        if _digest(f, name, want) != want:
            raise ValueError(f"{f}: SHA256 does not match {MANIFEST} (file changed or corrupt)")
    blobs = hub_blobs(directory)
    for link, target in escaping_links(directory, limit=1 << 20):  # transformers reads unlisted files too
        if blobs and Path(target).is_relative_to(blobs):
            continue
        raise ValueError(f"{link}: a symbolic link to {target}, outside {directory}; a converted model folder is read "
                         "from its own files only")
    # added after the manifest was written: weights or an adapter, which transformers would load; and where the
    # manifest records the tokenizer (`oal export` writes the whole folder), any other file, such as a
    # special_tokens_map.json or chat_template.jinja that transformers reads beside the recorded tokenizer files.
    # A folder of save_pretrained records the model only: the caller saves its tokenizer beside it afterwards.
    closed = any(name.startswith("tokenizer") for name in files)
    listed_dirs = {Path(name).parts[0] for name in files if len(Path(name).parts) > 1}
    extra = sorted(p.name for p in directory.iterdir() if p.name not in files and not _TRAINER_STATE.fullmatch(p.name)
                   and (p.suffix in (".safetensors", *_PICKLE_SUFFIXES) or ".index." in p.name
                        or p.name == "adapter_config.json"
                        or closed and p.name not in (*UNHASHED, MANIFEST, *listed_dirs) and not p.name.startswith(".")))
    if extra:
        raise ValueError(f"{directory / extra[0]}: not recorded in {MANIFEST} (added to the folder after it was "
                         "written: weights, an adapter or tokenizer files change what the model computes); remove "
                         "it, or export the model again")
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


def _check_variant(variant) -> None:
    if variant not in (None, VARIANT):
        raise ValueError(f"variant: a converted model's weights are transformers' {VARIANT!r} variant "
                         f"(model.{VARIANT}.safetensors), got {variant!r}")


def _loading_problems(info: dict) -> str:
    bad = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return "; ".join(f"{k.replace('_', ' ')}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
                     for k, v in bad.items() if v)


def _attach_lora(model, where, record, kwargs: dict) -> None:
    """An unmerged export's LoRA (its peft config in config.oal.lora, its tensors in adapter_model.safetensors)
    attached through transformers' own adapter support (`load_adapter`), read from safetensors only."""
    from peft import PeftConfig
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    try:
        config = PeftConfig.from_peft_type(**record)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: config.oal.lora is not a peft adapter config ({exc})") from None
    hub = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder") if k in kwargs}
    tensors = load_file(cached_file(str(where), LORA_FILE, **hub))
    config.inference_mode = True
    info = model.load_adapter(adapter_name="default", peft_config=config, adapter_state_dict=tensors)
    problems = _loading_problems({k: getattr(info, k, None) for k in ("missing_keys", "unexpected_keys")})
    if problems:
        raise ValueError(f"{where}: {LORA_FILE} does not fit the LoRA adapter in config.oal.lora ({problems})")


class ConvertedModelMixin:
    """In front of a family's causal-LM class: convert in __init__, save and reload the converted form."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        spec = getattr(config, "oal", None)
        if spec is None:
            raise ValueError(f"config: {type(self).__name__} needs the conversion under config.oal "
                             "(a config saved from a converted model)")
        if isinstance(spec, dict):  # the sizes first: a record can ask construction for tens of GB
            n_layers = self.config.get_text_config().num_hidden_layers
            loading = _LOADING.get()
            check_records(spec.get("layers"), _head_shape(self), n_layers, loading and loading[1], _where())
        swap_attention(self, methods=build_methods(spec))

    def _apply(self, fn, *args, **kwargs):
        """What `model.to(torch.bfloat16)`, `.half()` and `.to(device)` run: the kernels' tensors (and their
        gradients) keep their precision under a half-precision cast, as `from_pretrained(dtype=...)`, `oal.load` and
        `oal export` leave them (oal.device: fp32 factors, fp64 features): a bf16 factor rounds the calibrated
        coefficients and loses AdamW's small updates. Device moves and float64 casts apply to them as to the rest."""
        kernel = set()
        for name, t in (*self.named_parameters(), *self.named_buffers()):
            if ".oal_method." in name:
                kernel.update({id(t)} | ({id(t.grad)} if t.grad is not None else set()))

        def keep_kernels(t):
            out = fn(t)
            if id(t) in kernel and out.dtype in (torch.float16, torch.bfloat16) and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_kernels, *args, **kwargs)

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        """transformers' switch of attention function, kept behind oal's dispatch: 'eager' becomes 'oal_eager' (the
        converted layers keep their kernel and cache; the others run eager). Plain 'eager' made the converted layers
        softmax again, and their OAL cache slots then fed softmax one key at a time."""
        if isinstance(attn_implementation, str) and not attn_implementation.startswith("oal_"):
            attn_implementation = dispatch_name(attn_implementation)
        return super().set_attn_implementation(attn_implementation, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, oal_source: dict | None = None,
                        lora: tuple[dict, dict] | None = None, **kwargs):
        """transformers' save_pretrained with the config as an "oal_<family>" config and the weights as the "oal"
        variant, then DIR/oal.json. `lora` = (peft config record, LoRA state dict) of an adapter kept unmerged: its
        tensors go to adapter_model.safetensors, its config under config.oal.lora (attached again on load)."""
        if getattr(self, "_hf_peft_config_loaded", False):
            raise ValueError("model: transformers would save only its LoRA adapter; merge it into the weights first, "
                             "or export the run with `oal export`")
        _check_variant(kwargs.pop("variant", None))
        self._check_reloadable()
        spec = conversion_spec(self)
        if lora is not None:
            spec["lora"] = lora[0]
        config = self.config
        self.config = _as_converted_config(config, spec, type(self).config_class)
        try:
            super().save_pretrained(save_directory, *args, variant=VARIANT, **kwargs)
        finally:
            self.config = config
        if lora is not None:
            atomic_save_safetensors(Path(save_directory) / LORA_FILE, lora[1])
        write_manifest(save_directory, oal_source)

    def _check_reloadable(self) -> None:
        """Only the class an Auto class maps the family to reloads (a causal LM; an encoder's base model): a task
        head's folder (BertForSequenceClassification) was written, then refused by every loader."""
        from oal.models.families import auto_class

        base = next(c for c in type(self).__mro__ if not issubclass(c, ConvertedModelMixin))  # OAL<Base> -> Base
        family = base.config_class.model_type
        _, mapping, _ = auto_class(family)
        loads = mapping[base.config_class] if base.config_class in mapping else None
        if base is not loads:
            what = f"{family} as {loads.__name__} only" if loads else f"no {family} model"
            raise ValueError(f"model: a converted {base.__name__} cannot be saved for reloading (oal saves and "
                             f"reloads {what}); keep it in memory, or save its state_dict with safetensors")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained after checking DIR/oal.json; every checkpoint tensor must fit the model; an
        unmerged LoRA adapter recorded in the config is attached."""
        # the folder transformers reads: `subfolder=` of a local folder (or of a hub repo) holds the model
        folder = None if pretrained_model_name_or_path is None else Path(pretrained_model_name_or_path,
                                                                         kwargs.get("subfolder") or "")
        if folder is not None:
            if folder.is_dir():
                verify_manifest(folder)
                beyond = layers_beyond_weights(folder)
                if beyond:  # before transformers allocates the layers the config asks for
                    raise ValueError(beyond)
            else:
                log.warning("%s is not a local folder: its file hashes (oal.json) are not checked", folder)
        want_info = kwargs.pop("output_loading_info", False)
        _check_variant(kwargs.pop("variant", None))
        kwargs["use_safetensors"] = True
        token = _LOADING.set(_loading(folder))
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  variant=VARIANT, **kwargs)
        except torch.OutOfMemoryError:  # not the folder's fault
            raise
        except (RuntimeError, IndexError, KeyError, TypeError) as exc:  # a config.json its weights do not fit
            message = first_line(exc)
            if "ignore_mismatched_sizes" in message:  # transformers points at a report it did not show
                message = "its config.json does not fit the shapes of its weights"
            raise ValueError(f"{pretrained_model_name_or_path}: cannot load the converted model ({message})") from exc
        finally:
            _LOADING.reset(token)
        _restore_non_persistent(model)
        problems = _loading_problems(info)
        if problems:
            raise ValueError(f"{pretrained_model_name_or_path}: the weights do not fit the converted model "
                             f"({problems})")
        lora = (getattr(model.config, "oal", None) or {}).get("lora")
        if lora is not None:
            _attach_lora(model, pretrained_model_name_or_path, lora, kwargs)
        return (model, info) if want_info else model
