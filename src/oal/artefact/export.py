"""A run's converted model as one artefact: export it to a folder (and load the folder back with `oal.load`).

    export("runs/default", "oal", "converted/")                      # one folder: config, weights, tokenizer
    model = oal.load("converted/")                                   # or, after `import oal`,
    model = AutoModelForCausalLM.from_pretrained("converted/")       # the standard route

The exported folder is what `save_pretrained` of the converted model writes (`models.pretrained`): the base weights
with the adapter merged into them (the run's arm as `artefact.arms.load_converted` builds it), the kernel tensors
in the same state dict (model.oal.safetensors: the family's own class finds no weights to load as softmax), the
conversion in config.json, and oal.json with the SHA256 of every file that defines the model and of the run files
it came from, plus a model card (README.md, `artefact.card`). `merge=False` keeps the LoRA adapter separate
(adapter_model.safetensors, its peft config under config.json's "oal.lora"), attached by oal's class on load; there
is no adapter_config.json, so peft's loaders cannot put it on a softmax model.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from oal.artefact.arms import load_converted
from oal.artefact.base_facts import base_model_facts, data_facts
from oal.artefact.card import card_metrics, write_card
from oal.artefact.folder_io import cast_base_weights, save_tokenizer, without_paths, writable_target
from oal.calibration.kernels import KERNELS_FILE, META_FILE
from oal.rundir.files import load_json
from oal.rundir.hashes import sha256_files
from oal.rundir.lock import locked_atomic_dir

__all__ = ["export", "save_converted", "softmax_twin"]

log = logging.getLogger("oal")


def save_converted(model, to: str | Path, tokenizer=None, source: dict | None = None,
                   metrics: dict | None = None) -> Path:
    """Write a converted model (or a peft model around one: its adapter stays separate) to `to`, atomically, with
    a model card (`metrics`: the run's numbers for this model, see `artefact.card`)."""
    from oal.adaptation.adapter import lora_record
    from oal.models.attention import is_converted

    to = Path(to)
    writable_target(to)
    peft = hasattr(model, "peft_config") and hasattr(model, "unload")
    base = model.get_base_model() if peft else model
    if not is_converted(base):
        raise ValueError("model: it has no converted layers; call oal.convert or oal.load first")
    with locked_atomic_dir(to) as tmp:  # what a killed export left beside `to` goes first
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp, getattr(base.config, "max_position_embeddings", None))
        lora = lora_record(model) if peft else None
        if peft:
            base = model.unload()  # LoRA layers out, base weights untouched; trained kernels stay in place
        base.save_pretrained(tmp, oal_source=source, lora=lora)  # config, weights, LoRA, generation config, oal.json
        write_card(tmp, base, source, metrics)
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, 0o644)  # writers that go through mkstemp leave 0600; these are ordinary shared files
    return to


def export(run_dir: str | Path, method: str, to: str | Path, *, adapter: bool | None = None, merge: bool = True,
           model: str | None = None, dtype: torch.dtype | None = None, metrics: dict | None = None,
           config: dict | None = None) -> Path:
    """Write the run's converted `method` model as one folder `to`; for `method="softmax"`, the reference arm as a
    plain transformers folder (`artefact.softmax_export`). `adapter` as in `artefact.arms.load_converted`: None
    includes the run's adapter for `method` when it has one, True requires it, False leaves it out.

    The folder reloads with `oal.load(to)`, or with `AutoModelForCausalLM.from_pretrained(to)` after `import oal`.
    `metrics`: the run's numbers to quote in the card, as metrics.json lays them out, from verified records only
    (`oal export` passes `oal.pipeline.publish.verified_metrics`); `config`: the run's config.json (its corpus
    record, for the card's data section). Without `metrics` the card quotes no number.
    """
    from oal.models.registry import identify

    if method == "softmax":  # the reference arm: a plain transformers model (artefact.softmax_export)
        from oal.artefact.softmax_export import export_softmax

        return export_softmax(run_dir, to, adapter=adapter, merge=merge, model=model, dtype=dtype, metrics=metrics,
                              config=config)
    run_dir = Path(run_dir)
    # loaded in the run's dtype (what its kernels and adapter were made on and are checked against), then cast
    mdl, tok, info = load_converted(run_dir, method, adapter, model=model, merge=merge)
    if dtype is not None:
        cast_base_weights(mdl, dtype)
    kdir = Path(info["kernels"])
    folder = Path(mdl.config.name_or_path)
    datasets, data_lines = data_facts(config, metrics)
    source = {
        "run": run_dir.resolve().name, "method": method,  # a name, not the machine's path
        "base_model": without_paths(load_json(kdir / META_FILE).get("base_model", {})),
        "base": base_model_facts(info["base_model"], folder, identify(folder)[0] if folder.is_dir() else None),
        "datasets": datasets, "data_lines": data_lines,
        "kernels": {f: v for f, v in sha256_files(kdir).items() if f in (KERNELS_FILE, META_FILE)},
        "adapter": None if info["adapter"] is None else {"sha256": sha256_files(info["adapter"]),
                                                         "merged": info["merged"]},
    }
    rows = card_metrics(metrics, method, adapted=info["adapter"] is not None) if metrics else None
    out = save_converted(mdl, to, tok, source, rows)
    log.info("exported %s (%s) to %s", run_dir, method, out)
    return out


def softmax_twin(model, base_model: str, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """`base_model` loaded afresh with converted `model`'s weights (its LoRA adapter merged in, whether it came merged
    or attached: an unmerged export) and softmax attention everywhere: the reference a converted layer is compared
    with under frozen attention."""
    from oal.models.registry import load_model

    twin, _, _ = load_model(base_model, dtype=dtype or next(model.parameters()).dtype, device=device)
    twin.load_state_dict({k: v for k, v in _merged_state_dict(model).items() if ".oal_method." not in k})
    return twin.eval()


def _merged_state_dict(model) -> dict:
    """`model`'s state dict with any attached LoRA (a peft model, or an unmerged export's adapter) merged into the
    base weights, under the base model's names; `model` itself is left as it is."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    if not any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        return model.state_dict()
    merged = copy.deepcopy(model.get_base_model() if hasattr(model, "get_base_model") else model)
    for name, module in [(n, m) for n, m in merged.named_modules() if isinstance(m, BaseTunerLayer)]:
        module.merge()
        parent, _, child = name.rpartition(".")
        setattr(merged.get_submodule(parent), child, module.get_base_layer())
    return merged.state_dict()
