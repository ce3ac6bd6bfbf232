"""Options and loading steps shared by several CLI commands (same help text, same clean errors)."""

from __future__ import annotations

from typing import Annotated

import typer

# `name: ModelOpt = "default"`: one declaration of each option the commands share.
ModelOpt = Annotated[str, typer.Option(help="'default' (embedded model), a local HF folder or a pinned hub id.")]
BaseModelOpt = Annotated[str, typer.Option(help="Base model (default: the one recorded in kernels.json).")]
DataOpt = Annotated[str, typer.Option(help="Corpus: 'builtin', 'wikitext-2-raw-v1', ... or a local path.")]
DataDirOpt = Annotated[str, typer.Option(help="Local WikiText folder (with manifest) for WikiText corpora.")]
LayersOpt = Annotated[str, typer.Option(help="'all', '3-20' or '1,4,7'. Default: the preset's conversion layers.")]
DeviceOpt = Annotated[str, typer.Option(help="torch device.")]


def load_model_or_fail(model: str, device: str):
    """`load_model(model, device=device)`; a bad name, path or file becomes a clean --model error."""
    from ..models.registry import load_model

    try:
        return load_model(model, device=device)
    except (ValueError, RuntimeError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None


def registry_preset(preset: str | None, mdl) -> str:
    """--preset, or the one detected from the model; must name a registry preset."""
    from ..models.registry import PRESETS, preset_for

    preset = preset or preset_for(mdl)
    if preset not in PRESETS:
        raise typer.BadParameter(f"expected one of {sorted(PRESETS)}, got {preset!r}", param_hint="--preset")
    return preset
