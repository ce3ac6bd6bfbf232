"""Save and load converted kernels: `DIR/kernels.safetensors` + `DIR/kernels.json`, no pickle anywhere.

kernels.safetensors holds every parameter and buffer of each converted layer's method under
`layers.<i>.<name>` (for OAL: `factor` [Hq, G+1, G+1] and `groups` [Hq, d]). kernels.json holds what is needed
to rebuild and to refuse a wrong base model: per layer the method name and construction version (a record of
another version is refused, or rebuilt as it computed: `methods.base.record_settings`), (Hq, Hkv, d) and
constructor settings (eps, n_groups; window and sinks of the sliding windows), the base model's id, revision,
architecture fingerprint, file hashes and the SHA256 of its tensors (`state_dict_sha256`, with the dtype it was
computed in), and the SHA256 of the tensor file, whose header holds the SHA256 of the rest of kernels.json in turn
(`record_sha256`): neither file changes unseen. Both are written to a temporary name and renamed into place.
`load` checks the base model against that record: a model object by its tensors, a name/path by its tensors and by
every file of its folder.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from oal.methods.base import AttentionMethod, build_method, check_version, get_method, record_settings
from oal.models.pretrained import check_records
from oal.rundir.files import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors, to_jsonable
from oal.rundir.hashes import header_binds, record_header, sha256_file

__all__ = ["KERNELS_FILE", "META_FILE", "check_kernels_base", "kernel_dir", "load_kernels", "method_from_record",
           "method_record", "model_fingerprint", "recorded_base_model", "save_kernels"]

KERNELS_FILE = "kernels.safetensors"
META_FILE = "kernels.json"
FORMAT = "oal-kernels/1"
_INIT_ATTRS = ("eps", "n_groups", "window", "sinks")  # JSON-able constructor settings read off a method when present


def kernel_dir(run_dir: str | Path, method: str) -> Path:
    """Where a run directory keeps `method`'s kernels: OAL's at the top (design.md), the others below."""
    return Path(run_dir) if method == "oal" else Path(run_dir) / "kernels" / method


def model_fingerprint(model: nn.Module) -> dict:
    """Architecture facts a kernel file must agree with (a different model of the same shape passes; use hashes)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_heads = cfg.num_attention_heads
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or n_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        "vocab_size": cfg.vocab_size,
    }


def _methods_of(model_or_methods) -> tuple[dict[int, AttentionMethod], nn.Module | None]:
    if isinstance(model_or_methods, Mapping):  # {1: "oal"} failed on str.state_dict, {} wrote a kernels file that
        # no model could load, and a key "a" a record that loading called damaged
        if not model_or_methods:
            raise ValueError("model_or_methods: expected a converted model or a dict layer index -> AttentionMethod, "
                             "got an empty dict")
        methods = {}
        for i, m in model_or_methods.items():
            try:
                index = None if isinstance(i, bool) else operator.index(i)  # numpy ints too
            except TypeError:
                index = None
            if index is None or index < 0:
                raise ValueError(f"model_or_methods: expected layer indices (integers >= 0) as keys, got {i!r}")
            if not isinstance(m, AttentionMethod):
                raise ValueError(f"model_or_methods[{i}]: expected an AttentionMethod (oal.methods.build_method), "
                                 f"got {type(m).__name__}")
            methods[index] = m
        return methods, None
    from oal.models.attention import converted_methods

    if not isinstance(model_or_methods, nn.Module) or not hasattr(model_or_methods, "config"):
        raise ValueError(f"model_or_methods: expected a converted model or a dict layer index -> AttentionMethod, "
                         f"got {type(model_or_methods).__name__}")
    if hasattr(model_or_methods, "peft_config"):  # its tensors (LoRA's too) are no base model's: `load` refused it
        raise ValueError("model_or_methods: it carries LoRA (a peft model, oal.add_lora's); its own save_pretrained "
                         "keeps the LoRA and the kernels, or merge_and_unload() it and save_pretrained the result")
    methods = converted_methods(model_or_methods)
    if not methods:
        raise ValueError("model_or_methods: the model has no converted layers; call oal.convert first")
    return methods, model_or_methods


def save_kernels(model_or_methods: nn.Module | Mapping[int, AttentionMethod], directory: str | Path, *,
                 base_model: str | None = None, revision: str | None = None,
                 model_hashes: Mapping[str, str] | None = None, fingerprint: Mapping | None = None,
                 extra: Mapping | None = None, provenance: Mapping | None = None) -> Path:
    """Write the kernels of a converted model (or a dict layer -> method) to `directory`; returns the JSON path.

    `oal.load(directory, base_model)` converts the base model again with them (and refuses another model).

    Args:
        model_or_methods: a converted model (`oal.linearize`, `oal.convert`, `oal.load`), whose tensors are
            fingerprinted here, or a dict layer index -> `AttentionMethod`.
        directory: the folder to write `kernels.safetensors` and `kernels.json` to (created when missing).
        base_model: the base model's name or path, recorded (default: the model's `config._name_or_path`).
        revision: its revision, recorded (default: `provenance`'s).
        model_hashes: SHA256 of its files, by name (default: `provenance`'s).
        fingerprint: its architecture facts (`model_fingerprint`; default: the model's).
        extra: anything JSON-able to record beside them (under `"extra"`).
        provenance: with a dict of methods, what `load_model` returns for the base model (file hashes,
            `state_dict_sha256`, dtype); without it `oal.load` refuses those kernels (no record of the weights).

    Returns:
        the path of the written `kernels.json`.

    Raises:
        ValueError: a model with no converted layers or with LoRA attached (a peft model), an empty dict or one of
            other keys or values, a `directory` that is a file.
    """
    from oal.models.provenance import weights_record

    methods, model = _methods_of(model_or_methods)
    _check_records(extra=extra, model_hashes=model_hashes, fingerprint=fingerprint)
    if provenance is not None and not isinstance(provenance, Mapping):  # read by key only, not written whole
        raise ValueError(f"provenance: expected a dict (load_model's), got {type(provenance).__name__}")
    provenance = dict(provenance or {})
    model_hashes = model_hashes or provenance.get("sha256")
    revision = revision or provenance.get("revision")
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"directory: expected a folder's path, got {type(directory).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"directory: {directory} is a file; expected a folder to write the kernels to")
    tensors, layers = {}, {}
    for i, m in sorted(methods.items()):
        layers[str(i)], state = method_record(m)
        tensors.update({f"layers.{i}.{name}": t for name, t in state.items()})
    content = {k: provenance[k] for k in ("state_dict_sha256", "dtype") if provenance.get(k)}
    if model is not None:
        fingerprint = fingerprint or model_fingerprint(model)
        base_model = base_model or getattr(model.config, "_name_or_path", None)
        content = weights_record(model)
    tensor_path = directory / KERNELS_FILE
    meta = {
        "format": FORMAT,
        "layers": layers,
        "base_model": {"name_or_path": base_model, "revision": revision, "fingerprint": dict(fingerprint or {}),
                       "hashes": dict(model_hashes or {}), **content},
        **({"extra": dict(extra)} if extra else {}),
    }
    # the tensors' header binds the record (each layer's method settings, the base model), whose SHA256 of the
    # tensors binds them in turn: an edited eps or base model in kernels.json is refused like an edited tensor
    atomic_save_safetensors(tensor_path, tensors, metadata=record_header(meta))
    meta["sha256"] = {KERNELS_FILE: sha256_file(tensor_path)}
    meta_path = directory / META_FILE
    atomic_write_json(meta_path, meta)
    return meta_path


def _check_records(**records) -> None:
    """Each of `records` (written whole into kernels.json) is None or a dict that JSON can hold: a list failed on
    dict(), a numpy number as a TypeError of the JSON writer, naming neither."""
    import json

    for name, value in records.items():
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"{name}: expected a dict, got {type(value).__name__}")
        try:
            json.dumps(dict(value), default=to_jsonable)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: not JSON-able ({exc})") from None


def load_kernels(directory: str | Path, *, fingerprint: Mapping | None = None,
                 ) -> tuple[dict[int, AttentionMethod], dict]:
    """Rebuild the methods saved in `directory`; returns (layer -> method, metadata).

    Raises ValueError on a missing/corrupt file, a hash mismatch, a fingerprint that differs from `fingerprint`,
    or tensors whose shapes do not fit the recorded method.
    """
    directory = Path(directory)
    meta_path, tensor_path = directory / META_FILE, directory / KERNELS_FILE
    for f in (meta_path, tensor_path):
        if not f.is_file():
            what = "is a directory, not a file" if f.is_dir() else "is missing"
            raise ValueError(f"{f}: {what} (a kernels folder holds the {META_FILE} and {KERNELS_FILE} that "
                             "oal.save_kernels writes)")
    meta = load_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{meta_path}: expected format {FORMAT!r}, got {got!r}")
    if not isinstance(meta.get("layers"), dict) or not isinstance(meta.get("base_model"), dict):
        raise ValueError(f"{meta_path}: damaged, expected 'layers' and 'base_model' records")
    want = (meta.get("sha256") or {}).get(KERNELS_FILE)
    if not want:
        raise ValueError(f"{meta_path}: records no SHA256 of {KERNELS_FILE}; cannot check it")
    if sha256_file(tensor_path) != want:
        raise ValueError(f"{tensor_path}: SHA256 does not match {META_FILE} (file changed or corrupt)")
    # kernels saved before the record was bound (None) load as before
    if header_binds(tensor_path, {k: v for k, v in meta.items() if k != "sha256"}) is False:
        raise ValueError(f"{meta_path}: its records (methods' settings, base model) are not those {KERNELS_FILE} "
                         "was saved with (edited after saving?)")
    if fingerprint is not None:
        saved = meta["base_model"].get("fingerprint") or {}
        diff = {k: (saved.get(k), v) for k, v in fingerprint.items() if k in saved and saved[k] != v}
        if diff:
            details = ", ".join(f"{k}: file {a!r} vs model {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"base_model: kernels in {directory} were made for another model ({details})")
    tensors = load_safetensors(tensor_path)
    _check_sizes(meta_path, meta, tensors, fingerprint or meta["base_model"].get("fingerprint"))
    methods = {}
    for key, info in meta["layers"].items():
        if not str(key).isdigit() or not isinstance(info, dict) or "method" not in info:
            raise ValueError(f"{meta_path}: damaged layer record {key!r}")
        i = int(key)
        prefix = f"layers.{i}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            methods[i] = method_from_record(i, info, state, where=str(tensor_path))
        except (TypeError, KeyError, AttributeError) as exc:  # a field of the wrong type or missing: the record's
            raise ValueError(f"{meta_path}: damaged layer record {key!r} ({type(exc).__name__}: {exc})") from None
    return methods, meta


def _check_sizes(meta_path: Path, meta: dict, tensors: Mapping, fingerprint) -> None:
    """The layer records against the model's shape (`fingerprint`: the model's, else the one the file records)
    before any method is built: a layer it lacks, another head shape, a non-finite setting, or sizes that would
    allocate far more than the kernels file holds; OAL builds a factor for its largest group id, whatever n_groups
    says, so the stored group ids count too."""
    keys = ("num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers")
    if not isinstance(fingerprint, Mapping) or not all(type(fingerprint.get(k)) is int for k in keys):
        fingerprint = _own_shape(meta["layers"])  # kernels saved from methods alone: their records' one shape
    sized = {}
    for key, info in meta["layers"].items():
        groups = tensors.get(f"layers.{key}.groups")
        if isinstance(info, dict) and groups is not None and groups.numel() and not groups.is_floating_point():
            init = info.get("init") if isinstance(info.get("init"), dict) else {}
            n_groups = init.get("n_groups", 2) if type(init.get("n_groups", 2)) is int else 2
            info = {**info, "init": {**init, "n_groups": max(n_groups, int(groups.max()) + 1, 1)}}
        sized[key] = info
    shape = tuple(fingerprint[k] for k in keys[:3])
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    check_records(sized, shape, fingerprint["num_hidden_layers"], nbytes, meta_path)


def _own_shape(layers: Mapping) -> dict:
    """A fingerprint of the (Hq, Hkv, d) the layer records share (one model has one), any number of layers; the
    first record's shape when they differ, which `check_records` then refuses for the others."""
    first = next((info for info in layers.values() if isinstance(info, dict)), {})
    return {"num_attention_heads": first.get("n_heads"), "num_key_value_heads": first.get("n_kv_heads"),
            "head_dim": first.get("head_dim"), "num_hidden_layers": 1 << 62}


def method_record(m: AttentionMethod) -> tuple[dict, dict]:
    """(constructor record, persistent tensors on the CPU): what `method_from_record` rebuilds `m` from, in a
    kernels file or in another process."""
    state = {name: t.detach().to("cpu").contiguous() for name, t in m.state_dict().items()}
    info = {"method": m.name, "version": m.version, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "seed": getattr(m, "seed", 0),
            "init": {a: getattr(m, a) for a in _INIT_ATTRS if isinstance(getattr(m, a, None), (int, float))}}
    return info, state


def _build_from_record(layer: int, info: Mapping, state: Mapping) -> AttentionMethod:
    """The method `info` describes as construction left it (its groups from `state` where it uses them)."""
    kwargs = record_settings(info)
    if "groups" in state and get_method(info["method"]).uses_groups:
        kwargs["groups"] = state["groups"]
    return build_method(info["method"], info["n_heads"], info["n_kv_heads"], info["head_dim"], layer_idx=layer,
                        seed=info.get("seed", 0), **kwargs)


def initial_method(m: AttentionMethod) -> AttentionMethod:
    """`m` before calibration: its trainable parameters at the values construction gives them (the same seed and
    layer), its buffers (groups, fixed random features) as they are. Where a baseline starts LoRA (App. F.1)."""
    info, state = method_record(m)
    fresh = _build_from_record(m.layer_idx, info, state)
    trained = {n for n, p in fresh.named_parameters() if p.requires_grad}
    fresh.load_state_dict({k: v for k, v in state.items() if k not in trained}, strict=False)
    where = next(iter([*m.parameters(), *m.buffers()]), None)
    return fresh if where is None else fresh.to(where.device)


def adaptation_start(m: AttentionMethod) -> AttentionMethod:
    """Where LoRA adaptation starts a converted layer's method (App. F.1-F.2): `m` itself for OAL and the learned
    global (their calibrated coefficients) and for a method with nothing to train; a baseline's `initial_method`."""
    return m if m.adapts_from_calibration or not m.trainable else initial_method(m)


def method_from_record(layer: int, info: Mapping, state: Mapping, *, where: str = "state") -> AttentionMethod:
    """The method of `layer` that `method_record` described; ValueError (naming `where`) when the tensors do not
    fit it or the record is of another construction version of the method (`methods.base.check_version`)."""
    check_version(info, f"{where}: layer {layer}")
    m = _build_from_record(layer, info, state)
    own = m.state_dict()
    bad = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if k in own and v.shape != own[k].shape}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if bad or missing or unexpected:
        raise ValueError(f"{where}: layer {layer} ({info['method']}) does not fit: shapes {bad}, "
                         f"missing {missing}, unexpected {unexpected}")
    m.load_state_dict(dict(state))
    return m


def recorded_base_model(directory: str | Path) -> str | None:
    """The base model's name/path recorded in `directory`/kernels.json (None when there is no kernels.json)."""
    meta_path = Path(directory) / META_FILE
    if not meta_path.is_file():
        return None
    meta = load_json(meta_path)
    base = meta.get("base_model") if isinstance(meta, dict) else None
    if not isinstance(base, dict):
        raise ValueError(f"{meta_path}: damaged, expected a 'base_model' record")
    return base.get("name_or_path")


def check_kernels_base(directory: str | Path, meta: Mapping, model: nn.Module, provenance: Mapping | None = None,
                       ) -> None:
    """Refuse `model` unless it is the base model the kernels in `directory` (metadata `meta`) were made for."""
    from oal.models.provenance import check_base_model

    check_base_model(meta["base_model"], model, provenance, where=str(Path(directory) / META_FILE))
