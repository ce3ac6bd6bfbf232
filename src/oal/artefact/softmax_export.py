"""A run's softmax reference arm as one folder: `oal export --method softmax`.

The converted arms of a run are compared against softmax adapted with the same budget (its own LoRA adapter), so a
user who keeps a converted model should be able to keep that baseline too. It has no converted layer, so it is
written as the plain model it is: the family's config and `model.safetensors` (the run's LoRA adapter for softmax
merged into the base weights, `artefact.arms.load_arm`), the tokenizer, a model card (`card.reference_card_text`)
and oal.json with the SHA256 of every file and of the run files it came from (`models.pretrained.write_manifest`).
transformers loads it without oal; `models.pretrained.verify_manifest` checks it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from oal.rundir.files import atomic_write_text
from oal.rundir.hashes import sha256_files
from oal.rundir.lock import locked_atomic_dir

__all__ = ["export_softmax"]

log = logging.getLogger("oal")


def export_softmax(run_dir: str | Path, to: str | Path, *, adapter: bool = True, merge: bool = True,
                   model: str | None = None, dtype: torch.dtype | None = None, metrics: dict | None = None,
                   config: dict | None = None) -> Path:
    """Write the run's softmax arm (with its adapter merged unless `adapter=False`) as one folder `to`;
    arguments as `artefact.export.export`. An unmerged adapter has no place in a plain transformers folder, so
    `merge=False` is refused."""
    from oal.artefact.arms import load_arm
    from oal.artefact.base_facts import base_model_facts, data_facts
    from oal.artefact.card import card_metrics, reference_card_text
    from oal.artefact.folder_io import cast_base_weights, save_tokenizer, without_paths, writable_target
    from oal.models.encoder import is_encoder
    from oal.models.pretrained import read_json_object, write_manifest
    from oal.models.provenance import model_dtype
    from oal.models.registry import identify

    if not merge:
        raise ValueError("merge: the softmax arm is written as a plain transformers model, its adapter merged into "
                         "the weights (--no-merge applies to the converted arms)")
    run_dir, to = Path(run_dir), Path(to)
    writable_target(to)
    mdl, tok, info = load_arm(run_dir, "softmax", adapter, model=model)  # checked against the run's record
    if dtype is not None:
        cast_base_weights(mdl, dtype)
    record = read_json_object(run_dir / "config.json", "the configuration of an `oal run` run directory")["model"]
    folder = Path(mdl.config.name_or_path)
    datasets, data_lines = data_facts(config, metrics)
    source = {
        "run": run_dir.resolve().name, "method": "softmax",
        "base_model": without_paths({"name_or_path": record.get("model"), "dtype": record.get("dtype"),
                                      "state_dict_sha256": record.get("state_dict_sha256")}),
        "base": base_model_facts(info["base_model"], folder, identify(folder)[0] if folder.is_dir() else None),
        "datasets": datasets, "data_lines": data_lines,
        "adapter": None if info["adapter"] is None else {"sha256": sha256_files(info["adapter"]), "merged": True},
    }
    rows = card_metrics(metrics, "softmax", adapted=info["adapter"] is not None) if metrics else None
    with locked_atomic_dir(to) as tmp:  # what a killed export left beside `to` goes first
        save_tokenizer(tok, tmp, getattr(mdl.config, "max_position_embeddings", None))
        mdl.save_pretrained(tmp)  # the family's own form: config.json, model.safetensors, generation_config.json
        write_manifest(tmp, source)
        atomic_write_text(tmp / "README.md", reference_card_text(source, rows, model_dtype(mdl), is_encoder(mdl)))
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, 0o644)  # writers that go through mkstemp leave 0600; these are ordinary shared files
    log.info("exported %s (softmax) to %s", run_dir, to)
    return to
