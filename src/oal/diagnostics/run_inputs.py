"""What `oal diagnose` takes from an `oal run` directory: its model name, corpus and split plan (the token blocks,
checked against the hashes its config.json records), preset, converted layers, calibration and grouping settings,
seed, and its methods' settings (--window, --sinks)."""

from __future__ import annotations

from pathlib import Path

import torch

from oal.errors import InputError
from oal.models.pretrained import read_json_object
from oal.rundir.claim import START_CLEAN

__all__ = ["read_run", "run_blocks"]


def read_run(out_dir: str | Path) -> dict | None:
    """The settings of the `oal run` directory `out_dir` (None when its config.json is not an `oal run`'s)."""
    path = Path(out_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        data = read_json_object(path, "the configuration of an `oal run` run directory (or of a model)")
    except ValueError as exc:
        raise ValueError(f"{exc}; {START_CLEAN}") from None
    cfg = data.get("config")
    if not isinstance(cfg, dict) or "model" not in cfg or not isinstance(data.get("split_plan"), dict):
        return None
    return {"model": str(cfg["model"]), "preset": cfg.get("preset"), "data": cfg.get("data", "builtin"),
            "data_dir": cfg.get("data_dir"),
            "calib": dict(cfg.get("calib") or {}), "grouping": dict(cfg.get("grouping") or {}),
            "seed": cfg.get("seed"), "plan": data["split_plan"], "blocks": data.get("blocks") or {},
            "layers": _converted_layers(Path(out_dir), data.get("converted_layers")), "path": str(path),
            "options": {k: cfg[k] for k in ("window", "sinks") if cfg.get(k) is not None}}  # its windows' settings


def _converted_layers(run_dir: Path, recorded) -> list[int] | None:
    """The layers the run converts. A `--layers auto:K` run (and `oal select-layers`) records its selection
    ({"by", "k", "candidates"}), not layers: its layers are selection.json's choice once made (None before)."""
    if isinstance(recorded, list):
        return [int(i) for i in recorded]
    sel = run_dir / "selection.json"
    if isinstance(recorded, dict) and sel.is_file():
        chosen = read_json_object(sel, "the layer selection of `oal select-layers` / `oal run --layers auto:K`; "
                                       "rerun it").get("chosen")
        return [int(i) for i in chosen] if isinstance(chosen, list) else None
    return None


def run_blocks(run: dict, tokenizer) -> dict[str, torch.Tensor]:
    """The run's token blocks per role, rebuilt from its corpus and split plan; refused unless every role's content
    hash matches the one the run recorded (another tokenizer or corpus would give another experiment)."""
    from oal.data import load_corpus
    from oal.data.splits import SplitPlan, plan_blocks
    from oal.rundir.hashes import tensor_hash

    corpus = load_corpus(run["data"], data_dir=run["data_dir"])
    blocks = plan_blocks(corpus, tokenizer, SplitPlan.from_dict(run["plan"]), data_dir=run["data_dir"])
    for role, rec in run["blocks"].items():
        want = rec.get("sha256_16") if isinstance(rec, dict) else None
        if role in blocks and want and tensor_hash(blocks[role]) != want:
            raise InputError(f"the {role} blocks rebuilt from {run['path']} (corpus {run['data']!r}) do not match the "
                             "hashes the run recorded", "--out")
    return blocks
