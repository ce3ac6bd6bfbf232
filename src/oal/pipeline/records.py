"""The JSON records of a run directory as the pipeline reads them: each one a JSON object
(`models.pretrained.read_json_object`) with the keys its reader uses checked, so a damaged file (hand-edited, cut
short, another program's) is a one-line ValueError naming it and what to do, never a traceback further on."""

from __future__ import annotations

from pathlib import Path

from oal.models.pretrained import read_json_object
from oal.rundir.claim import START_CLEAN

__all__ = ["REDO", "read_record", "run_config", "selection_record"]

REDO = START_CLEAN


def read_record(path: str | Path, expected: str, fix: str = REDO) -> dict:
    """The JSON object in `path`; ValueError naming it, `expected` and `fix` when it is missing or damaged."""
    try:
        return read_json_object(Path(path), expected)
    except ValueError as exc:
        raise ValueError(f"{exc}; {fix}") from None


def _damaged(path: Path, what: str, fix: str) -> ValueError:
    return ValueError(f"{path}: damaged, {what}; {fix}")


def run_config(path: str | Path, fix: str = REDO) -> dict:
    """A run's config.json (`path`: the file or its run directory), its "config" a JSON object."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    config = read_record(path, "the configuration of an `oal run` run directory", fix)
    if not isinstance(config.get("config"), dict):
        raise _damaged(path, "its 'config' is not a JSON object of settings", fix)
    methods = config["config"].get("methods", [])
    if not isinstance(methods, list) or not all(isinstance(m, str) for m in methods):
        raise _damaged(path, "its 'config.methods' is not a list of method names", fix)
    if "seeds" in config and not isinstance(config["seeds"], list):
        raise _damaged(path, "its 'seeds' is not a list of seeds", fix)
    return config


def selection_record(path: str | Path, fix: str = REDO) -> dict:
    """selection.json of `--layers auto:K`: its chosen and candidate layers lists of layer indices, its method a
    name, and the comparison's fields of the types `selection.comparison_sets` reads."""
    path = Path(path)
    sel = read_record(path, "the layer selection of `oal select-layers` / `oal run --layers auto:K`", fix)
    for key in ("chosen", "candidates", "paper_layers"):
        if not _layer_list(sel.get(key)):
            raise _damaged(path, f"its {key!r} is not a list of layer indices", fix)
    if not isinstance(sel.get("method"), str) or not isinstance(sel.get("by"), str):
        raise _damaged(path, "its 'method' and 'by' must be names", fix)
    order = sel.get("order")
    if not isinstance(order, dict) or not _layer_list(order.get(sel["by"])):
        raise _damaged(path, f"its 'order' holds no list of layers for {sel['by']!r}", fix)
    if not isinstance(sel.get("paper_k"), int) or isinstance(sel["paper_k"], bool):
        raise _damaged(path, "its 'paper_k' is not a number of layers", fix)
    return sel


def _layer_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
